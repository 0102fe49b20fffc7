"""How speech tokens are sampled: the decoding presets, CosyVoice's length bounds, and its RAS rule in closed form.

Everything here is CosyVoice at the pinned commit (grpo/upstream/pin.py, ace7c47): `cosyvoice/llm/llm.py`
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

import hashlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:                   # torch only where probabilities are computed: the launcher reads presets alone
    import torch

PRESETS = ("cosyvoice_ras", "cosyvoice_vllm", "plain")
RAS_KEY = "cosyvoice_ras"          # SamplingParams.extra_args key that turns the processor on for a request
RAS_PROCESSOR = "grpo.model.ras_logits:CosyVoiceRAS"   # vLLM's FQCN syntax for `logits_processors`


def logits_processors(*presets: str) -> list[str]:
    """vLLM's `logits_processors` for an engine whose requests decode with `presets`: the RAS processor only when one
    of them is `cosyvoice_ras`. Any registered custom processor makes vLLM keep every request's output ids on the
    host each step (vllm/v1/worker/gpu_model_runner.py, logitsprocs_need_output_token_ids), so plain decoding
    registers none and pays nothing."""
    for preset in presets:
        if preset not in PRESETS:
            raise ValueError(f"decoding must be one of {', '.join(PRESETS)}, got {preset!r}")
    return [RAS_PROCESSOR] if "cosyvoice_ras" in presets else []


@dataclass(frozen=True)
class RASConfig:
    """The released cosyvoice2.yaml's `sampling: !name:cosyvoice.utils.common.ras_sampling` defaults."""
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


def request_seed(seed: int, step: int, index: int) -> int:
    """The seed of one request: a stable hash of (run seed, step or sample, item index), so a (prompt, seed) pair
    draws the same samples in training and in every evaluation."""
    return int.from_bytes(hashlib.sha1(f"{seed}:{step}:{index}".encode()).digest()[:4], "big") & 0x7FFFFFFF


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


def ras_probs_batch(scores: torch.Tensor, windows: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                    repeat_at: torch.Tensor, masked: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """P_ras for a batch of rows at once, on the scores' device, with no host sync (float32, (B, V)).

    scores (B, V): the step's logits over the columns that can be drawn (the processor passes the speech and stop
    rows; every other column's probability is exactly 0 under the masked head). windows (B, W): each row's last
    win_size generated ids in column space, -1 where there is none. top_p, top_k, repeat_at (= win_size * tau_r)
    and masked (the column held back before min_len, -1 from min_len on): one value per row. max_top_k: the
    largest top_k, a host int (it sizes the nucleus slice, so reading it from the device would sync)."""
    import torch

    scores = scores.float().clone()
    cols = scores.shape[1]
    held = masked.clamp(min=0)[:, None]
    scores.scatter_(1, held, torch.where(masked[:, None] >= 0, float("-inf"), scores.gather(1, held)))
    top = scores.argmax(-1, keepdim=True)
    e = (scores - scores.gather(1, top)).exp()                           # p up to the row's sum S
    total = e.sum(-1, keepdim=True)
    p = e / total
    # CosyVoice's nucleus: sorted index i < top_k with the mass before i < top_p (a stable sort: ties keep id order)
    k = min(max_top_k, cols)
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
    head = sorted_p[:, :k]
    keep = (torch.cumsum(head, -1) - head < top_p[:, None]) & \
        (torch.arange(k, device=p.device)[None] < top_k[:, None])
    nucleus = torch.zeros_like(p, dtype=torch.bool).scatter_(1, order[:, :k], keep)
    q = torch.where(nucleus, p, 0.0)
    q = q / q.sum(-1, keepdim=True)
    # x drawn and seen >= repeat_at times in the window: redrawn from the softmax without x, e_y [y != x] / Z_x
    present = windows >= 0
    ids = windows.clamp(min=0)                                           # padding reads column 0, weight 0
    counts = torch.zeros_like(p).scatter_add_(1, ids, present.float())
    repeated = (counts >= repeat_at[:, None]) & nucleus
    base = torch.where(repeated, 0.0, q)
    width = windows.shape[1]
    earlier = torch.ones(width, width, dtype=torch.bool, device=p.device).tril(-1)
    same = ids[:, :, None] == ids[:, None, :]
    first_seen = ~(same & present[:, None, :] & earlier).any(-1)
    redrawn = present & first_seen & repeated.gather(1, ids)             # (B, W): each repeated x once
    weight = torch.where(redrawn, q.gather(1, ids), 0.0)
    e_x = e.gather(1, ids)
    # Z_x = S - e_x, except for the row's top id, whose rest is summed directly (no cancellation when it holds
    # nearly all the mass)
    rest_of_top = e.scatter(1, top, 0.0).sum(-1, keepdim=True)
    z = torch.where(ids == top, rest_of_top, total - e_x)
    finite = z > 0
    ratio = torch.where(redrawn & finite, weight / torch.where(finite, z, 1.0), 0.0)
    probs = base + e * ratio.sum(-1, keepdim=True)
    # at a window id y the redraw of y itself adds nothing: the sum over the other x, taken directly
    others = (ratio[:, None, :] * ~same).sum(-1)
    probs.scatter_(1, ids, base.gather(1, ids) + e_x * others)
    # x held all the mass: upstream's softmax of all -inf is NaN and its draw raises; x is kept here
    return probs.scatter_add_(1, ids, torch.where(redrawn & ~finite, weight, 0.0))


def ras_probs(logits: torch.Tensor, history: list[int], cfg: RASConfig, masked_id: int | None = None) -> torch.Tensor:
    """P_ras over the vocabulary for one step (float32). `history`: the tokens generated so far; `masked_id`: the
    id whose score is -inf before min_len (row `speech_token_size`), None from min_len on."""
    import torch

    window = history[-cfg.win_size:]                     # Python's slice, as upstream's decoded_tokens[-win_size:]
    device = logits.device

    def one(value, dtype):
        return torch.tensor([value], dtype=dtype, device=device)

    windows = torch.tensor([window or [-1]], dtype=torch.long, device=device)
    return ras_probs_batch(logits[None], windows, one(cfg.top_p, torch.float32), one(cfg.top_k, torch.long),
                           one(cfg.win_size * cfg.tau_r, torch.float32),
                           one(-1 if masked_id is None else masked_id, torch.long), cfg.top_k)[0]


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
