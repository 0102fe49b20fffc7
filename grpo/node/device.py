"""The device a run uses, checked before any stage works (`device` in conf/config.yaml).

`device=cuda` (the GPU profiles): CUDA must be usable, or the stage stops in one line naming the key and the fix;
there is no silent CPU fallback (stage 2 would otherwise pick verl's CPU platform and stage 4 would run on the CPU
while the reward server was told `cuda`). A driver older than the one this torch's CUDA needs is reported only when
CUDA does not work: on data-centre GPUs CUDA's forward-compatibility libraries (which NVIDIA's CUDA images carry
under /usr/local/cuda/compat) run a newer CUDA on an older driver, and a working CUDA is never stopped.
`device=cpu`: never CUDA (the realsize profiles: verl's CPU platform). `device=auto` (tiny): CUDA when usable.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from omegaconf import DictConfig

# the oldest Linux driver for each CUDA major version (NVIDIA's CUDA toolkit release notes, "CUDA Toolkit and
# Corresponding Driver Versions", minor-version compatibility): the GPU image is CUDA 13.0 (Dockerfile)
MIN_DRIVER = {13: (580, 0), 12: (525, 60)}
CHOICES = ("cuda", "cpu", "auto")


def cores_share(sharers: int) -> int:
    """This machine's cores split evenly among processes that share it (verl's CPU nodes, pytest-xdist workers):
    the torch threads each should use, at least one."""
    return max(1, (os.cpu_count() or 1) // sharers)


class DeviceError(SystemExit):
    """A device the config asks for and this machine cannot give; its message is the one line a user sees."""


def torch_cuda() -> str | None:
    """The CUDA version this torch was built for (None: a CPU build)."""
    import torch

    return torch.version.cuda


def cuda_usable() -> tuple[bool, str]:
    """(usable, why not)."""
    import torch

    if torch_cuda() is None:
        return False, "this torch is a CPU build"
    if not torch.cuda.is_available():
        return False, "torch sees no usable CUDA device (no --gpus for the container, CUDA_VISIBLE_DEVICES empty, " \
                      "or a driver too old for this torch)"
    return True, ""


def query_gpus(field: str) -> list[str]:
    """One `nvidia-smi --query-gpu` field, a value per GPU ([] without nvidia-smi or when it fails); it does not
    initialise CUDA in this process."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def driver_version() -> tuple[int, ...] | None:
    """The NVIDIA driver's version (nvidia-smi), None when it cannot be read."""
    versions = query_gpus("driver_version")
    try:
        return tuple(int(x) for x in versions[0].split(".")) if versions else None
    except ValueError:
        return None


def too_old_driver() -> str | None:
    """'the NVIDIA driver X is older than CUDA Y (...) needs (Z or newer)' when nvidia-smi reports such a driver."""
    driver, cuda = driver_version(), torch_cuda()
    need = MIN_DRIVER.get(int(cuda.split(".")[0])) if cuda and driver else None
    if need is None or driver >= need:
        return None
    have, want = ".".join(map(str, driver)), ".".join(map(str, need))
    return f"the NVIDIA driver {have} is older than CUDA {cuda} (this torch, the image's CUDA) needs ({want} or newer)"


def resolve(cfg: DictConfig) -> str:
    """`cuda` or `cpu` for this run, or DeviceError (one line) when `device` cannot be honoured."""
    wanted = cfg.get("device", "auto")
    if wanted not in CHOICES:
        raise DeviceError(f"device={wanted}: expected one of {', '.join(CHOICES)}")
    if wanted == "cpu":
        return "cpu"
    usable, why = cuda_usable()
    if usable:                              # an older driver through forward compatibility included
        return "cuda"
    old = too_old_driver()
    if old:
        raise DeviceError(f"device={wanted} (profile {cfg.profile.name}): CUDA is not usable and {old}: update the "
                          "driver, or on a data-centre GPU run with CUDA's forward-compatibility libraries "
                          "(/usr/local/cuda/compat in the image; docs/gpu.md)")
    if wanted == "cuda":
        raise DeviceError(f"device=cuda (profile {cfg.profile.name}): {why}. Run on a GPU node (docker run --gpus "
                          f"all ...), or set device=cpu to run on the CPU on purpose")
    return "cpu"
