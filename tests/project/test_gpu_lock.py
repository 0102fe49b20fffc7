"""The GPU image's pins (no Docker engine here): one CUDA 13 image built from PyPI's wheels with the lock as
constraints, no CUDA build pinned from an index that does not publish it. The lock's resolution itself runs in
.ci/run (`gpu_lock.py check`, uv against PyPI)."""

import re

from grpo.config import REPO_ROOT
from grpo.node.device import MIN_DRIVER

REQ = REPO_ROOT / "requirements"


def test_no_requirements_file_pins_a_local_cuda_build_or_another_index():
    """torch 2.13 publishes CUDA 12.6/13.0 builds and vLLM 0.28 CUDA 12.9/13.0 ones: no CUDA 12 pair exists, so
    every GPU pin is PyPI's (CUDA 13.0) release, which `gpu_lock.py check` resolves."""
    for path in sorted(REQ.glob("*.txt")):
        text = path.read_text()
        assert not re.search(r"==[\w.]+\+cu\d+", text), path.name
        assert not re.search(r"^\s*(--(extra-)?index-url|[\w-]+ @ https?://)", text, re.M), path.name


def test_the_image_is_one_cuda13_build_installed_with_the_lock():
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    bases = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert bases == ["nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04"]
    assert int(bases[0].split(":")[1].split(".")[0]) in MIN_DRIVER          # the device check knows its driver
    assert "pip install -c requirements/gpu-lock.txt -r requirements/gpu.txt -r requirements/common.txt" in dockerfile
    assert "ARG CUDA" not in dockerfile
    assert not (REQ / "gpu-cu12.txt").exists()
