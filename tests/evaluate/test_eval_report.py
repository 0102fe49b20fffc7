"""The evaluation report's statistics and judges, checked against independent computations: scipy's bootstrap,
hand-derived numbers; the report re-rendered from its TSVs alone."""

import json
import subprocess
import sys

import numpy as np
import pytest

from grpo.config import REPO_ROOT
from grpo.evaluate import report, stats
from grpo.evaluate.evaluator import Scored
from grpo.layout import EvalDir

RATES = np.array([0.0, 0.1, 0.5, 0.2, 0.0, 0.9, 0.3, 0.05, 0.6, 0.15, 0.0, 0.4])


def test_bootstrap_interval_agrees_with_scipy():
    from scipy.stats import bootstrap

    ours = stats.bootstrap_ci(RATES, resamples=20000, seed=1)
    ref = bootstrap((RATES,), np.mean, n_resamples=20000, method="percentile", confidence_level=0.95,
                    random_state=7).confidence_interval
    assert ours[0] == pytest.approx(ref.low, abs=0.01) and ours[1] == pytest.approx(ref.high, abs=0.01)
    assert ours[0] < RATES.mean() < ours[1]
    assert stats.bootstrap_ci([0.25] * 5) == [0.25, 0.25]             # no spread, no interval


def test_paired_bootstrap_agrees_with_scipy_and_hand_cases():
    from scipy.stats import bootstrap

    other = RATES - np.array([0.0, 0.1, 0.2, 0.1, 0.0, 0.3, 0.1, 0.0, 0.2, 0.1, 0.0, 0.1])
    test = stats.paired_bootstrap(RATES, other, resamples=20000, seed=1)
    assert test["delta"] == pytest.approx(-0.1)                          # the mean paired difference, by hand
    ref = bootstrap((RATES, other), lambda a, b: np.mean(b - a), paired=True, n_resamples=20000,
                    method="percentile", random_state=7).confidence_interval
    assert test["ci"][0] == pytest.approx(ref.low, abs=0.01) and test["ci"][1] == pytest.approx(ref.high, abs=0.01)
    # every paired difference <= 0, 8 of 12 < 0: a mean difference >= 0 needs all 12 draws among the 4 zeros
    assert test["p_value"] < 1e-3
    # differences +0.1 and -0.1 on two items: resampled means are <= 0 with probability 3/4 and >= 0 with 3/4
    sym = stats.paired_bootstrap([0.5, 0.5], [0.6, 0.4], resamples=40000, seed=2)
    assert sym["delta"] == pytest.approx(0.0) and sym["p_value"] == 1.0
    with pytest.raises(ValueError, match="same items"):
        stats.paired_bootstrap([0.1, 0.2], [0.1])


def write(tmp_path, name, rows):
    """rows: (id, sample, primary rate, alt rate); each transcript names its rate so that the page can be checked."""
    scored = [Scored(i, "今天天气", f"hyp-{i}-{s}", r, 4, sample=s, wav=f"{name}/{i}_{s}.wav",
                     judges={"synthetic_alt": (f"alt-{i}-{s}", a)}) for i, s, r, a in rows]
    report.write_checkpoint(tmp_path, name, scored, "unit", ["synthetic_alt"])


def test_report_figures_and_hacking_gap_by_hand(tmp_path):
    """Two items x 2 samples. base: primary rates a (.4, .2) b (.6, .4) -> item means .3 / .5, CER .4; alt (.5,
    .5) / (.5, .7) -> .5 / .6, CER .55. step_2: primary a (.1, .1) b (.2, .2) -> .1 / .2, CER .15; alt (.4, .4)
    / (.6, .6) -> .4 / .6, CER .5. Improvement under the reward's judge (primary) .25, under alt .05: gap .20."""
    write(tmp_path, "base", [("a", 0, .4, .5), ("a", 1, .2, .5), ("b", 0, .6, .5), ("b", 1, .4, .7)])
    write(tmp_path, "step_2", [("a", 0, .1, .4), ("a", 1, .1, .4), ("b", 0, .2, .6), ("b", 1, .2, .6)])
    s = report.summarize(tmp_path, ["base", "step_2"], "unit", "synthetic", reward_judge="synthetic", margin=0.1)
    assert s["base"]["cer"] == pytest.approx(0.4) and s["base"]["judges"]["synthetic_alt"]["cer"] == pytest.approx(.55)
    assert s["step_2"]["cer"] == pytest.approx(0.15) and s["step_2"]["delta"] == pytest.approx(-0.25)
    assert s["step_2"]["samples"] == 2 and s["step_2"]["items"] == 2 and s["step_2"]["count"] == 4
    gap = s["step_2"]["hacking_gap"]["synthetic_alt"]
    assert gap["gap"] == pytest.approx(0.20) and gap["flagged"]
    # the held-out judge as the reward's: the gap changes sign (the roles are not interchangeable)
    swapped = report.summarize(tmp_path, ["base", "step_2"], "unit", "synthetic", reward_judge="synthetic_alt")
    assert swapped["step_2"]["hacking_gap"]["synthetic"]["gap"] == pytest.approx(-0.20)


