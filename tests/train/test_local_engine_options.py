"""Local-engine options on hand-made rewards (no server): group filtering, PPO epochs and mini-batches, the KL
loss, and the transformers rollout backend. Rewards come from a stand-in for compute_score whose values are
set per prompt, so the expected counts follow from the set-up alone."""

import itertools

import numpy as np
import pytest
import torch

from grpo.train import local_engine
from grpo.train.grpo_step import build_batch, log_probs

SMALL = ["train.batch_size=2", "train.n=4", "train.max_response_tokens=8", "train.logger=[console]",
         "train.rollout.backend=transformers", "train.lr=1e-2", "train.warmup_steps=1"]


@pytest.fixture
def make_trainer(tiny_cfg, tmp_path, monkeypatch):
    def make(*overrides, rewards=None):
        """rewards(ground_truth, k) -> score of the k-th response scored for that text."""
        counters = {}

        async def fake_score(data_source, solution_str, ground_truth, extra_info=None, **_):
            k = next(counters.setdefault(ground_truth, itertools.count()))
            return {"score": rewards(ground_truth, k), "error_rate": 0.0, "transcript": "", "no_speech": 0,
                    "reward_failed": 0}

        monkeypatch.setattr(local_engine, "compute_score", fake_score)
        cfg = tiny_cfg(f"train.out_dir={tmp_path / 'train'}", *SMALL, *overrides)
        return local_engine.LocalGRPOTrainer(cfg)
    return make


def optimizer_steps(trainer) -> int:
    states = [s["step"] for s in trainer.optim.state.values()]
    return int(states[0]) if states else 0


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def test_filter_groups_drops_equal_reward_groups_with_transformers_rollouts(make_trainer):
    first_text = {}

    def rewards(text, k):   # the first prompt seen: every sample 1.0 (no signal); the other: 0, 1, 0, 1
        first_text.setdefault("t", text)
        return 1.0 if text == first_text["t"] else float(k % 2)

    trainer = make_trainer("train.filter_groups=true", rewards=rewards)
    assert isinstance(trainer.rollout, local_engine.TransformersRollout)
    before = params(trainer.model)
    metrics = trainer.train_step(1)
    assert metrics["groups_filtered"] == 1 and "update_skipped" not in metrics
    assert optimizer_steps(trainer) == 1 and not torch.equal(params(trainer.model), before)


def test_filter_groups_with_no_signal_left_skips_the_update(make_trainer):
    trainer = make_trainer("train.filter_groups=true", rewards=lambda text, k: 0.5)
    before = params(trainer.model)
    metrics = trainer.train_step(1)
    assert metrics["groups_filtered"] == 2 and metrics["update_skipped"] == 1
    assert optimizer_steps(trainer) == 0 and torch.equal(params(trainer.model), before)


def hand_batch(trainer, scores):
    """Two prompts x two responses of speech ids, in verl's layout."""
    tok, vocab = trainer.tokenizer, trainer.vocab
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, return_dict=False)
               for t in ("今天天气很好。", "请把窗户关上。")]
    responses = [vocab.to_hf_ids(r) for r in ([1, 2, 3], [4, 5], [6, 7, 8, 9], [10])]
    return build_batch([prompts[0], prompts[0], prompts[1], prompts[1]], responses, scores, [0, 0, 1, 1],
                       tok.pad_token_id)


@pytest.mark.parametrize("epochs,mini_batch,expected_steps", [(1, None, 1), (2, None, 2), (1, 1, 2), (3, 1, 6)])
def test_ppo_epochs_and_mini_batches_set_the_number_of_optimizer_steps(make_trainer, epochs, mini_batch,
                                                                       expected_steps):
    trainer = make_trainer(f"train.ppo_epochs={epochs}", f"train.mini_batch_size={mini_batch or 'null'}",
                           rewards=lambda text, k: 0.0)
    metrics = trainer._update(hand_batch(trainer, [1.0, 0.0, 0.0, 1.0]))
    assert optimizer_steps(trainer) == expected_steps
    if expected_steps == 1:
        assert metrics["ppo_kl"] == 0.0            # one on-policy step: the ratio is exactly 1
    else:
        # later mini-batches / epochs see a moved policy against the log-probs taken before the first step
        assert metrics["ppo_kl"] != 0.0


def kl_to_reference(trainer, batch) -> float:
    """Mean |log pi - log pi_ref| over the response tokens."""
    with torch.no_grad():
        logp, ref = log_probs(trainer.model, batch)[0], log_probs(trainer.ref, batch)[0]
    mask = batch.response_mask
    return float(((logp - ref).abs() * mask).sum() / mask.sum())


@pytest.mark.parametrize("use_kl_loss", [True, False])
def test_kl_loss_pulls_the_policy_back_to_the_reference(make_trainer, use_kl_loss):
    trainer = make_trainer(f"train.use_kl_loss={str(use_kl_loss).lower()}", "train.kl_loss_coef=1.0", "train.lr=1e-4",
                           "train.kl_loss_type=low_var_kl", rewards=lambda text, k: 0.0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():                          # move the policy away from the reference
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    batch = hand_batch(trainer, [0.5, 0.5, 0.5, 0.5])   # equal rewards: zero advantages, no policy gradient
    before_kl, before = kl_to_reference(trainer, batch), params(trainer.model)
    metrics = trainer._update(batch)
    assert metrics["kl"] > 0
    if use_kl_loss:
        assert kl_to_reference(trainer, batch) < 0.9 * before_kl
    else:                                          # the KL is only logged: nothing moves
        assert torch.equal(params(trainer.model), before)
        np.testing.assert_allclose(kl_to_reference(trainer, batch), before_kl, rtol=1e-6)
