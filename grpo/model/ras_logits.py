"""CosyVoice's repetition-aware sampling as a vLLM (V1) logits processor, exact (see grpo.decoding).

Loaded by name (`LLM(logits_processors=[grpo.decoding.RAS_PROCESSOR])`, verl: `engine_kwargs.vllm.
logits_processors`) and switched on per request by `SamplingParams.extra_args["cosyvoice_ras"]`; requests
without it are untouched. One batched pass a step over every RAS row (grpo.decoding.ras_probs_batch), on the
logits' device, over the speech and stop columns only (the head's `head_rows`; every other column has
probability 0 under the masked head): no Python work per row beyond reading its window, no host sync.

vLLM hands each added request's live output-token list (vllm/v1/sample/logits_processor/interface.py,
BatchUpdate): the window is the tokens generated so far, as CosyVoice's `out_tokens`. Under async scheduling vLLM
replaces the last step's placeholder (-1) with the sampled id before a custom processor runs
(vllm/v1/worker/gpu_input_batch.py, update_async_output_token_ids); a placeholder still in a window is an error,
never a silently shorter history. The rows become log P_ras; vLLM then samples softmax(row) (temperature 1, no
top-k/top-p), i.e. P_ras. Registering the processor at all makes vLLM keep every request's output ids on the host,
so engines register it only when some request decodes with RAS (grpo.decoding.logits_processors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from grpo.decoding import RAS_KEY, ras_probs_batch

_FIELDS = {"top_p", "top_k", "win_size", "tau_r", "min_tokens", "min_len_masked_id"}


@dataclass
class _Request:
    top_p: float
    top_k: int
    win_size: int
    repeat_at: float
    min_tokens: int
    masked_col: int
    output_ids: list[int]          # vLLM's live list: grows as the request decodes


class CosyVoiceRAS(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # settings under which this processor would not see (or not decide) every sampled token
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError("CosyVoice RAS needs every token sampled from its distribution: turn speculative "
                             "decoding off")
        if getattr(vllm_config, "use_v2_model_runner", False):
            raise ValueError("CosyVoice RAS is a V1 logits processor: set VLLM_USE_V2_MODEL_RUNNER=0")
        model_config = getattr(vllm_config, "model_config", None)
        hf_config = getattr(model_config, "hf_config", None)
        rows = getattr(hf_config, "head_rows", None)
        self.first, self.end = (rows[0], rows[1]) if rows else (0, None)    # None: every column
        self.device = device
        self.requests: dict[int, _Request] = {}

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

    def _new_state(self, params: SamplingParams, _prompt_ids, output_ids: list[int]) -> _Request | None:
        args = (params.extra_args or {}).get(RAS_KEY)
        if args is None:
            return None
        return _Request(float(args["top_p"]), int(args["top_k"]), int(args["win_size"]),
                        int(args["win_size"]) * float(args["tau_r"]), int(args["min_tokens"]),
                        int(args["min_len_masked_id"]) - self.first, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.requests, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.requests:
            return logits
        index = sorted(self.requests)
        reqs = [self.requests[i] for i in index]
        width = max(r.win_size for r in reqs)
        recent = [r.output_ids[-r.win_size:] if r.win_size else [] for r in reqs]
        if any(-1 in w for w in recent):
            raise RuntimeError("CosyVoice RAS: a request's output ids still hold vLLM's placeholder (-1); its "
                               "window would be a shorter history than the request's own tokens")
        # each row's window, left-padded with -1 to the widest, in column space
        windows = [[-1] * (width - len(w)) + [t - self.first for t in w] for w in recent]
        host = {"windows": torch.tensor(windows, dtype=torch.long),
                "top_p": torch.tensor([r.top_p for r in reqs], dtype=torch.float32),
                "top_k": torch.tensor([r.top_k for r in reqs], dtype=torch.long),
                "repeat_at": torch.tensor([r.repeat_at for r in reqs], dtype=torch.float32),
                "masked": torch.tensor([r.masked_col if len(r.output_ids) < r.min_tokens else -1 for r in reqs],
                                       dtype=torch.long),
                "rows": torch.tensor(index, dtype=torch.long)}
        dev = {k: v.to(logits.device, non_blocking=True) for k, v in host.items()}
        end = self.end or logits.shape[1]
        probs = ras_probs_batch(logits[dev["rows"], self.first:end], dev["windows"], dev["top_p"], dev["top_k"],
                                dev["repeat_at"], dev["masked"], max(r.top_k for r in reqs))
        out = torch.full((len(index), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        out[:, self.first:end] = probs.log().to(logits.dtype)          # log 0 = -inf: never sampled
        logits[dev["rows"]] = out
        return logits
