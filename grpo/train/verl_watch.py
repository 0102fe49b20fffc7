"""Watching main_ppo: its exit, a reward failure (verl would swallow it), its outer timeout; and killing it
with its own Ray cluster."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

log = logging.getLogger("grpo.train.verl_launcher")


def kill_tree(proc: subprocess.Popen, ray_temp_dir: str | None) -> None:
    """main_ppo's process group, then any process of its own Ray cluster (found by its temp dir; None: it joined
    an existing cluster, whose raylets stay and end the job's workers themselves)."""
    import psutil

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if ray_temp_dir is None:
        return
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(ray_temp_dir in part for part in p.info["cmdline"] or []):
                p.kill()


def new_failure(failures: Path, offset: int) -> str | None:
    """The first failure line written after byte `offset` (earlier ones are an earlier attempt's)."""
    if not failures.exists() or failures.stat().st_size <= offset:
        return None
    with failures.open("rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    return lines[0] if lines else None


def watch(proc: subprocess.Popen, failures: Path, timeout_s: float, failures_from: int = 0) -> int:
    """main_ppo's exit code; 124 past `timeout_s`; 1 as soon as a reward failed (reward.on_failure=raise:
    verl's agent loop would catch the error and drop the sample's group without a word) or a rollout's log-probs
    were not finite (grpo/train/verl_agent_loop.py)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        first = new_failure(failures, failures_from)
        if first:
            log.error("a sample failed (a reward after the client's retries, or non-finite rollout log-probs: %s): "
                      "stopping main_ppo (reward.on_failure=raise; verl would drop a failed reward's group silently). "
                      "All failures: %s", first, failures)
            return 1
        if time.monotonic() > deadline:
            log.error("main_ppo did not finish within train.verl.timeout_s=%s s (a stuck worker?): killing it and "
                      "its Ray cluster", timeout_s)
            return 124
