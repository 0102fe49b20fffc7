"""data.sources: the recipe's training text, prompt speakers and zero-shot sets fetched and converted once.

The datasets are built locally in the hub's schemas and layouts (hub_sets.py); the voxbox file is read through
`hf_hub_download` from a hub cache (offline), the audio sets through `datasets.load_dataset` on a folder in the
repository's layout: the same calls as for the hub ids, without the network. Expected values come from the rows
written here, never from the code under test."""

from __future__ import annotations

import json
import subprocess
import sys

import huggingface_hub.constants
import numpy as np
import pytest
import soundfile as sf
from hub_sets import aishell_repo, tone, voxbox_in_hub_cache, wav_bytes, zero_shot_repo

from grpo.config import REPO_ROOT, load_config
from grpo.data import sources
from grpo.data.sources import SourceError, fetch

TEXTS = [f"第{i}句训练文本" for i in range(8)]


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """Local copies of the four sources, and the hub cache holding voxbox's metadata (offline)."""
    cache = tmp_path / "hf_cache"
    voxbox_in_hub_cache(cache, TEXTS + ["与评测重合的句子"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    prompts = [(wav_bytes(tone(2.0 + k / 4, 16000, freq=200 + 20 * k), 16000), " ".join(f"提示{k}号"))
               for k in range(5)]
    prompts[1] = (wav_bytes(tone(2.0, 16000, amplitude=1e-5), 16000), "静 音")          # silent: skipped
    prompts[3] = (wav_bytes(tone(0.3, 16000), 16000), "太 短")                          # 0.3 s: skipped
    aishell = aishell_repo(tmp_path / "aishell", prompts)
    item = lambda i, sr: {"id": f"utt{i}", "prompt_text": f"提示文本{i}", "target_text": f"目标文本{i}",  # noqa: E731
                          "prompt_audio": wav_bytes(tone(1.5 + i / 10, sr, freq=300 + 10 * i), sr)}
    cv3 = zero_shot_repo(tmp_path / "cv3", {"zero_shot_zh": [item(i, 24000) for i in range(3)],
                                            "zero_shot_en": [item(9, 16000)]})
    seed = zero_shot_repo(tmp_path / "seed", {"test_zh": [item(4, 16000), {**item(5, 16000),
                                                                           "target_text": "与评测重合的句子"}]})
    return {"cache": cache, "aishell": aishell, "cv3": cv3, "seed": seed, "prompts": prompts}


def overrides(tmp_path, hub, **extra) -> list[str]:
    out = tmp_path / "exp" / "data" / "sources"
    keys = {
        "data.sources.text": "{hub: SparkAudio/voxbox, file: metadata/aishell-3.jsonl, train_lines: 5, val_lines: 2}",
        "data.sources.prompts": f"{{path: {hub['aishell']}, config: test, split: test, speakers: 3}}",
        "data.sources.eval": f"[{{name: cv3_zero_shot_zh, path: {hub['cv3']}, split: zero_shot_zh}},"
                             f"{{name: seedtts_test_zh, path: {hub['seed']}, split: test_zh}}]",
        **extra}
    return ["profile=cosyvoice2", f"exp_dir={tmp_path / 'exp'}", f"data.sources.out_dir={out}",
            *[f"{k}={v}" for k, v in keys.items()]]


def test_every_source_lands_in_the_project_layout_and_a_rerun_touches_nothing(tmp_path, hub, monkeypatch):
    cfg = load_config(overrides(tmp_path, hub))
    fetch(cfg)
    out = tmp_path / "exp" / "data" / "sources"
    # text: the recipe's split (head -n train_lines, tail -n val_lines) of the 9 lines written above
    train = [json.loads(x) for x in (out / "text" / "train.jsonl").read_text().splitlines()]
    val = [json.loads(x) for x in (out / "text" / "val.jsonl").read_text().splitlines()]
    assert [r["text"] for r in train] == TEXTS[:5] and [r["text"] for r in val] == [TEXTS[7], "与评测重合的句子"]
    assert train[0] == {"text": TEXTS[0], "id": "AISHELL-3_0000000000", "language": "zh"}
    # prompts: 3 clips, none of the silent or short ones, spaces removed from AISHELL's transcript, audio as written
    clips = [json.loads(x) for x in (out / "prompts" / "clips.jsonl").read_text().splitlines()]
    assert len(clips) == 3 and {c["row"] for c in clips} <= {0, 2, 4}
    for c in clips:
        wav_bytes_, text = hub["prompts"][c["row"]]
        assert c["text"] == text.replace(" ", "")
        got, sr = sf.read(out / "prompts" / c["wav"], dtype="float32")
        want, want_sr = sf.read(__import__("io").BytesIO(wav_bytes_), dtype="float32")
        assert sr == want_sr and np.array_equal(got, want)         # 16-bit in, 16-bit out: the same samples
    # eval: meta.lst in Seed-TTS-eval's layout, every item, the wav at its own rate (24 kHz kept)
    meta = (out / "eval" / "cv3_zero_shot_zh" / "meta.lst").read_text().splitlines()
    assert meta == [f"utt{i}|提示文本{i}|wavs/utt{i}.wav|目标文本{i}" for i in range(3)]
    assert sf.info(out / "eval" / "cv3_zero_shot_zh" / "wavs" / "utt0.wav").samplerate == 24000
    assert len((out / "eval" / "seedtts_test_zh" / "meta.lst").read_text().splitlines()) == 2
    # a second run: no network, no dataset read, no file rewritten
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    monkeypatch.setattr(sources, "text_file", lambda *a: pytest.fail("text source read again"))
    monkeypatch.setattr(sources, "audio_dataset", lambda *a: pytest.fail("audio source read again"))
    assert fetch(load_config(overrides(tmp_path, hub))) == []
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == mtimes


def test_a_changed_spec_is_fetched_again(tmp_path, hub):
    fetch(load_config(overrides(tmp_path, hub)))
    text = "{hub: SparkAudio/voxbox, file: metadata/aishell-3.jsonl, train_lines: 4, val_lines: 2}"
    again = fetch(load_config(overrides(tmp_path, hub, **{"data.sources.text": text})))
    assert [p.name for p in again] == ["text"]
    assert len((tmp_path / "exp/data/sources/text/train.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize("key, value, message", [
    ("data.sources.eval", "[{name: x, path: <cv3>, split: zero_shot_xx}]", "data.sources.eval[0].path="),
    ("data.sources.eval", "[{name: x, path: <cv3>, split: zero_shot_zh, target_text: text}]", "target_text=text"),
    ("data.sources.prompts", "{path: <aishell>, config: dev, split: test}", "data.sources.prompts.path="),
    ("data.sources.prompts", "{path: /no/such/copy, config: test, split: test}", "/no/such/copy config=test "
                                                                                 "split=test: FileNotFoundError"),
    ("data.sources.prompts", "{path: <aishell>, config: test, split: test, speakers: 4}", "speakers=4: only 3"),
    ("data.sources.text", "{hub: SparkAudio/voxbox, file: metadata/nope.jsonl}", "data.sources.text.hub="),
    ("data.sources.text", "{hub: SparkAudio/voxbox, file: metadata/aishell-3.jsonl, train_lines: 8}", "overlap"),
    ("data.sources.eval", "[{name: x, hub: yuekai/CV3-Eval, split: zero_shot_zh}]", "data.sources.eval[0].hub="),
])
def test_a_bad_source_stops_in_one_line_naming_the_key_and_writes_nothing(tmp_path, hub, monkeypatch, key, value,
                                                                         message):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)    # "no network" for the hub id
    value = value.replace("<cv3>", str(hub["cv3"])).replace("<aishell>", str(hub["aishell"]))
    with pytest.raises(SourceError) as err:
        fetch(load_config(overrides(tmp_path, hub, **{key: value})))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert list((tmp_path / "exp").rglob("*")) == []            # no file, no empty folder


def test_unreadable_audio_names_the_item(tmp_path, hub):
    bad = zero_shot_repo(tmp_path / "bad", {"test_zh": [{"id": "broken", "prompt_text": "a", "target_text": "b",
                                                         "prompt_audio": b"RIFF not a wav"}]})
    with pytest.raises(SourceError, match=r"data.sources.eval\[0\] item broken: unreadable audio"):
        fetch(load_config(overrides(tmp_path, hub, **{
            "data.sources.eval": f"[{{name: b, path: {bad}, split: test_zh}}]"})))
    assert not (tmp_path / "exp" / "data" / "sources" / "text").exists()     # the good text source not kept


def test_the_data_stage_fetches_then_writes_the_recipe_split_without_eval_targets(tmp_path, hub):
    """`bash run.sh 0 0 profile=cosyvoice2` with the sources local: stage 0 fetches (no stage -1 ran), drops the
    training line that is an evaluation target (data.eval_overlap=drop) and writes the parquet; a bad key ends in one
    line on stderr with exit status 1."""
    import pandas as pd

    env = {"HF_HUB_CACHE": str(hub["cache"]), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    args = [sys.executable, "-m", "grpo", "data", *overrides(tmp_path, hub, **{
        "data.sources.text": "{hub: SparkAudio/voxbox, file: metadata/aishell-3.jsonl, train_lines: 9, val_lines: 0}",
        "data.val_file": "null", "data.text_frontend": "false", "train.batch_size": "2"})]
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = pd.read_parquet(tmp_path / "exp" / "data" / "train.parquet")
    assert list(rows.reward_model.map(lambda r: r["ground_truth"])) == TEXTS       # the overlapping line dropped
    assert "1 line(s) are targets of the evaluation set seedtts_test_zh" in done.stderr
    bad = subprocess.run([*args, "data.sources.prompts.split=nope"], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "data.sources.prompts.path=" in bad.stderr and "split=nope" in bad.stderr
