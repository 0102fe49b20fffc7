"""Evaluation reports under eval.out_dir: <checkpoint>.tsv per checkpoint, report.json, report.md, report.png,
report.html.

Each TSV row is one sample of one item (eval.num_samples per item, distinct seeds, the same seeds for every
checkpoint) with every judge's transcript and error rate. The summary is computed from the TSVs alone
(`python -m grpo.evaluate.report render` redoes it without decoding): per checkpoint and judge, `cer` is the
mean over items of each item's mean rate over its scored samples, with a 95 % bootstrap interval over items
(grpo.evaluate.stats); against `base` a paired bootstrap gives the difference, its interval and a p-value;
the hacking gap for each held-out judge J is (base - checkpoint under the reward's judge) - (base - checkpoint
under J): how much of the improvement only the reward's own ASR sees. `failures` (no speech, synthesis or
ASR errors) are listed in the TSV and excluded.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

from grpo.evaluate import stats
from grpo.evaluate.cer import mean_error_rate
from grpo.evaluate.html_report import SYNTHETIC_SPEAKER
from grpo.layout import EvalDir, step_of

# tokens: speech tokens generated; wav: the audio's path relative to eval.out_dir ("" when none was written)
TSV_HEADER = ["id", "sample", "language", "reference", "transcript", "error_rate", "tokens", "sim", "wav"]


def _rate(x) -> str:
    return "" if x is None else f"{x:.6f}"


def write_checkpoint(out_dir: Path, name: str, scored, unit: str, judges: list[str] = ()) -> dict:
    """<name>.tsv (one row per sample, a transcript and rate column per extra judge); returns the plain summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(EvalDir(out_dir).tsv(name), "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(TSV_HEADER + [c for j in judges for c in (f"transcript@{j}", f"error_rate@{j}")])
        for s in scored:
            extra = [c for j in judges for c in (s.judges[j][0], _rate(s.judges[j][1]))]
            w.writerow([s.id, s.sample, s.language, s.reference, s.transcript, _rate(s.error_rate), s.tokens,
                        _rate(s.sim), s.wav] + extra)
    rates = [s.error_rate for s in scored if s.error_rate is not None]
    per_item = stats.per_item_means([{"id": s.id, "v": s.error_rate} for s in scored], "v")
    summary = {"cer": mean_error_rate(list(per_item.values())), "count": len(rates),
               "failures": len(scored) - len(rates), "unit": unit, "tsv": EvalDir(out_dir).tsv(name).name}
    sims = [s.sim for s in scored if s.sim is not None]
    if sims:
        summary.update(sim=sum(sims) / len(sims), sim_count=len(sims))
    return summary


def read_tsv(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def _values(rows: list[dict], column: str) -> dict[str, float]:
    return stats.per_item_means([{"id": r["id"], "v": float(r[column]) if r.get(column) else None} for r in rows], "v")


def _with_interval(per_item: dict[str, float], resamples: int, seed: int, mean=mean_error_rate) -> dict:
    values = list(per_item.values())
    return {"mean": float(mean(values)) if values else math.nan, "ci": stats.bootstrap_ci(values, resamples, seed)}


def checkpoint_names(out_dir: Path) -> list[str]:
    """The checkpoints with a TSV: base first, then steps in order, then any others."""
    names = [p.stem for p in out_dir.glob("*.tsv")]
    def step(name: str) -> float:
        n = step_of(name)
        return math.inf if n is None else n
    return sorted(names, key=lambda n: (n != "base", step(n), n))


def summarize(out_dir: Path, names: list[str], unit: str, primary: str, reward_judge: str | None = None,
              margin: float = 0.02, resamples: int = 2000, seed: int = 0) -> dict:
    """report.json's content from the TSVs: per checkpoint the primary judge's figures at the top level (cer,
    cer_ci, delta, delta_ci, p_value, sim...), every judge's under `judges`, and the hacking gaps."""
    tables = {n: read_tsv(EvalDir(out_dir).tsv(n)) for n in names}
    summary: dict[str, dict] = {}
    for name, rows in tables.items():
        cols = {primary: "error_rate", **{c.split("@", 1)[1]: c for c in (rows[0] if rows else {})
                                          if c.startswith("error_rate@")}}
        per_judge = {j: _values(rows, c) for j, c in cols.items()}
        r = {"unit": unit, "tsv": EvalDir(out_dir).tsv(name).name, "items": len(per_judge[primary]),
             "samples": max((int(x["sample"]) + 1 for x in rows), default=0),
             "count": sum(bool(x["error_rate"]) for x in rows), "failures": sum(not x["error_rate"] for x in rows),
             "judges": {}}
        for j, per_item in per_judge.items():
            fig = _with_interval(per_item, resamples, seed)
            entry = {"cer": fig["mean"], "cer_ci": fig["ci"]}
            if name != "base" and "base" in tables:
                base_items = _values(tables["base"], cols[j])
                common = sorted(set(base_items) & set(per_item))
                test = stats.paired_bootstrap([base_items[i] for i in common], [per_item[i] for i in common],
                                              resamples, seed)
                entry.update(delta=test["delta"], delta_ci=test["ci"], p_value=test["p_value"], paired=len(common))
            r["judges"][j] = entry
        r.update({k: v for k, v in r["judges"][primary].items()})
        sims = _values(rows, "sim")
        if sims:
            fig = _with_interval(sims, resamples, seed, mean=lambda v: sum(v) / len(v))
            r.update(sim=fig["mean"], sim_ci=fig["ci"], sim_count=len(sims))
        if reward_judge and name != "base" and reward_judge in r["judges"] and "delta" in r["judges"][reward_judge]:
            seen_by_reward = -r["judges"][reward_judge]["delta"]        # improvement = base - checkpoint
            r["hacking_gap"] = {j: {"gap": seen_by_reward - (-e["delta"]),
                                    "flagged": seen_by_reward - (-e["delta"]) > margin}
                                for j, e in r["judges"].items() if j != reward_judge and "delta" in e}
        summary[name] = r
    return summary


def _delta(cer: float, base: float | None) -> str:
    if base is None or math.isnan(base) or math.isnan(cer):
        return "–"
    rel = f" ({(cer - base) / base:+.1%})" if base > 0 else ""
    return f"{cer - base:+.4f}{rel}"


def _ci(ci) -> str:
    return "" if not ci or any(math.isnan(x) for x in ci) else f" [{ci[0]:.4f}, {ci[1]:.4f}]"


def speaker_note(speaker_model: str | None) -> str:
    if not speaker_model:
        return "SIM: not computed (eval.speaker_model unset)."
    if speaker_model == SYNTHETIC_SPEAKER:
        return ("SIM: the synthetic reward's stand-in (SyntheticVoices: the tokens' mean voice vector against the "
                "item's speaker), read from the tokens; no audio.")
    return (f"SIM: cosine of speaker embeddings by {Path(speaker_model).name} (CosyVoice2's CAM++ verifier when "
            "campplus.onnx), not Seed-TTS-eval's WavLM-TDNN: compare SIM figures only within this report.")


def write_summary(out_dir: Path, summary: dict, speaker_model: str | None = None) -> None:
    files = EvalDir(out_dir)
    files.report_json.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    base = summary.get("base", {}).get("cer")
    first = next(iter(summary.values()), {})
    unit, samples = first.get("unit", ""), first.get("samples", 1)
    lines = ["# Zero-shot evaluation", "", f"Error unit: {unit}; figure: mean over items of per-utterance rates "
             f"(Seed-TTS-eval protocol), {samples} sample(s) per item; [95 % bootstrap interval over items]; "
             "Δ vs base: paired bootstrap, p two-sided.", "", speaker_note(speaker_model), "",
             "| checkpoint | CER [95 % CI] | Δ vs base [95 % CI] | p | scored | failures | SIM [95 % CI] |",
             "|---|---|---|---|---|---|---|"]
    for name, r in summary.items():
        sim = f"{r['sim']:.3f}{_ci(r.get('sim_ci'))}" if "sim" in r else "–"
        delta = f"{_delta(r['cer'], base)}{_ci(r.get('delta_ci'))}" if name != "base" else "–"
        p = f"{r['p_value']:.3f}" if "p_value" in r else "–"
        lines.append(f"| {name} | {r['cer']:.4f}{_ci(r.get('cer_ci'))} | {delta} | {p} | {r['count']} | "
                     f"{r['failures']} | {sim} |")
    if len(first.get("judges", {})) > 1:
        lines += ["", "## Judges", "", "| checkpoint | judge | CER [95 % CI] | Δ vs base [95 % CI] | p |",
                  "|---|---|---|---|---|"]
        for name, r in summary.items():
            for j, e in r["judges"].items():
                d = f"{e['delta']:+.4f}{_ci(e['delta_ci'])}" if "delta" in e else "–"
                p = f"{e['p_value']:.3f}" if "p_value" in e else "–"
                lines.append(f"| {name} | {j} | {e['cer']:.4f}{_ci(e['cer_ci'])} | {d} | {p} |")
    gaps = [(n, j, g) for n, r in summary.items() for j, g in r.get("hacking_gap", {}).items()]
    if gaps:
        lines += ["", "## Hacking gap", "", "(improvement under the reward's judge) − (improvement under the held-out "
                  "judge); flagged above the margin (eval.hacking_margin).", "",
                  "| checkpoint | held-out judge | gap | flagged |", "|---|---|---|---|"]
        lines += [f"| {n} | {j} | {g['gap']:+.4f} | {'**yes**' if g['flagged'] else 'no'} |" for n, j, g in gaps]
    files.report_md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    plot(files.report_png, summary)


def plot(path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    cers = [summary[n]["cer"] for n in names]
    err = [[max(0.0, c - summary[n].get("cer_ci", [c, c])[0]) for n, c in zip(names, cers)],
           [max(0.0, summary[n].get("cer_ci", [c, c])[1] - c) for n, c in zip(names, cers)]]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(names)), 3.5))
    ax.bar(names, cers, yerr=err, capsize=4, color=["#888" if n == "base" else "#3a7" for n in names])
    ax.set_ylabel("CER (mean per utterance)")
    ax.set_title("zero-shot CER (95 % bootstrap CI)")
    for i, n in enumerate(names):
        ax.annotate(f"{summary[n]['cer']:.3f}", (i, summary[n]["cer"]), ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_summary(out_dir: Path) -> int:
    files = EvalDir(out_dir)
    path = files.report_json
    if not path.exists():
        print(f"no report at {path}")
        return 1
    summary = json.loads(path.read_text())
    names = [n for n in summary if n != "base"]
    print(f"report: {files.report_md} (json: {path}, plot: {files.report_png})")
    if "base" in summary:
        print(f"base CER  {summary['base']['cer']:.4f}")
    if names:
        final = names[-1]
        delta = _delta(summary[final]["cer"], summary.get("base", {}).get("cer"))
        print(f"final CER {summary[final]['cer']:.4f} ({final}; {delta} vs base)")
    return 0


def check(out_dir: Path, max_ratio: float) -> int:
    """Exit status for CI: the last trained checkpoint was scored and its CER is below max_ratio x base."""
    summary = json.loads(EvalDir(out_dir).report_json.read_text())
    trained = [n for n in summary if n != "base"]
    problems = []
    if "base" not in summary or not trained:
        problems.append(f"report.json lacks base or a trained checkpoint: {list(summary)}")
    else:
        base, final = summary["base"], summary[trained[-1]]
        if min(base["count"], final["count"]) == 0:
            problems.append("a checkpoint has no scored items")
        elif not final["cer"] < max_ratio * base["cer"]:
            problems.append(f"{trained[-1]} CER {final['cer']:.4f} is not below {max_ratio} x base {base['cer']:.4f}")
    for p in problems:
        print(f"[report check] {p}", file=sys.stderr)
    if not problems:
        print(f"[report check] ok: {trained[-1]} CER {summary[trained[-1]]['cer']:.4f} < {max_ratio} x base "
              f"{summary['base']['cer']:.4f}")
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    import argparse

    from grpo.config import load_config

    parser = argparse.ArgumentParser(prog="python -m grpo.evaluate.report")
    parser.add_argument("action", choices=["summary", "check", "render"],
                        help="render: recompute report.json/md/png/html from the TSVs under eval.out_dir")
    parser.add_argument("--max-ratio", type=float, default=1.0, help="check: final CER must be below this x base")
    args, overrides = parser.parse_known_args(argv)
    e = load_config(overrides).eval
    out_dir = Path(e.out_dir)
    if args.action == "render":
        names = checkpoint_names(out_dir)
        if not names:
            print(f"no <checkpoint>.tsv under {out_dir}: run stage 4 first (bash run.sh 4 4)", file=sys.stderr)
            return 1
        render(out_dir, names, e)
        return print_summary(out_dir)
    if args.action == "check":
        return check(out_dir, args.max_ratio)
    status = print_summary(out_dir)
    for extra in e.get("extra_sets") or []:            # (eval.extra_sets: each set's report in its own folder)
        print(f"{extra.name} set:")
        print_summary(EvalDir(out_dir).extra(extra.name).root)
    return status


def unit_of(e) -> str:
    return "pinyin syllable (synthetic codebook)" if e.asr == "synthetic" else "Seed-TTS-eval CER/WER"


def render(out_dir: Path, names: list[str], e) -> dict:
    """The whole report from the TSVs, with the eval config's judges, margin and bootstrap settings."""
    from grpo.evaluate.html_report import write_html

    summary = summarize(out_dir, names, unit_of(e), e.asr, e.reward_judge, e.hacking_margin,
                        e.bootstrap.resamples, e.bootstrap.seed)
    write_summary(out_dir, summary, e.speaker_model)
    write_html(out_dir, summary, {n: read_tsv(EvalDir(out_dir).tsv(n)) for n in names}, e.asr,
               speaker_note(e.speaker_model))
    return summary


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
