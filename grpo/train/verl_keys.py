"""main_ppo's keys as data: the ones that copy a key of ours, and the ones this project always sets the same way
(grpo/train/verl_launcher.py adds the computed ones, the platform's and the optional ones)."""

from __future__ import annotations

from pathlib import Path

from grpo.config import REPO_ROOT

# this project's agent loop (grpo/train/verl_agent_loop.py) as verl's registry names it, and the registry file
AGENT_NAME = "speech_token_agent"
AGENT_LOOP_CONFIG = Path(__file__).with_name("verl_agent_loop.yaml")

# main_ppo's keys that take one of ours as it is: verl key <- config key
VERL_FROM_CONFIG = {
    "algorithm.norm_adv_by_std_in_grpo": "train.norm_adv_by_std_in_grpo",
    "algorithm.filter_groups.enable": "train.filter_groups",
    "data.train_batch_size": "train.batch_size",
    "data.max_prompt_length": "train.max_prompt_tokens",
    "data.max_response_length": "train.max_response_tokens",
    "data.seed": "seed",
    "actor_rollout_ref.actor.optim.lr": "train.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "train.warmup_steps",
    "actor_rollout_ref.actor.optim.weight_decay": "train.weight_decay",
    "actor_rollout_ref.actor.optim.clip_grad": "train.grad_clip",      # what verl's FSDP engine clips with
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "train.verl.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_epochs": "train.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio_low": "train.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "train.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "train.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode": "train.loss_agg_mode",
    "actor_rollout_ref.actor.entropy_coeff": "train.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss": "train.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "train.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "train.kl_loss_type",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "train.verl.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.n": "train.n",
    "actor_rollout_ref.rollout.temperature": "train.temperature",
    "actor_rollout_ref.rollout.top_p": "train.top_p",
    "actor_rollout_ref.rollout.top_k": "train.top_k",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "train.verl.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "train.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.dtype": "train.rollout.dtype",
    # on both platforms (the CPU one forces it, CPU_OVERRIDES)
    "actor_rollout_ref.rollout.enforce_eager": "train.rollout.enforce_eager",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "train.verl.log_prob_micro_batch_size_per_gpu",
    "trainer.total_training_steps": "train.total_steps",
    "trainer.save_freq": "train.save_freq",
    "trainer.test_freq": "train.test_freq",
    "trainer.project_name": "train.project_name",
    "trainer.experiment_name": "train.experiment_name",
    "trainer.nnodes": "train.verl.nnodes",
}

# main_ppo's keys that this project always sets the same way, and why
VERL_FIXED = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "data.prompt_key": "prompt",
    "data.filter_overlong_prompts": True,
    # registers CosyVoiceLMForCausalLM with transformers in every worker (grpo/model/cosyvoice_lm.py)
    "actor_rollout_ref.model.external_lib": "grpo.model",
    # verl's fused kernels compute logits from lm_head.weight alone: they would drop the head's bias and mask
    "actor_rollout_ref.model.use_fused_kernels": False,
    # sdpa attention (no flash-attn needed), so no padding removal, as the reference recipe runs
    "actor_rollout_ref.model.use_remove_padding": False,
    # FSDP2 (per-parameter sharding; on CPU too, where FSDP1's sync_module_states needs a GPU)
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.ref.strategy": "fsdp2",
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.agent.default_agent_loop": AGENT_NAME,
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(AGENT_LOOP_CONFIG),
    "reward.custom_reward_function.path": str(REPO_ROOT / "grpo" / "train" / "reward_fn.py"),
    "reward.custom_reward_function.name": "compute_score",
}
