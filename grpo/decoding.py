"""How speech tokens are sampled: the decoding presets, CosyVoice's length bounds, and its RAS rule in closed form.

Everything here is CosyVoice at the pinned commit (grpo/upstream.py, ace7c47): `cosyvoice/llm/llm.py`
(`Qwen2LM.inference`, `sampling_ids`, `inference_wrapper`) and `cosyvoice/utils/common.py` (`ras_sampling`,
`nucleus_sampling`, `random_sampling`).

Presets (`eval.decoding`, `train.decoding`):
- `cosyvoice_ras`: CosyVoice's PyTorch inference (`Qwen2LM.inference` with the released yaml's `ras_sampling`:
  top_p 0.8, top_k 25, win_size 10, tau_r 0.1), exactly, through the vLLM logits processor of
  grpo.model.ras_logits: the processor sets the logits to log P_ras (below), vLLM then samples at temperature 1
  with no top-k/top-p and no `min_tokens` (its MinTokens processor runs first and would change the nucleus).
- `cosyvoice_vllm`: CosyVoice's vLLM path (`inference_wrapper`): `SamplingParams(top_k=25, min_tokens=min_len,
  max_tokens=max_len, stop_token_ids=...)` at temperature 1 (vLLM's min_tokens holds back every stop id).
- `plain`: temperature / top_p / top_k as configured (vLLM's own rules), `min_tokens` (training's on-policy sampler).

Length bounds as in `Qwen2LM.inference`: with n the target text's token count (the prompt text excluded),
min_len = int(n * min_ratio), max_len = int(n * max_ratio).

One step of `Qwen2LM.sampling_ids` + `ras_sampling`, with s the step's scores:
- before min_len, row `speech_token_size` of s is set to -inf (CosyVoice2: its eos; CosyVoice3: its sos -- its
  eos is the next row), before anything else: the nucleus is taken without it; the other stop rows stay;
- p = softmax(s); CosyVoice's nucleus N keeps sorted index i while i < top_k and the mass before i is < top_p
  (so it keeps the token that crosses top_p); q = p on N, renormalised; x is drawn from q;
- if x occurs at least win_size * tau_r times among the last win_size generated tokens (x in R), x's score is set
  to -inf and the token is drawn again from the softmax of what is left, p_x(y) = p(y) [y != x] / (1 - p(x)).
So P_ras(y) = q(y) [y not in R] + sum over x in N and R of q(x) p_x(y). (Before upstream's fix f2ddcbe of
2026-02-04 the redraw was from all of p, x included: P = q(y) [y not in R] + q(R) p(y); not offered here.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

PRESETS = ("cosyvoice_ras", "cosyvoice_vllm", "plain")
RAS_KEY = "cosyvoice_ras"          # SamplingParams.extra_args key that turns the processor on for a request
RAS_PROCESSOR = "grpo.model.ras_logits:CosyVoiceRAS"   # vLLM's FQCN syntax for `logits_processors`


@dataclass(frozen=True)
class RASConfig:
    """The released cosyvoice2.yaml's `sampling: !name:cosyvoice.utils.common.ras_sampling` defaults."""
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


def text_token_count(tokenizer, text: str) -> int:
    """The token count CosyVoice's bounds use: the text alone, no special tokens (`text_len` in Qwen2LM)."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def length_bounds(text_tokens: int, min_ratio: float, max_ratio: float) -> tuple[int, int]:
    """CosyVoice's (min_len, max_len) for a target text of `text_tokens` tokens (at least one token allowed)."""
    return int(text_tokens * min_ratio), max(1, int(text_tokens * max_ratio))


def capped(min_tokens: int, max_tokens: int, ceiling: int) -> dict:
    """An item's bounds under the response ceiling (train.max_response_tokens): max first, min within it."""
    hi = max(1, min(max_tokens, ceiling))
    return {"min_tokens": min(min_tokens, hi), "max_tokens": hi}


