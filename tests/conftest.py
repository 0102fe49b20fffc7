"""Shared fixtures: one tiny model build per test session (stage -1 of the tiny profile, short warm start)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from grpo.config import REPO_ROOT, load_config  # noqa: E402

FAST_TINY = ["model.tiny.warm_start.steps=40"]


@pytest.fixture(scope="session")
def tiny_exp(tmp_path_factory) -> Path:
    """exp_dir with stage -1 of the tiny profile done (models, codebook, speakers, HF conversion)."""
    from grpo import models

    exp = tmp_path_factory.mktemp("exp_tiny")
    models.run(load_config([f"exp_dir={exp}", *FAST_TINY]))
    return exp


@pytest.fixture(scope="session")
def tiny_cfg(tiny_exp):
    """Factory: the tiny profile's config rooted at the session's exp_dir, plus overrides."""
    def make(*overrides: str):
        return load_config([f"exp_dir={tiny_exp}", *FAST_TINY, *overrides])
    return make


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT
