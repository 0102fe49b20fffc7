"""One GRPO update on a batch of rollouts, with verl's own algorithm functions (core_algos).

Tensors follow verl's layout: prompts left-padded to P, responses right-padded to R; log-probs,
advantages and masks are (N, R). Log-probs are normalised over the full vocabulary, as in verl's actor;
with CosyVoiceLMForCausalLM's masked head that is exactly the distribution rollouts sample from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F
from verl.workers.config.actor import ActorConfig


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor        # (N, P + R)
    attention_mask: torch.Tensor   # (N, P + R)
    position_ids: torch.Tensor     # (N, P + R)
    responses: torch.Tensor        # (N, R)
    response_mask: torch.Tensor    # (N, R) float
    scores: torch.Tensor           # (N,)
    group_index: np.ndarray        # (N,) prompt id of each sample
    rollout_logp: torch.Tensor | None = None   # (N, R) pi_rollout per token (off-policy decoding only)
    components: dict[str, np.ndarray] | None = None   # reward_<name> -> (N,) values (group-normalised rewards)

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.responses.shape[1]

    def select(self, rows) -> RolloutBatch:
        rows = torch.as_tensor(rows, dtype=torch.long)
        return RolloutBatch(self.input_ids[rows], self.attention_mask[rows], self.position_ids[rows],
                            self.responses[rows], self.response_mask[rows], self.scores[rows],
                            self.group_index[rows.numpy()],
                            None if self.rollout_logp is None else self.rollout_logp[rows],
                            None if self.components is None
                            else {k: v[rows.numpy()] for k, v in self.components.items()})


def build_batch(prompts: list[list[int]], responses: list[list[int]], scores: list[float], group_index: list,
                pad_token_id: int, rollout_logps: list[list[float]] | None = None) -> RolloutBatch:
    """verl's layout from variable-length prompts and responses (and the rollout's per-token log-probs)."""
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    N = len(prompts)
    input_ids = torch.full((N, P + R), pad_token_id, dtype=torch.long)
    attention = torch.zeros((N, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(p):P] = torch.tensor(p)
        attention[i, P - len(p):P] = 1
        if r:
            input_ids[i, P:P + len(r)] = torch.tensor(r)
            attention[i, P:P + len(r)] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    rollout_logp = None
    if rollout_logps is not None:
        rollout_logp = torch.zeros((N, R), dtype=torch.float32)
        for i, lp in enumerate(rollout_logps):
            rollout_logp[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return RolloutBatch(input_ids, attention, position_ids, input_ids[:, P:].clone(),
                        attention[:, P:].float(), torch.tensor(scores, dtype=torch.float32), np.asarray(group_index),
                        rollout_logp)


def response_logits(model, batch: RolloutBatch) -> torch.Tensor:
    """Logits predicting each response token, (N, R, V)."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False)
    P, R = batch.prompt_width, batch.responses.shape[1]
    return out.logits[:, P - 1:P - 1 + R].float()


def log_probs(model, batch: RolloutBatch, with_entropy: bool = False, allowed: torch.Tensor | None = None):
    """Log-probs of the response tokens over the full vocabulary; with `with_entropy` also per-token entropy
    and (given the `allowed` vocabulary mask) the probability on ids outside it, which the masked speech head
    keeps at exactly 0 (logged as `non_speech_mass`, a check that the head is the exact one)."""
    logits = response_logits(model, batch)
    logp = verl_F.logprobs_from_logits(logits, batch.responses)
    if not with_entropy:
        return logp, None, None
    leak = None
    if allowed is not None:   # P(outside) = exp(logsumexp over the other ids - logsumexp over all): no cancellation
        outside = logits.masked_fill(allowed.to(logits.device), float("-inf"))
        leak = (torch.logsumexp(outside, -1) - torch.logsumexp(logits, -1)).exp()
    return logp, verl_F.entropy_from_logits(logits), leak


def grpo_advantages(batch: RolloutBatch, norm_by_std: bool) -> torch.Tensor:
    """Outcome reward on the last response token, then verl's GRPO group normalisation."""
    token_rewards = torch.zeros_like(batch.response_mask)
    last = (batch.response_mask.sum(-1).long() - 1).clamp(min=0)
    token_rewards[torch.arange(len(last)), last] = batch.scores
    adv, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, batch.response_mask, batch.group_index,
                                                       norm_adv_by_std_in_grpo=norm_by_std)
    return adv


def group_normalized_advantages(batch: RolloutBatch, keys: list[str], weights: list[float],
                                norm_by_std: bool) -> torch.Tensor:
    """GDPO through verl's own estimator (core_algos.compute_gdpo_outcome_advantage), as main_ppo calls it with
    adv_estimator=gdpo: each component GRPO-normalised within its group, weighted, summed, whitened."""
    from verl.trainer.config.algorithm import AlgoConfig

    missing = [k for k in keys if batch.components is None or k not in batch.components
               or np.isnan(batch.components[k]).any()]
    if missing:
        raise ValueError(f"reward.combine=group_normalized: no value for {missing} (does the backend give them?)")
    token_rewards = torch.zeros_like(batch.response_mask)
    config = AlgoConfig(adv_estimator="gdpo", norm_adv_by_std_in_grpo=norm_by_std, gdpo_reward_keys=keys,
                        gdpo_reward_weights=weights)
    adv, _ = core_algos.compute_gdpo_outcome_advantage(
        token_rewards, batch.response_mask, batch.group_index, norm_adv_by_std_in_grpo=norm_by_std, config=config,
        non_tensor_batch=batch.components,
        batch={"prompts": batch.input_ids[:, :batch.prompt_width], "attention_mask": batch.attention_mask})
    return adv


