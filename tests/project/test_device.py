"""`device`: a GPU profile stops in one line, before any work, when CUDA is unusable or the driver too old; never a
silent CPU fallback (grpo/device.py). This machine has no GPU and a CPU build of torch: the first test is the real
case, not a simulation; the driver check is fed the versions a node would report."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpo import device
from grpo.config import REPO_ROOT, load_config


@pytest.mark.parametrize("stage", ["models", "serve", "train", "evaluate"])
def test_a_gpu_profile_without_cuda_stops_in_one_line_before_any_work(tmp_path, stage):
    proc = subprocess.run([sys.executable, "-m", "grpo", stage, "profile=cosyvoice2", f"exp_dir={tmp_path / 'exp'}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines == ["[grpo] device=cuda (profile cosyvoice2): this torch is a CPU build. Run on a GPU node (docker "
                     "run --gpus all ...), or set device=cpu to run on the CPU on purpose"]
    assert not (tmp_path / "exp").exists()                   # nothing fetched, downloaded or written


@pytest.fixture()
def node(monkeypatch):
    """A CUDA 13.0 torch on a node with a working GPU; the test sets the driver's version."""
    monkeypatch.setattr(device, "torch_cuda", lambda: "13.0")
    monkeypatch.setattr(device, "cuda_usable", lambda: (True, ""))
    return lambda version: monkeypatch.setattr(device, "driver_version", lambda: version)


def test_a_driver_older_than_the_images_cuda_needs_stops_naming_both(node):
    node((535, 104, 5))                                      # a CUDA 12.2 driver (R535)
    with pytest.raises(device.DeviceError) as err:
        device.resolve(load_config(["profile=cosyvoice2"]))
    assert str(err.value) == ("device=cuda (profile cosyvoice2): the NVIDIA driver 535.104.5 is older than CUDA 13.0 "
                              "(this torch, the image's CUDA) needs (580.0 or newer): update the driver")
    node((580, 65, 6))
    assert device.resolve(load_config(["profile=cosyvoice2"])) == "cuda"
    node(None)                                               # no nvidia-smi: torch's own check is what remains
    assert device.resolve(load_config(["profile=cosyvoice2"])) == "cuda"


def test_cpu_is_chosen_only_when_asked_or_auto(monkeypatch, node):
    node((580, 65, 6))
    assert device.resolve(load_config(["profile=realsize"])) == "cpu"         # device=cpu: never CUDA
    assert device.resolve(load_config([])) == "cuda"                          # tiny: auto, CUDA usable
    monkeypatch.setattr(device, "cuda_usable", lambda: (False, "no device"))
    assert device.resolve(load_config([])) == "cpu"                           # auto without CUDA
    with pytest.raises(device.DeviceError, match="device=gpu: expected one of cuda, cpu, auto"):
        device.resolve(load_config(["device=gpu"]))
