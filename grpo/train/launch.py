"""Stage 2: GRPO with the engine named by `train.engine` (verl on GPU clusters, local on one machine)."""

from __future__ import annotations

import logging

from omegaconf import DictConfig


def run(cfg: DictConfig) -> int:
    from grpo.train.reward_fn import client_config

    try:
        client_config(cfg)              # a misspelled reward.client key: one line before any engine starts
    except ValueError as exc:
        logging.getLogger(__name__).error("train stage stopped: %s", exc)
        return 1
    if cfg.train.engine == "local":
        from grpo.train.local_engine import LocalGRPOTrainer

        trainer = LocalGRPOTrainer(cfg)
        try:
            trainer.fit()
        finally:
            trainer.close()
        return 0
    if cfg.train.engine == "verl":
        from grpo.train import verl_launcher

        return verl_launcher.run(cfg)
    raise ValueError(f"train.engine must be local or verl, got {cfg.train.engine!r}")
