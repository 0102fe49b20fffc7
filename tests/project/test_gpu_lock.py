"""scripts/gpu_lock.py's image-side helpers (no Docker engine here): the constraints each CUDA flavour of the image
installs with, and the check that the CUDA 12 flavour builds the releases CI tests. The lock's resolution itself runs
in .ci/run (`gpu_lock.py check`, uv against PyPI)."""

import importlib.util
import re

import pytest

from grpo.config import REPO_ROOT


@pytest.fixture(scope="module")
def gpu_lock():
    spec = importlib.util.spec_from_file_location("gpu_lock", REPO_ROOT / "scripts" / "gpu_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)", text, re.M))


def test_the_cuda13_image_is_constrained_by_the_whole_lock(gpu_lock):
    lock = (REPO_ROOT / "requirements" / "gpu-lock.txt").read_text()
    assert pins(gpu_lock.constraints("13")) == pins(lock)


def test_the_cuda12_image_leaves_only_cuda13_builds_to_pip(gpu_lock):
    lock = pins((REPO_ROOT / "requirements" / "gpu-lock.txt").read_text())
    kept = pins(gpu_lock.constraints("12"))
    dropped = set(lock) - set(kept)
    # the CUDA 13 builds: torch and vLLM themselves, and the CUDA libraries they pull (named in the lock)
    assert {"torch", "torchaudio", "vllm", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-nccl-cu13"} <= dropped
    # everything else keeps the lock's version: the Python stack the CUDA 13 image and CI run
    for name in ("transformers", "ray", "verl", "protobuf", "funasr", "datasets", "numpy"):
        assert kept[name] == lock[name], name
    assert all(re.match(r"nvidia-|cuda-|torch|vllm|triton|onnxruntime-gpu|nccl4py|flashinfer|pynvvideocodec|tilelang|"
                        r"quack|humming|tokenspeed", name) for name in dropped), sorted(dropped)


def test_an_unknown_cuda_stops_in_one_line(gpu_lock):
    with pytest.raises(SystemExit, match="CUDA=11: the image is built for CUDA 13 or 12"):
        gpu_lock.constraints("11")


def test_the_cuda12_requirements_pin_the_releases_ci_tests(gpu_lock, tmp_path, monkeypatch):
    assert gpu_lock.check_cuda12() == []
    req = tmp_path / "requirements"
    req.mkdir()
    (req / "gpu.txt").write_text((REPO_ROOT / "requirements" / "gpu.txt").read_text())
    cu12 = (REPO_ROOT / "requirements" / "gpu-cu12.txt").read_text()
    monkeypatch.setattr(gpu_lock, "REQ", req)
    (req / "gpu-cu12.txt").write_text(cu12.replace("download/v0.28.0/vllm-0.28.0", "download/v0.27.0/vllm-0.27.0"))
    assert [p.split(":")[1].split(",")[0].strip() for p in gpu_lock.check_cuda12()] == ["vllm 0.27.0"]
    (req / "gpu-cu12.txt").write_text(cu12.replace("torch==2.13.0+cu129", "torch==2.12.0+cu129"))
    assert [p.split(":")[1].split(",")[0].strip() for p in gpu_lock.check_cuda12()] == ["torch 2.12.0+cu129"]
