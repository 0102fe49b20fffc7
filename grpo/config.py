"""One config tree for every stage: Hydra's compose API over conf/ (no working-dir changes)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"


def load_config(overrides: Iterable[str] = ()) -> DictConfig:
    """Compose conf/config.yaml with Hydra command-line style overrides (`key=value`)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    OmegaConf.set_readonly(cfg, False)
    # every output path derives from exp_dir: make it absolute so Ray workers and subprocesses agree
    cfg.exp_dir = str(resolve_path(cfg.exp_dir))
    return cfg


def resolve_path(path: str | os.PathLike) -> Path:
    """Paths in the config are relative to the repository root (where run.sh runs)."""
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    for noisy in ("httpx", "urllib3", "filelock", "numba", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
