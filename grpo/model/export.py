"""Stage 5: HF checkpoints -> CosyVoice model directories the official CosyVoice code loads.

`export.out_dir/<checkpoint>/` gets the new `llm.pt` (grpo.model.convert.hf_to_cosyvoice) and every other file
of the original CosyVoice model directory (symlinked, or copied with `export.copy=true`). The new
llm.pt is checked by loading it with `strict=True` into upstream's own LM class (Qwen2LM / CosyVoice3LM) built from
the model directory's yaml.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig

from grpo.checkpoint_selection import select_checkpoints
from grpo.model.convert import hf_to_cosyvoice
from grpo.speech.family import FAMILIES

log = logging.getLogger(__name__)


def check_loads(model_dir: Path) -> None:
    from grpo.speech.cosyvoice_dir import load_cosyvoice_yaml

    llm = load_cosyvoice_yaml(model_dir, skip=["flow", "hift"])["llm"]
    llm.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)


def export_one(hf_dir: Path, source_dir: Path, out: Path, copy: bool) -> Path:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for entry in source_dir.iterdir():
        if entry.name in ("llm.pt",) or entry.name.startswith("."):
            continue
        if copy:
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp / entry.name)
        else:
            os.symlink(entry.resolve(), tmp / entry.name)
    hf_to_cosyvoice(hf_dir, tmp / "llm.pt")
    if any((source_dir / f.yaml).exists() for f in FAMILIES.values()):
        check_loads(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def run(cfg: DictConfig) -> int:
    x = cfg.export
    source = Path(cfg.model.cosyvoice_dir)
    for name, hf_dir in select_checkpoints(cfg, x.checkpoints).items():
        out = export_one(hf_dir, source, Path(x.out_dir) / name, x.copy)
        log.info("%s -> %s (llm.pt loads strictly into upstream's LM class)", name, out)
    return 0
