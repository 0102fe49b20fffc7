"""CosyVoice's repetition-aware sampling as a vLLM (V1) logits processor, exact (see grpo.decoding).

Loaded by name (`LLM(logits_processors=[grpo.decoding.RAS_PROCESSOR])`, verl: `engine_kwargs.vllm.
logits_processors`) and switched on per request by `SamplingParams.extra_args["cosyvoice_ras"]`; requests
without it are untouched. vLLM hands each request's live output-token list (vllm/v1/sample/logits_processor/
__init__.py, AdapterLogitsProcessor): the window is the tokens generated so far, as CosyVoice's `out_tokens`.
The row becomes log P_ras; vLLM then samples softmax(row) (temperature 1, no top-k/top-p), i.e. P_ras.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from grpo.decoding import RAS_KEY, RASConfig, ras_probs

_FIELDS = {"top_p", "top_k", "win_size", "tau_r", "min_tokens", "min_len_masked_id"}


class CosyVoiceRAS(AdapterLogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # settings under which this processor would not see (or not decide) every sampled token
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError("CosyVoice RAS needs every token sampled from its distribution: turn speculative "
                             "decoding off")
        if getattr(vllm_config, "use_v2_model_runner", False):
            raise ValueError("CosyVoice RAS is a V1 logits processor: set VLLM_USE_V2_MODEL_RUNNER=0")
        super().__init__(vllm_config, device, is_pin_memory)

    @classmethod
    def validate_params(cls, params: SamplingParams):
        args = (params.extra_args or {}).get(RAS_KEY)
        if args is None:
            return
        if set(args) != _FIELDS:
            raise ValueError(f"extra_args[{RAS_KEY!r}] needs exactly {sorted(_FIELDS)}, got {sorted(args)}")
        # vLLM's own truncation or min_tokens would act on the processed row and change the distribution
        if params.temperature != 1.0 or params.top_p != 1.0 or params.top_k not in (0, -1) or params.min_tokens:
            raise ValueError("CosyVoice RAS requests need temperature 1, top_p 1, top_k -1 and min_tokens 0 "
                             "(the processor applies CosyVoice's own top-p/top-k and min length)")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        args = (params.extra_args or {}).get(RAS_KEY)
        if args is None:
            return None
        cfg = RASConfig(top_p=float(args["top_p"]), top_k=int(args["top_k"]), win_size=int(args["win_size"]),
                        tau_r=float(args["tau_r"]))
        min_tokens, masked_id = int(args["min_tokens"]), int(args["min_len_masked_id"])

        def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            held_back = masked_id if len(output_ids) < min_tokens else None
            probs = ras_probs(logits, list(output_ids), cfg, masked_id=held_back)
            return probs.log().to(logits.dtype)    # log 0 = -inf: never sampled

        return apply
