"""Where a verl training step's time goes, per run: the median over steps of each of verl's `timing_s/*` figures
(gen = rollouts with the reward scored inside the agent loop, old_log_prob, update_actor, update_weights = weight
sync to the rollout servers, save_checkpoint, step = all of it), read from the runs' train/metrics.jsonl.

    .venv/bin/python benchmarks/step_split.py exp/realsize exp/realsize3

Reads what stage 2 measured; runs nothing. Prints a Markdown table; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ORDER = ["gen", "old_log_prob", "adv", "update_actor", "update_weights", "save_checkpoint", "step"]


def step_split(exp_dir: Path) -> dict[str, float]:
    """Median seconds of each timing_s/* figure over the run's steps (a figure missing from a step is skipped)."""
    from grpo.layout import TrainDir

    path = TrainDir(exp_dir / "train").metrics
    if not path.exists():
        raise SystemExit(f"{path}: no training metrics (run stage 2 of that profile first)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    names = sorted({k.removeprefix("timing_s/") for row in rows for k in row if k.startswith("timing_s/")},
                   key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
    return {n: round(statistics.median(r[f"timing_s/{n}"] for r in rows if f"timing_s/{n}" in r), 1) for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exp_dirs", nargs="+", type=Path)
    args = parser.parse_args()
    splits = {str(d): step_split(d) for d in args.exp_dirs}
    names = list(dict.fromkeys(n for split in splits.values() for n in split))
    print("| run | " + " | ".join(f"{n} (s)" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for run, split in splits.items():
        print(f"| {run} | " + " | ".join(str(split.get(n, "–")) for n in names) + " |")
    print(json.dumps(splits))


if __name__ == "__main__":
    main()