def test_same_judge_twice_has_no_gap(tmp_path):
    write(tmp_path, "base", [("a", 0, .4, .4), ("b", 0, .6, .6)])
    write(tmp_path, "step_1", [("a", 0, .1, .1), ("b", 0, .3, .3)])
    s = report.summarize(tmp_path, ["base", "step_1"], "unit", "synthetic", reward_judge="synthetic")
    assert s["step_1"]["hacking_gap"]["synthetic_alt"]["gap"] == pytest.approx(0.0, abs=1e-12)
    assert not s["step_1"]["hacking_gap"]["synthetic_alt"]["flagged"]


def test_render_rebuilds_the_report_from_the_tsvs(tmp_path):
    write(tmp_path, "base", [("a", 0, .4, .5), ("b", 0, .6, .5)])
    write(tmp_path, "step_10", [("a", 0, .1, .4), ("b", 0, .2, .6)])
    write(tmp_path, "step_2", [("a", 0, .3, .5), ("b", 0, .5, .5)])
    assert report.checkpoint_names(tmp_path) == ["base", "step_2", "step_10"]
    cmd = [sys.executable, "-m", "grpo.evaluate.report", "render", f"eval.out_dir={tmp_path}", "eval.asr=synthetic",
           "eval.reward_judge=synthetic"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(EvalDir(tmp_path).report_json.read_text())
    assert list(got) == ["base", "step_2", "step_10"] and got["step_10"]["cer"] == pytest.approx(0.15)
    assert "hacking_gap" in got["step_10"] and EvalDir(tmp_path).report_html.exists()
    assert "| step_10 | synthetic_alt |" in EvalDir(tmp_path).report_md.read_text()
    empty = subprocess.run([*cmd[:4], f"eval.out_dir={tmp_path / 'none'}"], cwd=REPO_ROOT, capture_output=True,
                           text=True)
    assert empty.returncode == 1 and "run stage 4 first" in empty.stderr


def test_summary_prints_each_extra_set(tmp_path, capsys):
    """`python -m grpo.evaluate.report summary` (what `bash run.sh` ends with): the main set, then each of
    eval.extra_sets from its own folder."""
    import json

    for d, (base, last) in {tmp_path: (0.5, 0.3), tmp_path / "seen": (0.4, 0.1)}.items():
        d.mkdir(exist_ok=True)
        EvalDir(d).report_json.write_text(json.dumps({"base": {"cer": base}, "step_200": {"cer": last}}))
    assert report.main(["summary", f"eval.out_dir={tmp_path}", "eval.extra_sets=[{name: seen, data_path: x}]"]) == 0
    out = capsys.readouterr().out
    main, seen = out.split("seen set:")
    assert "final CER 0.3000 (step_200; -0.2000 (-40.0%) vs base)" in main
    assert "final CER 0.1000 (step_200; -0.3000 (-75.0%) vs base)" in seen


def test_checkpoints_follow_their_step_numbers_not_their_names(tmp_path):
    """step_10 after step_2 (a name sort puts it first): in the report's order and in stage 4's selection, where a
    merged verl checkpoint wins over a local one of the same step and a folder that is no step_N is no checkpoint."""
    from omegaconf import OmegaConf

    from grpo.checkpoint_selection import trained_checkpoints
    from grpo.layout import TrainDir

    for name in ("step_10", "base", "step_2", "other"):
        (tmp_path / f"{name}.tsv").write_text("")
    assert report.checkpoint_names(tmp_path) == ["base", "step_2", "step_10", "other"]

    files = TrainDir(tmp_path / "train")
    for root, name in ((files.local_checkpoints, "step_10"), (files.local_checkpoints, "step_2"),
                       (files.merged, "step_2"), (files.local_checkpoints, "step_x")):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")
    found = trained_checkpoints(OmegaConf.create({"train": {"out_dir": str(tmp_path / "train")}}))
    assert list(found) == ["step_2", "step_10"] and found["step_2"] == files.merged / "step_2"
