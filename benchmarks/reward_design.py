"""Reward designs compared on the tiny profile's held-out set (docs/tiny-profile.md, "Reward designs").

Each design runs the whole pipeline (`bash run.sh -1 4`: the warm-started base comes from the
model.tiny.cache_dir cache, so every run starts from the same policy) once per GRPO seed, into
exp/reward_design/<design>/seed<k>, and is scored from its evaluation reports: held-out CER (the reward's
judge), SIM (the synthetic reward's stand-in), the hacking gap against the held-out judge (synthetic_alt),
and CER on training sentences (eval/seen). Prints a Markdown table (mean ± standard deviation over seeds,
with each seed's figure) and writes exp/reward_design/table.json.

    .venv/bin/python benchmarks/reward_design.py                     # 3 designs x seeds 1 2 3 (~30 min)
    .venv/bin/python benchmarks/reward_design.py --designs cer --seeds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from grpo.config import REPO_ROOT
from grpo.layout import EvalDir

MIXED = ["reward.weights.sim=0.2", "reward.weights.duration=0.2"]
DESIGNS = {
    "cer": ("CER alone", []),
    "mixed": ("CER + SIM + duration, weighted mean", MIXED),
    "mixed_gdpo": ("CER + SIM + duration, per-component group normalisation", [*MIXED,
                                                                                "reward.combine=group_normalized"]),
}
OUT = REPO_ROOT / "exp" / "reward_design"


def run_one(design: str, seed: int) -> Path:
    exp = OUT / design / f"seed{seed}"
    cmd = ["bash", "run.sh", "-1", "4", f"exp_dir={exp}", f"seed={seed}", "eval.checkpoints=[base,last]",
           *DESIGNS[design][1]]
    t0 = time.time()
    with open(OUT / f"{design}_seed{seed}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"{design} seed {seed}: run.sh failed (rc {rc}), see {log.name}")
    print(f"{design} seed {seed}: {time.time() - t0:.0f} s", flush=True)
    return exp


def figures(exp: Path) -> dict:
    held_out = json.loads(EvalDir(exp / "eval").report_json.read_text())
    seen = json.loads(EvalDir(exp / "eval" / "seen").report_json.read_text())
    last = next(k for k in reversed(held_out) if k != "base")
    r = held_out[last]
    return {"checkpoint": last, "base_cer": held_out["base"]["cer"], "cer": r["cer"],
            "relative_gain": (held_out["base"]["cer"] - r["cer"]) / held_out["base"]["cer"],
            "alt_cer": r["judges"]["synthetic_alt"]["cer"], "hacking_gap": r["hacking_gap"]["synthetic_alt"]["gap"],
            "base_sim": held_out["base"].get("sim"), "sim": r.get("sim"),
            "seen_base_cer": seen["base"]["cer"], "seen_cer": seen[last]["cer"]}


def mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f} ({', '.join(f'{v:.3f}' for v in values)})"


def table(results: dict) -> str:
    cols = [("held-out CER", "cer"), ("gain vs base", "relative_gain"), ("SIM", "sim"),
            ("hacking gap", "hacking_gap"), ("seen CER", "seen_cer")]
    lines = ["| design | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for design, runs in results.items():
        cells = [mean_sd([r[k] for r in runs.values()]) for _, k in cols]
        lines.append(f"| {DESIGNS[design][0]} | " + " | ".join(cells) + " |")
    base = next(iter(next(iter(results.values())).values()))
    lines.append(f"\nBase policy (every run): held-out CER {base['base_cer']:.3f}, SIM {base['base_sim']:.3f}, "
                 f"seen CER {base['seen_base_cer']:.3f}.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=list(DESIGNS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--report-only", action="store_true", help="tabulate the runs already in exp/reward_design")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for design in args.designs:
        results[design] = {}
        for seed in args.seeds:
            exp = OUT / design / f"seed{seed}" if args.report_only else run_one(design, seed)
            results[design][seed] = figures(exp)
    (OUT / "table.json").write_text(json.dumps(results, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