def actor_config(train_cfg) -> ActorConfig:
    return ActorConfig(strategy="local", rollout_n=train_cfg.n, use_dynamic_bsz=True,
                       clip_ratio_low=train_cfg.clip_ratio_low, clip_ratio_high=train_cfg.clip_ratio_high,
                       clip_ratio_c=train_cfg.clip_ratio_c, loss_agg_mode=train_cfg.loss_agg_mode,
                       entropy_coeff=train_cfg.entropy_coeff, use_kl_loss=train_cfg.use_kl_loss,
                       kl_loss_coef=train_cfg.kl_loss_coef, kl_loss_type=train_cfg.kl_loss_type)


def rollout_is_weights(old_logp: torch.Tensor, batch: RolloutBatch, correction: dict) -> tuple[torch.Tensor, dict]:
    """verl's token-level truncated IS weights min(pi_old / pi_rollout, threshold) and its rollout_corr/
    metrics (rollout_corr_helper), for rollouts drawn off the policy (grpo.decoding.rollout_correction)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    weights, _, metrics = compute_rollout_correction_and_rejection_mask(
        old_logp, batch.rollout_logp, batch.response_mask, rollout_is=correction["rollout_is"],
        rollout_is_threshold=correction["rollout_is_threshold"], rollout_rs=correction["rollout_rs"])
    return weights.batch["rollout_is_weights"], metrics


class NonFiniteLogProbs(SystemExit):
    """Log-probs with NaN or inf: the step stops before the optimizer (its message is the one line a user sees)."""


def require_finite(name: str, logp, mask: torch.Tensor | None, dtype: str) -> None:
    """NonFiniteLogProbs when `logp` (a tensor, with the response mask, or a list of per-token values) holds NaN
    or inf: vllm-omni#4168 reports CosyVoice3's LLM producing NaNs in fp16/bf16, and a NaN that reaches the loss
    poisons every parameter."""
    values = logp if isinstance(logp, torch.Tensor) else torch.tensor(logp, dtype=torch.float64)
    bad = ~torch.isfinite(values)
    if mask is not None:
        bad &= mask.bool()
    if bad.any():
        total = int(mask.sum()) if mask is not None else values.numel()
        raise NonFiniteLogProbs(
            f"{name} log-probs are NaN or inf at {int(bad.sum())} of {total} response tokens (train.rollout.dtype="
            f"{dtype}): the step stops before the optimizer; run the rollouts in float32 (train.rollout.dtype=float32)")


def policy_loss(model, batch: RolloutBatch, advantages, old_logp, ref_logp, cfg: ActorConfig, allowed=None,
                is_weights: torch.Tensor | None = None):
    """verl's actor loss: clipped policy gradient (+ KL to the reference when use_kl_loss) (- entropy bonus);
    `is_weights`: the rollout correction's per-token weights (off-policy decoding)."""
    logp, entropy, leak = log_probs(model, batch, with_entropy=True, allowed=allowed)
    mask = batch.response_mask
    old = logp.detach() if old_logp is None else old_logp
    pg_loss, pg_metrics = core_algos.compute_policy_loss_vanilla(old, logp, advantages, mask, cfg.loss_agg_mode,
                                                                 config=cfg, rollout_is_weights=is_weights)
    entropy_mean = core_algos.agg_loss(entropy, mask, cfg.loss_agg_mode)
    loss = pg_loss - cfg.entropy_coeff * entropy_mean
    metrics = {"pg_loss": pg_loss.item(), "entropy": entropy_mean.item(),
               **{k.split("/")[-1]: v for k, v in pg_metrics.items()}}
    if leak is not None:
        metrics["non_speech_mass"] = core_algos.agg_loss(leak.detach(), mask, "token-mean").item()
    if ref_logp is not None:   # KL to the reference model: a loss term when use_kl_loss, else only a metric
        kl = core_algos.agg_loss(core_algos.kl_penalty(logp, ref_logp, cfg.kl_loss_type), mask, cfg.loss_agg_mode)
        if cfg.use_kl_loss:
            loss = loss + cfg.kl_loss_coef * kl
        metrics["kl"] = kl.item()
    return loss, metrics


def filter_groups(batch: RolloutBatch) -> tuple[RolloutBatch | None, int]:
    """Drop groups whose rewards are all equal (zero advantage, no signal)."""
    keep, dropped = [], 0
    for g in np.unique(batch.group_index):
        rows = np.nonzero(batch.group_index == g)[0]
        if len(rows) > 1 and torch.all(batch.scores[rows] == batch.scores[rows[0]]):
            dropped += 1
        else:
            keep.extend(rows.tolist())
    return (batch.select(sorted(keep)) if keep else None), dropped
