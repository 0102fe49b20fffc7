"""Evaluation reports under eval.out_dir: <checkpoint>.tsv per checkpoint, report.json, report.md, report.png.

report.json maps each checkpoint name (the base model is `base`) to {"cer", "count", "failures", ...}:
`cer` is the mean of per-utterance rates over the `count` scored items; `failures` (no speech
generated, synthesis or ASR errors) are listed in the TSV and excluded from the mean.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

from grpo.evaluate.cer import mean_error_rate

TSV_HEADER = ["id", "reference", "transcript", "error_rate", "tokens"]   # tokens: speech tokens generated


def write_checkpoint(out_dir: Path, name: str, scored, unit: str) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{name}.tsv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(TSV_HEADER)
        for s in scored:
            w.writerow([s.id, s.reference, s.transcript, "" if s.error_rate is None else f"{s.error_rate:.6f}",
                        s.tokens])
    rates = [s.error_rate for s in scored if s.error_rate is not None]
    summary = {"cer": mean_error_rate(rates), "count": len(rates), "failures": len(scored) - len(rates),
               "unit": unit, "tsv": f"{name}.tsv"}
    sims = [s.sim for s in scored if s.sim is not None]
    if sims:
        summary.update(sim=sum(sims) / len(sims), sim_count=len(sims))
    return summary


def read_tsv(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def _delta(cer: float, base: float | None) -> str:
    if base is None or math.isnan(base) or math.isnan(cer):
        return "–"
    rel = f" ({(cer - base) / base:+.1%})" if base > 0 else ""
    return f"{cer - base:+.4f}{rel}"


def write_summary(out_dir: Path, summary: dict) -> None:
    (out_dir / "report.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    base = summary.get("base", {}).get("cer")
    unit = next(iter(summary.values()))["unit"] if summary else ""
    lines = ["# Zero-shot evaluation", "", f"Error unit: {unit}; figure: mean of per-utterance rates "
             "(Seed-TTS-eval protocol).", "", "| checkpoint | CER | Δ vs base | scored | failures | SIM |",
             "|---|---|---|---|---|---|"]
    for name, r in summary.items():
        sim = f"{r['sim']:.3f}" if "sim" in r else "–"
        lines.append(f"| {name} | {r['cer']:.4f} | {_delta(r['cer'], base) if name != 'base' else '–'} | "
                     f"{r['count']} | {r['failures']} | {sim} |")
    (out_dir / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    plot(out_dir / "report.png", summary)


def plot(path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(names)), 3.5))
    ax.bar(names, [summary[n]["cer"] for n in names], color=["#888" if n == "base" else "#3a7" for n in names])
    ax.set_ylabel("CER (mean per utterance)")
    ax.set_title("zero-shot CER per checkpoint")
    for i, n in enumerate(names):
        ax.annotate(f"{summary[n]['cer']:.3f}", (i, summary[n]["cer"]), ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_summary(out_dir: Path) -> int:
    path = out_dir / "report.json"
    if not path.exists():
        print(f"no report at {path}")
        return 1
    summary = json.loads(path.read_text())
    names = [n for n in summary if n != "base"]
    print(f"report: {out_dir / 'report.md'} (json: {path}, plot: {out_dir / 'report.png'})")
    if "base" in summary:
        print(f"base CER  {summary['base']['cer']:.4f}")
    if names:
        final = names[-1]
        delta = _delta(summary[final]["cer"], summary.get("base", {}).get("cer"))
        print(f"final CER {summary[final]['cer']:.4f} ({final}; {delta} vs base)")
    return 0


def check(out_dir: Path, max_ratio: float) -> int:
    """Exit status for CI: the last trained checkpoint was scored and its CER is below max_ratio x base."""
    summary = json.loads((out_dir / "report.json").read_text())
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
    parser.add_argument("action", choices=["summary", "check"])
    parser.add_argument("--max-ratio", type=float, default=1.0, help="check: final CER must be below this x base")
    args, overrides = parser.parse_known_args(argv)
    out_dir = Path(load_config(overrides).eval.out_dir)
    return print_summary(out_dir) if args.action == "summary" else check(out_dir, args.max_ratio)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
