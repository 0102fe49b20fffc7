"""vLLM support for CosyVoiceLMForCausalLM, loaded in every vLLM process through this package's
`vllm.general_plugins` entry point (pyproject.toml): the local engine's in-process engine and verl's
vLLM servers alike.

`register()` makes transformers know the `cosyvoice_lm` config (vLLM parses config.json with AutoConfig)
and tells vLLM's ModelRegistry where the model class is; the class itself (`CosyVoiceLMForCausalLM` below,
imported lazily by vLLM) is vLLM's Qwen2ForCausalLM with a biased ParallelLMHead whose bias goes into the
logits, as CosyVoice does for its own vLLM inference (cosyvoice/vllm/cosyvoice2.py, an older vLLM API).
Weight loading, and so the trainer -> vLLM weight sync, carries `lm_head.bias` with the other weights.
"""

from __future__ import annotations

import os

from vllm import ModelRegistry
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.utils import maybe_prefix

from grpo.model.cosyvoice_lm import ARCHITECTURE  # importing it registers the HF config class


class CosyVoiceLMForCausalLM(Qwen2ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size, bias=True,
                                          quant_config=self.quant_config, prefix=maybe_prefix(prefix, "lm_head"))

    def compute_logits(self, hidden_states):
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)


def register() -> None:
    """The `vllm.general_plugins` entry point; vLLM may call it more than once per process."""
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, CosyVoiceLMForCausalLM)
    if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":   # verl's CPU run (grpo/train/verl_cpu.py)
        from grpo.upstream import vllm_cpu

        vllm_cpu.install()
