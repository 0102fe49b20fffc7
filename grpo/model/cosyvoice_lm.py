"""The CosyVoice LM as a Hugging Face causal LM: the Qwen2 body and CosyVoice's speech head, exactly.

CosyVoice2's `Qwen2LM` predicts the next speech token with `llm_decoder(h) = W h + b` over its decoder rows
(the speech tokens and the end-of-speech ids). `CosyVoiceLMForCausalLM` is `Qwen2ForCausalLM` with an
`lm_head` that has a bias: the decoder rows hold `W` and `b`; every other row of the vocabulary (text
tokens, sos/task_id, padding) has a zero weight and the finite bias MASKED_LOGIT, so its softmax probability
is exactly 0 (fp32 and bf16 alike) and its gradient is exactly 0. A softmax over the whole vocabulary --
what transformers, vLLM and verl's actor compute -- is then CosyVoice's decoder distribution itself: no
approximation, no `allowed_token_ids`, and conversion back to `llm.pt` is exact for any bias.

Registered with transformers' Auto classes on import (model_type `cosyvoice_lm`): `import grpo.model` is
enough for AutoConfig / AutoModelForCausalLM (verl: `actor_rollout_ref.model.external_lib=grpo.model`).
vLLM loads it through this package's `vllm.general_plugins` entry point (grpo/model/vllm_plugin.py).
For a bias-free decoder (CosyVoice3) the bias is frozen (`train_head_bias`), so training keeps it exportable.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

MODEL_TYPE = "cosyvoice_lm"
ARCHITECTURE = "CosyVoiceLMForCausalLM"
# Finite (verl's entropy computes p * logit; -inf would give NaN), exact in bf16 and fp16 (-2^13), and far
# below any real logit: exp(MASKED_LOGIT - max) underflows to exactly 0 in fp32.
MASKED_LOGIT = -8192.0


class CosyVoiceLMConfig(Qwen2Config):
    """Qwen2's config plus where the speech head lives and whether its bias trains."""

    model_type = MODEL_TYPE

    def __init__(self, head_rows: list[int] | None = None, train_head_bias: bool = True, **kwargs):
        self.head_rows = head_rows             # [first, end) of the decoder rows in the vocabulary
        self.train_head_bias = train_head_bias
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)


class SpeechHead(nn.Linear):
    """`lm_head` with a bias; a frozen bias (bias-free decoders) is detached in forward, so it gets no gradient
    however the parameter is replaced on loading or wrapped by FSDP.

    Its logits are float32 whatever the compute dtype: under FSDP2 bf16 mixed precision or an autocast the body
    runs in bf16, but the head's matmul runs in float32 (autocast off, inputs upcast), so the log-probs verl's actor
    takes (`log_softmax` in the logits' dtype without flash-attn) carry no bf16 rounding -- at a log-prob of -4
    that rounding alone is ~1-3 % of a PPO ratio. The matmul covers the decoder rows only (`rows`, [first, end));
    every other row's weight is zero (conversion writes it so, and its gradient is exactly 0), so its logit is its
    bias, as the full product gives, at 1/24 of the real-size head's work."""

    def __init__(self, hidden_size: int, vocab_size: int, train_bias: bool, rows: list[int] | None = None):
        super().__init__(hidden_size, vocab_size, bias=True)
        self.train_bias = train_bias
        self.rows = tuple(rows) if rows else (0, vocab_size)

    def forward(self, hidden):
        bias = (self.bias if self.train_bias else self.bias.detach()).float()
        first, end = self.rows
        with torch.autocast(hidden.device.type, enabled=False):
            speech = F.linear(hidden.float(), self.weight[first:end].float(), bias[first:end])
        if (first, end) == (0, self.out_features):
            return speech
        lead = speech.shape[:-1]
        return torch.cat([bias[:first].expand(*lead, -1), speech, bias[end:].expand(*lead, -1)], dim=-1)


class CosyVoiceLMForCausalLM(Qwen2ForCausalLM):
    config_class = CosyVoiceLMConfig

    def __init__(self, config: CosyVoiceLMConfig):
        super().__init__(config)
        self.lm_head = SpeechHead(config.hidden_size, config.vocab_size, config.train_head_bias,
                                  config.head_rows)
        self.post_init()


def register() -> None:
    """transformers' Auto classes; idempotent (each process that imports grpo.model calls it)."""
    AutoConfig.register(MODEL_TYPE, CosyVoiceLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(CosyVoiceLMConfig, CosyVoiceLMForCausalLM, exist_ok=True)


register()
