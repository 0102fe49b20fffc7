"""GRPO wiring on hand-made batches: advantages, the sign of an update, restricted log-probs, rollouts."""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM
from verl.trainer.ppo import core_algos

from grpo.train.grpo_step import actor_config, build_batch, filter_groups, grpo_advantages, log_probs, policy_loss
from grpo.train.rollout import SamplingConfig, TransformersRollout
from grpo.model.speech_vocab import SpeechVocab


def test_batch_layout_and_advantages_match_verl():
    batch = build_batch(prompts=[[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]],
                        responses=[[100, 101, 3], [100], [102, 103], [104]],
                        scores=[1.0, 0.0, 0.5, 0.5], group_index=[0, 0, 1, 1], pad_token_id=0)
    assert batch.input_ids.tolist()[2] == [0, 8, 9, 102, 103, 0]         # left-padded prompt, right-padded response
    assert batch.response_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert batch.position_ids.tolist()[2] == [0, 0, 1, 2, 3, 3]
    adv = grpo_advantages(batch, norm_by_std=True)
    # by hand: group 0 has mean 0.5 and (unbiased) std 0.7071; group 1 has equal scores
    expected = torch.tensor([0.5 / 0.70710678, -0.5 / 0.70710678, 0.0, 0.0])
    torch.testing.assert_close(adv[:, 0], expected, rtol=1e-4, atol=1e-5)
    assert torch.all(adv[batch.response_mask == 0] == 0)
    token_rewards = torch.zeros(4, 3)
    token_rewards[[0, 1, 2, 3], [2, 0, 1, 0]] = torch.tensor([1.0, 0.0, 0.5, 0.5])
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, batch.response_mask,
                                                            np.array([0, 0, 1, 1]), norm_adv_by_std_in_grpo=True)
    torch.testing.assert_close(adv, verl_adv)
    kept, dropped = filter_groups(batch)
    assert dropped == 1 and kept.group_index.tolist() == [0, 0]


@pytest.fixture(scope="module")
def tiny_policy(tiny_cfg):
    cfg = tiny_cfg()
    return (Qwen2ForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(cfg.model.hf_dir), SpeechVocab.load(cfg.model.hf_dir), cfg)


@pytest.mark.parametrize("restrict", [True, False])
def test_one_update_moves_probability_towards_the_better_sample(tiny_policy, restrict):
    model, tok, vocab, cfg = tiny_policy
    model = Qwen2ForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32)   # a fresh copy
    prompt = tok.apply_chat_template([{"role": "user", "content": "今天天气很好"}], tokenize=True, return_dict=False)
    good, bad = vocab.to_hf_ids([10, 20, 30]) + [vocab.stop_token_ids[0]], vocab.to_hf_ids([40, 50])
    batch = build_batch([prompt, prompt], [good, bad], [1.0, 0.0], [0, 0], tok.pad_token_id)
    allowed = vocab.allowed_mask()

    def seq_logp():
        with torch.no_grad():
            return (log_probs(model, batch, allowed=allowed, restrict=restrict)[0] * batch.response_mask).sum(-1)

    before = seq_logp()
    adv = grpo_advantages(batch, norm_by_std=True)
    train_cfg = cfg.train.copy()
    train_cfg.n = 2
    loss, metrics = policy_loss(model, batch, adv, None, None, actor_config(train_cfg), allowed, restrict)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    loss.backward()
    optim.step()
    after = seq_logp()
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["ppo_kl"] == pytest.approx(0.0, abs=1e-6)    # on-policy first step: ratio exactly 1
    assert 0.0 <= metrics["non_speech_mass"] <= 1.0


def test_restricted_log_probs_sum_to_one_over_allowed_ids(tiny_policy):
    model, tok, vocab, _ = tiny_policy
    allowed = vocab.allowed_mask()
    prompt = tok.apply_chat_template([{"role": "user", "content": "你好"}], tokenize=True, return_dict=False)
    batch = build_batch([prompt], [vocab.to_hf_ids([1, 2])], [0.0], [0], tok.pad_token_id)
    from grpo.train.grpo_step import MASKED_LOGIT, response_logits

    with torch.no_grad():
        logits = response_logits(model, batch).masked_fill(~allowed, MASKED_LOGIT)
        probs = logits.softmax(-1)
        full, _, _ = log_probs(model, batch, allowed=allowed, restrict=False)
        restricted, entropy, leak = log_probs(model, batch, with_entropy=True, allowed=allowed, restrict=True)
    torch.testing.assert_close(probs[..., allowed].sum(-1), torch.ones(1, 2))
    # restricted = full - log P(allowed): never below the full-vocabulary log-prob
    torch.testing.assert_close(restricted, full - torch.log1p(-leak))
    assert torch.all(entropy >= 0) and torch.isfinite(entropy).all()


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_rollouts_are_speech_only_and_reproducible_per_seed(tiny_policy, backend):
    model, tok, vocab, cfg = tiny_policy
    if backend == "vllm":
        from grpo.train.rollout import VLLMRollout

        engine = VLLMRollout(cfg.model.hf_dir, vocab, max_model_len=256)
    else:
        engine = TransformersRollout(model, vocab, tok.pad_token_id)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, return_dict=False)
               for t in ("今天天气很好。", "请把窗户关上。")]
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=40)
    a = engine.generate(prompts, sampling, [11, 12])
    b = engine.generate(prompts, sampling, [11, 12])
    c = engine.generate(prompts, sampling, [13, 14])
    assert a == b and a != c
    allowed = set(vocab.allowed_token_ids())
    stops = set(vocab.stop_token_ids)
    for group in a:
        assert len(group) == 4
        for resp in group:
            assert resp and all(t in allowed for t in resp)
            assert all(t not in stops for t in resp[:-1])      # a stop id can only end a response
