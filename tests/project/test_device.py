"""`device`: a GPU profile stops in one line, before any work, when CUDA is unusable (naming an old driver
when that is why; a working CUDA on an older driver runs); never a
silent CPU fallback (grpo/node/device.py). This machine has no GPU and a CPU build of torch: the first test is the real
case, not a simulation; the driver check is fed the versions a node would report."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpo.config import REPO_ROOT, load_config
from grpo.node import device


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
    """A CUDA 13.0 torch on a node; the test sets the driver's version and whether torch found CUDA usable."""
    monkeypatch.setattr(device, "torch_cuda", lambda: "13.0")

    def set_node(version, usable=True):
        monkeypatch.setattr(device, "driver_version", lambda: version)
        monkeypatch.setattr(device, "cuda_usable", lambda: (usable, "" if usable else "torch sees no usable CUDA"))
    set_node((580, 65, 6))
    return set_node


def test_an_older_driver_with_working_cuda_runs(node):
    """Forward compatibility: a CUDA 13 torch on an R535 data-centre driver works through the compat libraries."""
    node((535, 104, 5), usable=True)
    assert device.resolve(load_config(["profile=cosyvoice2"])) == "cuda"
    node((580, 65, 6))
    assert device.resolve(load_config(["profile=cosyvoice2"])) == "cuda"
    node(None)                                               # no nvidia-smi: torch's own check is what remains
    assert device.resolve(load_config(["profile=cosyvoice2"])) == "cuda"


def test_an_older_driver_without_working_cuda_stops_naming_both_routes(node):
    node((535, 104, 5), usable=False)                        # a CUDA 12.2 driver (R535), no compat libraries
    with pytest.raises(device.DeviceError) as err:
        device.resolve(load_config(["profile=cosyvoice2"]))
    assert str(err.value) == ("device=cuda (profile cosyvoice2): CUDA is not usable and the NVIDIA driver 535.104.5 "
                              "is older than CUDA 13.0 (this torch, the image's CUDA) needs (580.0 or newer): update "
                              "the driver, or on a data-centre GPU run with CUDA's forward-compatibility libraries "
                              "(/usr/local/cuda/compat in the image; docs/gpu.md)")
    node((580, 65, 6), usable=False)                         # a new driver and still no CUDA: the generic stop
    with pytest.raises(device.DeviceError, match="torch sees no usable CUDA. Run on a GPU node"):
        device.resolve(load_config(["profile=cosyvoice2"]))


def test_cpu_is_chosen_only_when_asked_or_auto(monkeypatch, node):
    assert device.resolve(load_config(["profile=realsize"])) == "cpu"         # device=cpu: never CUDA
    assert device.resolve(load_config([])) == "cuda"                          # tiny: auto, CUDA usable
    node((580, 65, 6), usable=False)
    assert device.resolve(load_config([])) == "cpu"                           # auto without CUDA
    with pytest.raises(device.DeviceError, match="device=gpu: expected one of cuda, cpu, auto"):
        device.resolve(load_config(["device=gpu"]))
