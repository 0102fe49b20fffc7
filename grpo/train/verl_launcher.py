"""Cluster engine: the `verl.trainer.main_ppo` command built from the one config tree.

Algorithm keys (group size, clip ratios, loss aggregation, KL, sampling) are written once under
`train.*` and mapped here; `train.verl.extra_overrides` are appended last for anything else.
main_ppo needs CUDA GPUs (its rollout runs vLLM servers); `train.verl.dry_run=true` prints the command
and checks that verl composes it (`--cfg job`), which works on any machine.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from grpo.train.verl_agent_loop import AGENT_LOOP_CONFIG, AGENT_NAME
from grpo.config import REPO_ROOT
from grpo.train.reward_fn import reward_kwargs

log = logging.getLogger(__name__)


def _value(v) -> str:
    """A Hydra override value: null/bool/number as is, strings quoted when they need it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    s = str(v)
    return s if s.replace("_", "").replace("-", "").replace(".", "").replace("/", "").isalnum() else f"'{s}'"


def build_overrides(cfg: DictConfig) -> list[str]:
    t, v = cfg.train, cfg.train.verl
    if cfg.reward.on_failure != "raise":
        raise ValueError("reward.on_failure=exclude is only supported by the local engine: verl's reward loop has "
                         "no way to drop a sample, and a placeholder score would train on a made-up reward")
    out_dir = Path(t.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = Path(cfg.data.out_dir)
    o = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": t.norm_adv_by_std_in_grpo,
        "algorithm.use_kl_in_reward": False,
        "algorithm.filter_groups.enable": t.filter_groups,
        "data.train_files": str(data_dir / "train.parquet"),
        "data.val_files": str(data_dir / "val.parquet"),
        "data.prompt_key": "prompt",
        "data.train_batch_size": t.batch_size,
        "data.max_prompt_length": t.max_prompt_tokens,
        "data.max_response_length": t.max_response_tokens,
        "data.filter_overlong_prompts": True,
        "data.seed": cfg.seed,
        "actor_rollout_ref.model.path": str(Path(cfg.model.hf_dir)),
        # registers CosyVoiceLMForCausalLM with transformers in every worker (grpo/model/cosyvoice_lm.py)
        "actor_rollout_ref.model.external_lib": "grpo.model",
        # verl's fused kernels compute logits from lm_head.weight alone: they would drop the head's bias and mask
        "actor_rollout_ref.model.use_fused_kernels": False,
        "actor_rollout_ref.actor.optim.lr": t.lr,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": t.warmup_steps,
        "actor_rollout_ref.actor.optim.weight_decay": t.weight_decay,
        "actor_rollout_ref.actor.grad_clip": t.grad_clip,
        "actor_rollout_ref.actor.ppo_mini_batch_size": t.mini_batch_size or t.batch_size,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": v.ppo_micro_batch_size_per_gpu,
        "actor_rollout_ref.actor.ppo_epochs": t.ppo_epochs,
        "actor_rollout_ref.actor.clip_ratio_low": t.clip_ratio_low,
        "actor_rollout_ref.actor.clip_ratio_high": t.clip_ratio_high,
        "actor_rollout_ref.actor.clip_ratio_c": t.clip_ratio_c,
        "actor_rollout_ref.actor.loss_agg_mode": t.loss_agg_mode,
        "actor_rollout_ref.actor.entropy_coeff": t.entropy_coeff,
        "actor_rollout_ref.actor.use_kl_loss": t.use_kl_loss,
        "actor_rollout_ref.actor.kl_loss_coef": t.kl_loss_coef,
        "actor_rollout_ref.actor.kl_loss_type": t.kl_loss_type,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": v.log_prob_micro_batch_size_per_gpu,
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": t.n,
        "actor_rollout_ref.rollout.temperature": t.temperature,
        "actor_rollout_ref.rollout.top_p": t.top_p,
        "actor_rollout_ref.rollout.top_k": t.top_k,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": v.tensor_model_parallel_size,
        "actor_rollout_ref.rollout.gpu_memory_utilization": v.rollout_gpu_memory_utilization,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": v.log_prob_micro_batch_size_per_gpu,
        "actor_rollout_ref.rollout.agent.default_agent_loop": AGENT_NAME,
        "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(AGENT_LOOP_CONFIG),
        "reward.custom_reward_function.path": str(REPO_ROOT / "grpo" / "train" / "reward_fn.py"),
        "reward.custom_reward_function.name": "compute_score",
        "trainer.total_training_steps": t.total_steps,
        "trainer.save_freq": t.save_freq,
        "trainer.test_freq": t.test_freq,
        "trainer.resume_mode": "auto" if t.resume else "disable",
        "trainer.logger": list(t.logger),
        "trainer.project_name": t.project_name,
        "trainer.experiment_name": t.experiment_name,
        "trainer.default_local_dir": str(out_dir / "verl_checkpoints"),
        "trainer.nnodes": v.nnodes,
        "trainer.n_gpus_per_node": v.n_gpus_per_node,
    }
    overrides = [f"{k}={_value(val)}" for k, val in o.items()]
    # reward_kwargs is not in verl's schema: add it with '+'
    overrides += [f"+reward.custom_reward_function.reward_kwargs.{k}={_value(val)}"
                  for k, val in reward_kwargs(cfg).items()]
    return overrides + list(v.extra_overrides)


def command(cfg: DictConfig) -> list[str]:
    return [sys.executable, "-m", "verl.trainer.main_ppo", *build_overrides(cfg)]


def compose_check(cmd: list[str]) -> subprocess.CompletedProcess:
    """Let verl's own Hydra config validate every key (`--cfg job` prints the job config and exits)."""
    return subprocess.run([*cmd, "--cfg", "job"], cwd=REPO_ROOT, capture_output=True, text=True)


def run(cfg: DictConfig) -> int:
    import torch

    cmd = command(cfg)
    log.info("verl command:\n  %s", " \\\n    ".join(shlex.quote(c) for c in cmd))
    if cfg.train.verl.get("dry_run", False):
        proc = compose_check(cmd)
        if proc.returncode != 0:
            log.error("verl rejected the overrides:\n%s", proc.stderr[-4000:])
            return proc.returncode
        print(proc.stdout)
        return 0
    if not torch.cuda.is_available():
        log.error("train.engine=verl needs CUDA GPUs (verl's rollout runs vLLM servers). On this machine use "
                  "train.engine=local, or train.verl.dry_run=true to check the command.")
        return 2
    return subprocess.run(cmd, cwd=REPO_ROOT).returncode