def nucleus_mask(p: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """CosyVoice's nucleus set over a probability vector: sorted i < top_k with the mass before i < top_p."""
    sorted_p, order = p.sort(descending=True, stable=True)
    before = torch.cumsum(sorted_p, 0) - sorted_p
    keep = (before < top_p) & (torch.arange(p.numel(), device=p.device) < top_k)
    mask = torch.zeros_like(p, dtype=torch.bool)
    mask[order[keep]] = True
    return mask


def ras_probs(logits: torch.Tensor, history: list[int], cfg: RASConfig, masked_id: int | None = None) -> torch.Tensor:
    """P_ras over the vocabulary for one step (float32). `history`: the tokens generated so far; `masked_id`: the
    id whose score is -inf before min_len (row `speech_token_size`), None from min_len on."""
    scores = logits.float().clone()
    if masked_id is not None:
        scores[masked_id] = float("-inf")
    p = scores.softmax(-1)
    n = nucleus_mask(p, cfg.top_p, cfg.top_k)
    q = torch.where(n, p, torch.zeros_like(p))
    q = q / q.sum()
    window = history[-cfg.win_size:]                     # Python's slice, as upstream's decoded_tokens[-win_size:]
    counts = torch.bincount(torch.tensor(window, dtype=torch.long), minlength=p.numel())[: p.numel()] \
        if window else torch.zeros(p.numel(), dtype=torch.long)
    repeated = (counts.to(p.device) >= cfg.win_size * cfg.tau_r) & n
    probs = torch.where(repeated, torch.zeros_like(q), q)
    for x in repeated.nonzero().flatten().tolist():       # at most win_size ids
        redraw = scores.clone()
        redraw[x] = float("-inf")
        if torch.isfinite(redraw).any():
            probs = probs + q[x] * redraw.softmax(-1)
        else:   # x held all the mass: upstream's softmax of all -inf is NaN and its draw raises; x is kept here
            probs[x] += q[x]
    return probs


def rollout_correction(preset: str, threshold: float) -> dict | None:
    """verl's `algorithm.rollout_correction` for training rollouts drawn with `preset`: None for `plain` (the
    policy's own distribution), else decoupled mode (pi_old recomputed by the actor, never bypass + PPO clip)
    with token-level IS weights min(pi_old / pi_rollout, threshold), as RolloutCorrectionConfig.decoupled_token_is
    builds them. Both engines use it: the verl launcher as main_ppo overrides, the local engine through verl's
    rollout_corr_helper. pi_rollout is vLLM's processed log-prob (after the RAS processor / top-k)."""
    if preset not in PRESETS:
        raise ValueError(f"train.decoding must be one of {', '.join(PRESETS)}, got {preset!r}")
    if preset == "plain":
        return None
    if not threshold > 1.0:
        raise ValueError(f"train.rollout_is_threshold must be > 1 (an upper bound on pi_old / pi_rollout), "
                         f"got {threshold!r}")
    return {"rollout_is": "token", "rollout_is_threshold": float(threshold), "rollout_rs": None,
            "bypass_mode": False}


def sampling_kwargs(preset: str, min_len: int, max_len: int, temperature: float = 1.0, top_p: float = 1.0,
                    top_k: int = -1, ras: RASConfig | None = None, min_len_masked_id: int | None = None) -> dict:
    """vLLM SamplingParams keyword arguments for one item (stop ids are added by the caller).
    `min_len_masked_id`: the id held back before min_len under `cosyvoice_ras` (SpeechVocab.min_len_masked_id)."""
    if preset == "cosyvoice_ras":
        if min_len_masked_id is None:
            raise ValueError("cosyvoice_ras needs the id held back before min_len (SpeechVocab.min_len_masked_id)")
        ras = ras or RASConfig()
        return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_tokens": 0, "max_tokens": max_len,
                "extra_args": {RAS_KEY: {**asdict(ras), "min_tokens": min_len,
                                         "min_len_masked_id": int(min_len_masked_id)}}}
    if preset == "cosyvoice_vllm":
        return {"temperature": 1.0, "top_p": 1.0, "top_k": (ras or RASConfig()).top_k, "min_tokens": min_len,
                "max_tokens": max_len}
    if preset == "plain":
        return {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_tokens": min_len,
                "max_tokens": max_len}
    raise ValueError(f"decoding must be one of {', '.join(PRESETS)}, got {preset!r}")
