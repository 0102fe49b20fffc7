"""GRPO wiring on hand-made batches: advantages, the PPO clip, the sign of an update, log-probs of the exact head,
rollouts."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.model.speech_vocab import SpeechVocab
from grpo.speech.components import gdpo_components
from grpo.train.grpo_step import (
    actor_config,
    build_batch,
    filter_groups,
    group_normalized_advantages,
    grpo_advantages,
    log_probs,
    policy_loss,
    response_logits,
)
from grpo.train.rollout import SamplingConfig, TransformersRollout


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
    # the sample's advantage on every response token, 0 on padding
    torch.testing.assert_close(adv, expected[:, None] * batch.response_mask, rtol=1e-4, atol=1e-5)
    # Dr. GRPO (no std normalisation): score minus the group mean
    torch.testing.assert_close(grpo_advantages(batch, norm_by_std=False)[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    kept, dropped = filter_groups(batch)
    assert dropped == 1 and kept.group_index.tolist() == [0, 0]


def test_group_normalised_components_by_hand():
    """reward.combine=group_normalized (GDPO): group 0 (3 samples) has a varying cer and a constant sim, group 1
    (2 samples) both varying; weights cer 1, sim 0.5, one response token each. By hand: z-scores per component and
    group with the unbiased std, group 0: cer [1, 0, -1], sim [0, 0, 0] (constant: contributes nothing); group 1:
    cer [.7071, -.7071], sim [-.7071, .7071] -> sums [1, 0, -1, .3536, -.3536]; whitened over the batch (mean 0,
    unbiased variance 2.25 / 4, std 0.75): [4/3, 0, -4/3, .4714, -.4714]."""
    from omegaconf import OmegaConf

    reward = OmegaConf.create({"weights": {"cer": 1.0, "sim": 0.5, "duration": 0.0}, "combine": "group_normalized"})
    keys, weights = gdpo_components(reward)
    assert (keys, weights) == (["reward_cer", "reward_sim"], [1.0, 0.5])          # weight 0: not a component
    assert gdpo_components(OmegaConf.merge(reward, {"combine": "weighted_mean"})) is None
    with pytest.raises(ValueError, match="reward.combine"):
        gdpo_components(OmegaConf.merge(reward, {"combine": "sum"}))

    def batch(sim):
        b = build_batch([[5, 6]] * 5, [[100]] * 5, [0.0] * 5, [0, 0, 0, 1, 1], pad_token_id=0)
        b.components = {"reward_cer": np.array([1.0, 0.5, 0.0, 1.0, 0.0]), "reward_sim": np.array(sim)}
        return b

    adv = group_normalized_advantages(batch([0.7, 0.7, 0.7, 0.0, 1.0]), keys, weights, norm_by_std=True)
    h = 0.35355339 / 0.75
    torch.testing.assert_close(adv[:, 0], torch.tensor([4 / 3, 0.0, -4 / 3, h, -h]), rtol=1e-4, atol=1e-4)
    # the constant component contributes nothing, whatever its value
    torch.testing.assert_close(group_normalized_advantages(batch([0.1, 0.1, 0.1, 0.0, 1.0]), keys, weights, True), adv)
    with pytest.raises(ValueError, match="reward_sim"):
        b = batch([0.7, 0.7, 0.7, 0.0, 1.0])
        b.components["reward_sim"][0] = np.nan          # the backend gave no sim: refused, never a silent NaN
        group_normalized_advantages(b, keys, weights, True)
    # the rows follow a selection (filter_groups keeps the components aligned)
    assert batch([0.7] * 3 + [0.0, 1.0]).select([3, 4]).components["reward_sim"].tolist() == [0.0, 1.0]


def test_clipped_policy_loss_matches_the_ppo_formula_by_hand():
    """verl's clipped objective through policy_loss with an off-policy batch (old != current log-probs):
    per token max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), token-mean over the mask; ppo_kl = mean(old - new)."""
    from omegaconf import OmegaConf

    class Fixed(torch.nn.Module):     # a "model" whose logits are a parameter: log-probs known in closed form
        def __init__(self, logits):
            super().__init__()
            self.logits = torch.nn.Parameter(logits)

        def forward(self, input_ids, **_):
            return type("Out", (), {"logits": self.logits.expand(input_ids.shape[0], -1, -1)})()

    batch = build_batch([[1, 2]] * 2, [[3, 4], [3]], [1.0, 0.0], [0, 0], pad_token_id=0)
    logits = torch.zeros(1, 4, 6)
    logits[0, 1, 3], logits[0, 2, 4] = 1.0, -0.5        # positions 1, 2 predict response tokens 0, 1
    model = Fixed(logits)
    new = torch.log_softmax(logits[0, 1:3], -1)[[0, 1], [3, 4]]          # same for both rows
    old = torch.stack([new + torch.tensor([-0.4, -0.05]), new + torch.tensor([0.3, 0.0])]).detach()
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    cfg = actor_config(OmegaConf.create({"n": 2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                                         "loss_agg_mode": "token-mean", "entropy_coeff": 0.0, "use_kl_loss": False,
                                         "kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl"}))
    loss, metrics = policy_loss(model, batch, adv, old, None, cfg)
    ratio = (new - old).exp().numpy()
    a = adv.numpy()
    per_token = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.28))
    mask = batch.response_mask.numpy().astype(bool)
    assert loss.item() == pytest.approx(per_token[mask].mean(), rel=1e-5)
    assert metrics["ppo_kl"] == pytest.approx((old.numpy() - new.detach().numpy()[None])[mask].mean(), rel=1e-5)
    # token 0 of row 0 (ratio e^0.4 > 1.28, A > 0) is clipped; so is row 1's (e^-0.3 < 0.8, A < 0)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 3, rel=1e-5)


@pytest.fixture(scope="module")
def tiny_policy(tiny_cfg):
    cfg = tiny_cfg()
    return (AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(cfg.model.hf_dir), SpeechVocab.load(cfg.model.hf_dir), cfg)


def test_one_update_moves_probability_towards_the_better_sample(tiny_policy):
    model, tok, vocab, cfg = tiny_policy
    model = AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32)   # a fresh copy
    fresh = AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32)   # stays as before the update
    prompt = tok.apply_chat_template([{"role": "user", "content": "今天天气很好"}], tokenize=True, return_dict=False)
    good, bad = vocab.to_hf_ids([10, 20, 30]) + [vocab.stop_token_ids[0]], vocab.to_hf_ids([40, 50])
    batch = build_batch([prompt, prompt], [good, bad], [1.0, 0.0], [0, 0], tok.pad_token_id)
    allowed = vocab.allowed_mask()

    def seq_logp():
        with torch.no_grad():
            return (log_probs(model, batch)[0] * batch.response_mask).sum(-1)

    before = seq_logp()
    adv = grpo_advantages(batch, norm_by_std=True)
    train_cfg = cfg.train.copy()
    train_cfg.n = 2
    loss, metrics = policy_loss(model, batch, adv, None, None, actor_config(train_cfg), allowed)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    loss.backward()
    optim.step()
    after = seq_logp()
    assert after[0] > before[0] and after[1] < before[1]
    # non_speech_mass: the full-vocabulary probability of never-sampled ids, recomputed from the logits
    with torch.no_grad():
        probs = response_logits(fresh, batch).softmax(-1)
    leak = probs[..., ~allowed].sum(-1)
    assert metrics["non_speech_mass"] == pytest.approx((leak * batch.response_mask).sum().item()
                                                       / batch.response_mask.sum().item(), rel=1e-4, abs=1e-12)
    assert metrics["non_speech_mass"] == 0.0             # the masked head: nothing outside speech and stop ids


def test_full_vocabulary_log_probs_are_the_sampling_policy(tiny_policy):
    """With the masked speech head, verl's full-vocabulary log-probs equal a log-softmax over the speech and
    stop ids alone (what rollouts sample from), and nothing leaks to other ids."""
    model, tok, vocab, _ = tiny_policy
    allowed = vocab.allowed_mask()
    prompt = tok.apply_chat_template([{"role": "user", "content": "你好"}], tokenize=True, return_dict=False)
    batch = build_batch([prompt], [vocab.to_hf_ids([1, 2]) + [vocab.stop_token_ids[0]]], [0.0], [0],
                        tok.pad_token_id)
    with torch.no_grad():
        full, entropy, leak = log_probs(model, batch, with_entropy=True, allowed=allowed)
        raw = response_logits(model, batch)
    allowed_ids = allowed.nonzero().squeeze(-1)
    by_hand = torch.log_softmax(raw[..., allowed_ids], -1)
    position = {int(t): k for k, t in enumerate(allowed_ids)}
    expected = torch.stack([by_hand[0, j, position[int(t)]] for j, t in enumerate(batch.responses[0])])[None]
    torch.testing.assert_close(full, expected, rtol=0, atol=1e-5)
    assert torch.all(leak == 0)
    assert torch.all(entropy >= 0) and torch.isfinite(entropy).all()
    # the leak check itself sees an unmasked head: the mass outside, summed by hand from the softmax
    unmasked = AutoModelForCausalLM.from_pretrained(tok.name_or_path, dtype=torch.float32)
    with torch.no_grad():
        unmasked.lm_head.bias[~allowed] = 0.0
        _, _, leak = log_probs(unmasked, batch, with_entropy=True, allowed=allowed)
        by_hand = response_logits(unmasked, batch).softmax(-1)[..., ~allowed].sum(-1)
    assert torch.all(leak > 1e-3)
    torch.testing.assert_close(leak, by_hand, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("backend", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
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
    engine.close()
