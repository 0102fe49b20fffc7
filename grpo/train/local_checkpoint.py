"""Local-engine checkpoints: `checkpoints/step_N/` = an HF model directory (loadable by transformers,
vLLM and `grpo.model.convert`) + `trainer_state.pt` (optimizer, scheduler, RNG states, data position).

A checkpoint is written to `step_N.tmp/` and renamed when complete, so a killed run never leaves a
half-written `step_N/`; resuming picks the highest complete step.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

from grpo.layout import step_of
from grpo.model.convert import EXTRA_FILE
from grpo.model.speech_vocab import SPEECH_TOKENS_FILE

STATE_FILE = "trainer_state.pt"
# files of the converted base model that every checkpoint carries along
CARRIED_FILES = (SPEECH_TOKENS_FILE, EXTRA_FILE)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save(ckpt_root: Path, step: int, model, tokenizer, base_model_dir: Path, state: dict) -> Path:
    final = ckpt_root / f"step_{step}"
    tmp = ckpt_root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name in CARRIED_FILES:
        if (base_model_dir / name).exists():
            shutil.copy2(base_model_dir / name, tmp / name)
    torch.save({**state, "rng": rng_state(), "step": step}, tmp / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def list_steps(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, ascending by step."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        step = step_of(p.name)
        if step is not None and (p / STATE_FILE).exists():
            found.append((step, p))
    return sorted(found)


def latest(ckpt_root: Path) -> Path | None:
    steps = list_steps(ckpt_root)
    return steps[-1][1] if steps else None


def load_state(ckpt_dir: Path) -> dict:
    return torch.load(ckpt_dir / STATE_FILE, map_location="cpu", weights_only=False)
