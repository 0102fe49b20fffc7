"""Which model directories later stages work on: `base` (the converted model) and training checkpoints
(local engine: train/checkpoints/step_N; verl: train/merged/step_N after stage 3)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from grpo.layout import TrainDir, step_of


def trained_checkpoints(cfg: DictConfig) -> dict[str, Path]:
    """HF checkpoints by name, ascending by step; merged verl checkpoints win over local ones of a step."""
    found: dict[int, Path] = {}
    files = TrainDir(cfg.train.out_dir)
    for root in (files.local_checkpoints, files.merged):
        if root.is_dir():
            for p in root.iterdir():
                step = step_of(p.name)
                if step is not None and (p / "config.json").exists():
                    found[step] = p
    return {f"step_{s}": found[s] for s in sorted(found)}


def select_checkpoints(cfg: DictConfig, spec) -> dict[str, Path]:
    """`spec`: names among base, last, all, step_N (a list, or one name)."""
    spec = [spec] if isinstance(spec, str) else list(spec)
    trained = trained_checkpoints(cfg)
    out: dict[str, Path] = {}
    for name in spec:
        if name == "base":
            out["base"] = Path(cfg.model.hf_dir)
        elif name == "last":
            if not trained:
                raise FileNotFoundError(f"no trained checkpoint under {cfg.train.out_dir}: run stages 2-3 first")
            last = list(trained)[-1]
            out[last] = trained[last]
        elif name == "all":
            out.update(trained)
        elif name in trained:
            out[name] = trained[name]
        else:
            raise ValueError(f"unknown checkpoint {name!r}; available: base, last, all, {', '.join(trained) or '-'}")
    return out
