"""The local engine: GRPO in one process (CPU, or one GPU), with verl's algorithm functions.

Each step: a batch of prompts -> n samples each (vLLM or transformers, speech tokens only, seeded per
request) -> rewards through the same `compute_score` verl calls (reward server, concurrently) -> GRPO
advantages and verl's actor loss -> AdamW step -> new weights into the rollout engine.
Checkpoints carry the optimizer, RNG states and data position, so a killed run resumes where it was.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from grpo.decoding import length_bounds, request_seed, rollout_correction, text_token_count
from grpo.layout import TrainDir
from grpo.model.speech_vocab import SpeechVocab
from grpo.node.device import resolve as resolve_device
from grpo.speech.components import gdpo_components
from grpo.train import local_checkpoint as checkpoint
from grpo.train.grpo_step import (
    actor_config,
    build_batch,
    filter_groups,
    group_normalized_advantages,
    grpo_advantages,
    log_probs,
    policy_loss,
    require_finite,
    rollout_is_weights,
)
from grpo.train.metrics_log import VERL_METRICS, MetricsLogger, component_means, plot_curves
from grpo.train.reward_fn import compute_score, reward_kwargs
from grpo.train.rollout import SamplingConfig, TransformersRollout, VLLMRollout

log = logging.getLogger(__name__)


def load_records(path: str | Path) -> list[dict]:
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run the data stage first (bash run.sh 0 0)")
    return datasets.load_dataset("parquet", data_files=str(path), split="train").to_list()


class LocalGRPOTrainer:
    def __init__(self, cfg: DictConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg, t = cfg, cfg.train
        # inference's sampler in training (train.decoding): off-policy, reweighted per token as verl does
        self.correction = rollout_correction(t.decoding, t.rollout_is_threshold)
        if self.correction and t.rollout.backend != "vllm":
            raise ValueError(f"train.decoding={t.decoding} needs train.rollout.backend=vllm (the RAS processor and "
                             f"vLLM's processed log-probs); got {t.rollout.backend!r}")
        self.gdpo = gdpo_components(cfg.reward)      # reward.combine=group_normalized: (keys, weights)
        self.out_dir = Path(t.out_dir)
        self.files = TrainDir(self.out_dir)
        self.ckpt_root = self.files.local_checkpoints
        self.base_dir = Path(cfg.model.hf_dir)
        resume_dir = checkpoint.latest(self.ckpt_root) if t.resume else None
        model_dir = resume_dir or self.base_dir
        torch.manual_seed(cfg.seed)
        device = resolve_device(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab = SpeechVocab.load(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
        self.ref = None
        if t.use_kl_loss or t.kl_metric:
            self.ref = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32).to(device).eval()
            self.ref.requires_grad_(False)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        warmup = max(1, t.warmup_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda s: min(1.0, (s + 1) / warmup))
        self.records = self._usable_records(load_records(Path(cfg.data.out_dir) / "train.parquet"))
        self.step, self.epoch, self.offset = 0, 0, 0
        if resume_dir:
            state = checkpoint.load_state(resume_dir)
            self.optim.load_state_dict(state["optimizer"])
            self.sched.load_state_dict(state["scheduler"])
            checkpoint.set_rng_state(state["rng"])
            self.step, self.epoch, self.offset = state["step"], state["epoch"], state["offset"]
            log.info("resuming from %s (step %d, epoch %d, offset %d)", resume_dir, self.step, self.epoch, self.offset)
        self.sampling = SamplingConfig(n=t.n, temperature=t.temperature, top_p=t.top_p, top_k=t.top_k,
                                       max_tokens=t.max_response_tokens, decoding=t.decoding)
        if t.rollout.backend == "vllm":   # processed log-probs: pi_rollout after the RAS processor / top-k
            self.rollout = VLLMRollout(model_dir, self.vocab, t.rollout.dtype, t.rollout.gpu_memory_utilization,
                                       t.rollout.enforce_eager, t.max_prompt_tokens + t.max_response_tokens, cfg.seed,
                                       t.rollout.cpu_kv_cache_gib, decodings=(t.decoding,),
                                       logprobs_mode="processed_logprobs")
        elif t.rollout.backend == "transformers":
            self.rollout = TransformersRollout(self.model, self.vocab, self.tokenizer.pad_token_id)
        else:
            raise ValueError(f"train.rollout.backend must be vllm or transformers, got {t.rollout.backend!r}")
        self.actor_cfg = actor_config(t)
        self.allowed = self.vocab.allowed_mask()
        self.reward_kwargs = reward_kwargs(cfg)
        self.loop = asyncio.new_event_loop()
        self.logger = MetricsLogger(self.out_dir, list(t.logger), t.project_name, t.experiment_name,
                                    OmegaConf.to_container(cfg, resolve=True), resume_step=self.step)

    def _usable_records(self, records: list[dict]) -> list[dict]:
        t = self.cfg.train
        for r in records:
            r["prompt_ids"] = self.tokenizer.apply_chat_template(r["prompt"], tokenize=True, return_dict=False)
            # CosyVoice's bounds from the target text's tokens (the prompt holds that text alone)
            r["length_bounds"] = length_bounds(text_token_count(self.tokenizer, r["prompt"][-1]["content"]),
                                               t.min_token_text_ratio, t.max_token_text_ratio)
        usable = [r for r in records if len(r["prompt_ids"]) <= self.cfg.train.max_prompt_tokens]
        short = sum(r["length_bounds"][0] >= t.max_response_tokens for r in usable)
        if short:
            log.warning("%d prompts need at least train.max_response_tokens=%d speech tokens (min_token_text_ratio=%s):"
                        " they are cut at the ceiling without an end-of-speech", short, t.max_response_tokens,
                        t.min_token_text_ratio)
        if len(usable) < len(records):
            log.warning("%d prompts longer than train.max_prompt_tokens=%d are skipped",
                        len(records) - len(usable), self.cfg.train.max_prompt_tokens)
        if len(usable) < self.cfg.train.batch_size:
            raise ValueError(f"{len(usable)} usable prompts, fewer than train.batch_size={self.cfg.train.batch_size}")
        return usable

    def next_batch(self) -> list[dict]:
        """Deterministic epochs: a seeded permutation per epoch, consumed in order (resumable by position)."""
        out = []
        while len(out) < self.cfg.train.batch_size:
            perm = np.random.RandomState(self.cfg.seed + self.epoch).permutation(len(self.records))
            take = perm[self.offset:self.offset + self.cfg.train.batch_size - len(out)]
            out += [self.records[i] for i in take]
            self.offset += len(take)
            if self.offset >= len(self.records):
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    async def _score(self, records, responses) -> list[dict]:
        tasks = [compute_score(r["data_source"], self.tokenizer.decode(resp, skip_special_tokens=True),
                               r["reward_model"]["ground_truth"], r["extra_info"], **self.reward_kwargs)
                 for r, resp in zip(records, responses)]
        return await asyncio.gather(*tasks)

    def train_step(self, step: int) -> dict:
        t = self.cfg.train
        records = self.next_batch()
        prompts = [r["prompt_ids"] for r in records]
        t0 = time.perf_counter()
        seeds = [request_seed(self.cfg.seed, step, i) for i in range(len(prompts))]
        bounds = [r["length_bounds"] for r in records]
        if self.correction:
            groups, group_logps = self.rollout.generate_with_logprobs(prompts, self.sampling, seeds, bounds)
            rollout_logps = [lp for group in group_logps for lp in group]
        else:
            groups, rollout_logps = self.rollout.generate(prompts, self.sampling, seeds, bounds), None
        flat = [(i, resp) for i, group in enumerate(groups) for resp in group]
        t1 = time.perf_counter()
        results = self.loop.run_until_complete(self._score([records[i] for i, _ in flat], [r for _, r in flat]))
        t2 = time.perf_counter()
        ok = [k for k, res in enumerate(results) if not res["reward_failed"]]
        scored = [results[k] for k in ok]
        batch_ids = ",".join(r["extra_info"]["sample_id"] for r in records)
        metrics = {
            "step": step, "epoch": self.epoch, "batch_hash": hashlib.sha1(batch_ids.encode()).hexdigest()[:10],
            "reward_mean": float(np.mean([s["score"] for s in scored])) if scored else math.nan,
            "reward_std": float(np.std([s["score"] for s in scored])) if scored else math.nan,
            "error_rate_mean": float(np.mean([s["error_rate"] for s in scored])) if scored else math.nan,
            "response_length_mean": float(np.mean([len(r) for _, r in flat])),
            "reward_failures": len(results) - len(ok), "no_speech": sum(s["no_speech"] for s in scored),
            "time_rollout_s": t1 - t0, "time_reward_s": t2 - t1, "lr": self.sched.get_last_lr()[0],
            **component_means(scored),
        }
        batch, metrics["groups_filtered"] = None, 0
        if ok:   # with reward.on_failure=exclude, failed samples are left out of the update
            batch = build_batch([prompts[flat[k][0]] for k in ok], [flat[k][1] for k in ok],
                                [results[k]["score"] for k in ok], [flat[k][0] for k in ok],
                                self.tokenizer.pad_token_id,
                                None if rollout_logps is None else [rollout_logps[k] for k in ok])
            if self.gdpo:
                batch.components = {key: np.array([results[k][key] for k in ok], dtype=np.float32)
                                    for key in self.gdpo[0]}
            if t.filter_groups:
                batch, metrics["groups_filtered"] = filter_groups(batch)
        metrics.update(self._update(batch) if batch is not None else {"update_skipped": 1})
        metrics["time_update_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        self.rollout.sync_weights(self.model)
        metrics["time_sync_s"] = time.perf_counter() - t3
        return metrics

    def _logp(self, model, batch):
        return log_probs(model, batch)[0]

    def _update(self, batch) -> dict:
        t = self.cfg.train
        advantages = (group_normalized_advantages(batch, *self.gdpo, t.norm_adv_by_std_in_grpo) if self.gdpo
                      else grpo_advantages(batch, t.norm_adv_by_std_in_grpo))
        with torch.no_grad():
            ref_logp = self._logp(self.ref, batch) if self.ref is not None else None
            groups = np.unique(batch.group_index)
            mb_groups = t.mini_batch_size or len(groups)
            multi = t.ppo_epochs > 1 or mb_groups < len(groups)
            # on-policy, one pass: the ratio is exactly 1; off-policy decoding: pi_old anchors (decoupled mode)
            old_logp = self._logp(self.model, batch) if multi or self.correction else None
        for name, logp in (("rollout", batch.rollout_logp), ("old", old_logp), ("reference", ref_logp)):
            if logp is not None:
                require_finite(name, logp, batch.response_mask, t.rollout.dtype)
        weights, corr_metrics = (rollout_is_weights(old_logp, batch, self.correction) if self.correction
                                 else (None, {}))
        agg: dict[str, list] = {}
        for _ in range(t.ppo_epochs):
            for start in range(0, len(groups), mb_groups):
                rows = np.nonzero(np.isin(batch.group_index, groups[start:start + mb_groups]))[0]
                mb = batch.select(rows)
                loss, m = policy_loss(self.model, mb, advantages[rows],
                                      None if old_logp is None else old_logp[rows],
                                      None if ref_logp is None else ref_logp[rows], self.actor_cfg,
                                      self.allowed, None if weights is None else weights[rows])
                if not torch.isfinite(loss):       # the current policy's own log-probs (or what follows them)
                    require_finite("current policy", loss.detach().reshape(1), None, t.rollout.dtype)
                self.optim.zero_grad(set_to_none=True)
                loss.backward()
                m["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip).item()
                self.optim.step()
                for k, v in m.items():
                    agg.setdefault(k, []).append(v)
        self.sched.step()
        return {**{k: float(np.mean(v)) for k, v in agg.items()},
                **{VERL_METRICS.get(k, k): v for k, v in corr_metrics.items()}}   # verl's names, as in its runs

    def save(self) -> Path:
        state = {"optimizer": self.optim.state_dict(), "scheduler": self.sched.state_dict(),
                 "epoch": self.epoch, "offset": self.offset}
        return checkpoint.save(self.ckpt_root, self.step, self.model, self.tokenizer, self.base_dir, state)

    def close(self) -> None:
        """Release the rollout engine (an in-process vLLM engine holds its memory until shut down)."""
        self.rollout.close()

    def fit(self) -> Path:
        t = self.cfg.train
        if self.step >= t.total_steps:
            log.info("already at step %d of %d; nothing to train", self.step, t.total_steps)
        bar = tqdm(range(self.step + 1, t.total_steps + 1), desc="GRPO (local)", initial=self.step,
                   total=t.total_steps, mininterval=5)
        for step in bar:
            metrics = self.train_step(step)
            self.step = step
            self.logger.log(metrics)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", err=f"{metrics['error_rate_mean']:.3f}",
                            refresh=False)
            if step % t.save_freq == 0 or step == t.total_steps:
                log.info("checkpoint %s", self.save())
        self.logger.close()
        png = plot_curves(self.files.metrics, self.files.curves)
        if png:
            log.info("reward / error-rate curves: %s", png)
        return self.out_dir
