"""One verl run over several launcher starts (attempts): what a killed run and its resume leave behind.

verl resumes from its last checkpoint (`trainer.resume_mode=auto`: `latest_checkpointed_iteration.txt`, the
FSDP shards and the dataloader's position), but its file logger opens `VERL_FILE_LOGGER_PATH` with "wb" on
every start (verl/utils/tracking.py, FileLogger.__init__, verl 0.9.1), and a killed attempt has already logged
(and scored) part of a step that the next attempt trains again. So each start is an attempt, numbered in
`attempts.jsonl` with the step it resumes from; verl logs each attempt to its own file; compute_score stamps
every component and failure line with the attempt. Reading them back (`merged_verl_rows`, `latest_components`),
an attempt's steps count up to the step the next one resumed from, and a step's samples are those of the last
attempt that scored it: no step is lost or counted twice. A fresh start (nothing to resume) clears the run's
logs, except the failure log, which only grows; the launcher watches it from the attempt's own start.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from grpo.layout import TrainDir

CHECKPOINT_TRACKER = "latest_checkpointed_iteration.txt"   # written by verl's _save_checkpoint


@dataclass
class Attempt:
    number: int          # 0 for a fresh start
    resume_step: int     # the checkpointed step verl continues after (0: from the start)
    verl_log: Path       # this attempt's VERL_FILE_LOGGER_PATH
    failures_from: int   # the failure log's size when this attempt started (earlier failures are history)


def verl_log(out_dir: Path, number: int) -> Path:
    return TrainDir(out_dir).verl_metrics(number)


def checkpointed_step(checkpoint_dir: Path) -> int:
    """The step of verl's last complete checkpoint under `checkpoint_dir` (0: none)."""
    tracker = Path(checkpoint_dir) / CHECKPOINT_TRACKER
    return int(tracker.read_text().strip() or 0) if tracker.exists() else 0


def history(out_dir: Path) -> list[dict]:
    path = TrainDir(out_dir).attempts
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def start_attempt(out_dir: Path, checkpoint_dir: Path, resume: bool, logs: list[Path], failure_log: Path) -> Attempt:
    """Number this start; on a fresh one remove the previous attempts' logs (`logs` and verl's per-attempt files)."""
    out_dir = Path(out_dir)
    step = checkpointed_step(checkpoint_dir) if resume else 0
    past = history(out_dir) if step else []
    if not past:
        files = TrainDir(out_dir)
        for path in [*logs, *out_dir.glob(files.verl_metrics("*").name), files.attempts]:
            path.unlink(missing_ok=True)
    attempt = Attempt(len(past), step, verl_log(out_dir, len(past)),
                      failure_log.stat().st_size if failure_log.exists() else 0)
    with TrainDir(out_dir).attempts.open("a") as f:
        f.write(json.dumps({"attempt": attempt.number, "resume_step": step, "started": time.time()}) + "\n")
    return attempt


def merged_verl_rows(out_dir: Path) -> list[dict]:
    """verl's file-log rows ({"step", "data"}) of every attempt: each attempt's up to the step the next one
    resumed from, the last attempt's all; rows of one step (a resumed run's validation at its resume step)
    are merged."""
    attempts = history(out_dir)
    rows: list[dict] = []
    for i, a in enumerate(attempts):
        path = verl_log(out_dir, a["attempt"])
        if not path.exists():
            continue
        until = attempts[i + 1]["resume_step"] if i + 1 < len(attempts) else float("inf")
        rows += [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip())
                 if int(r["step"]) <= until]
    return rows


def latest_components(records: list[dict]) -> list[dict]:
    """Training component lines of the last attempt that scored each step tag (a killed attempt's partial step,
    scored again after the resume, counts once); validation lines are kept as they are."""
    last: dict[int, int] = {}
    for r in records:
        if not r.get("validate"):
            last[r["step"]] = max(last.get(r["step"], 0), r.get("attempt", 0))
    return [r for r in records if r.get("validate") or r.get("attempt", 0) == last[r["step"]]]
