"""CosyVoice's repetition-aware sampling (RAS) as this package's vLLM logits processor: its per-step distribution
against the closed form computed by hand, and against CosyVoice's own `ras_sampling` / `Qwen2LM.sampling_ids`
drawn many times."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo.decoding import RAS_KEY, RASConfig, length_bounds, ras_probs, sampling_kwargs

V = 40            # a small vocabulary; the last three ids play CosyVoice2's end-of-speech rows
EOS = (V - 3, V - 2, V - 1)


def processor_probs(logits, history, min_tokens=0, stop_ids=EOS, cfg=RASConfig()):
    """What vLLM samples from after this package's processor: softmax of the row it returns."""
    from vllm import SamplingParams

    from grpo.model.ras_logits import CosyVoiceRAS

    params = SamplingParams(**sampling_kwargs("cosyvoice_ras", min_tokens, 100, ras=cfg), stop_token_ids=list(stop_ids))
    CosyVoiceRAS.validate_params(params)
    proc = object.__new__(CosyVoiceRAS)          # the per-request function needs no engine
    row = proc.new_req_logits_processor(params)(list(history), logits.clone())
    return row.softmax(-1).double().numpy()


def closed_form_by_hand(logits, history, cfg=RASConfig()):
    """P(x) = q(x)[x not in R] + q(R) p(x), written with numpy loops from CosyVoice's rules."""
    p = np.exp(logits.double().numpy() - logits.double().numpy().max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: -p[i])           # ties: lower id first (stable sort)
    nucleus, mass = [], 0.0
    for i in order:
        if mass < cfg.top_p and len(nucleus) < cfg.top_k:
            nucleus.append(i)
            mass += p[i]
    q = np.zeros_like(p)
    q[nucleus] = p[nucleus] / p[nucleus].sum()
    window = history[-cfg.win_size:]
    repeated = [x for x in range(len(p)) if window.count(x) >= cfg.win_size * cfg.tau_r]
    out = q.copy()
    out[repeated] = 0.0
    return out + q[repeated].sum() * p


def peaked_logits(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 2.5


HISTORIES = {
    "empty": [],
    "no repeat": [30, 31],
    "top token once": None,          # filled per case: the most likely token once in the window
    "two repeats, one outside the window": None,
}


def history_for(name, logits):
    top = int(logits.argmax())
    second = int(logits.topk(2).indices[1])
    if name == "top token once":
        return [5, top, 7]
    if name == "two repeats, one outside the window":
        return [second] + [20 + i % 5 for i in range(9)] + [top]     # `second` is 11 tokens back: outside
    return HISTORIES[name]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(HISTORIES))
def test_processor_is_the_closed_form(seed, name):
    logits = peaked_logits(seed)
    history = history_for(name, logits)
    np.testing.assert_allclose(processor_probs(logits, history), closed_form_by_hand(logits, history), atol=1e-6)


def test_nucleus_keeps_the_token_that_crosses_top_p():
    """p = (0.5, 0.25, 0.15, 0.1): mass before each is 0, 0.5, 0.75, 0.9 -> the nucleus is the first three
    (vLLM's top-p would keep two), q = (0.5, 0.25, 0.15) / 0.9; top_k 2 cuts it to two."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    got = processor_probs(logits, [], stop_ids=())
    np.testing.assert_allclose(got, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0], atol=1e-6)
    got = processor_probs(logits, [], stop_ids=(), cfg=RASConfig(top_k=2))
    np.testing.assert_allclose(got, [2 / 3, 1 / 3, 0.0, 0.0], atol=1e-6)
    # token 0 once in the window (1 >= 10 * 0.1): drawing it means a redraw from p -> 0.5/0.9*p added
    got = processor_probs(logits, [0], stop_ids=())
    q0 = 0.5 / 0.9
    np.testing.assert_allclose(got, [q0 * 0.5, 0.25 / 0.9 + q0 * 0.25, 0.15 / 0.9 + q0 * 0.15, q0 * 0.1], atol=1e-6)


def draws(fn, n):
    torch.manual_seed(1234)
    counts = np.zeros(V)
    for _ in range(n):
        counts[int(fn())] += 1
    return counts / n


N_DRAWS = 30000
# total variation of an empirical distribution over <= 40 outcomes from 30,000 draws: its mean is below
# sqrt(40 / (2 pi 30000)) / 1 ~ 0.015 (sum of the |error| expectations, halved); 0.03 leaves room for noise
TV_BOUND = 0.03


@pytest.mark.parametrize("name", ["empty", "top token once", "two repeats, one outside the window"])
def test_processor_matches_cosyvoices_ras_sampling_drawn(name):
    from cosyvoice.utils.common import ras_sampling

    logits = peaked_logits(3)
    history = history_for(name, logits)
    weighted_scores = logits.log_softmax(-1)                       # what Qwen2LM hands its sampler
    empirical = draws(lambda: ras_sampling(weighted_scores, history, 25), N_DRAWS)
    tv = 0.5 * np.abs(empirical - processor_probs(logits, history, stop_ids=())).sum()
    assert tv < TV_BOUND, tv


def test_before_min_len_no_stop_is_drawn_as_cosyvoice_redraws():
    """Qwen2LM.sampling_ids with ignore_eos redraws while it draws speech_token_size (its first stop id)."""
    from cosyvoice.llm.llm import Qwen2LM
    from cosyvoice.utils.common import ras_sampling

    logits = peaked_logits(4)
    logits[EOS[0]] = logits.max() + 1.0                            # the stop is the most likely token
    history = history_for("top token once", logits)
    lm = SimpleNamespace(sampling=ras_sampling, speech_token_size=EOS[0])
    empirical = draws(lambda: Qwen2LM.sampling_ids(lm, logits.log_softmax(-1), history, 25, ignore_eos=True),
                      N_DRAWS)
    assert empirical[EOS[0]] == 0
    ours = processor_probs(logits, history, min_tokens=len(history) + 1, stop_ids=EOS[:1])
    assert ours[EOS[0]] == 0
    assert 0.5 * np.abs(empirical - ours).sum() < TV_BOUND
    # this package forbids all three stop ids before min_len (as vLLM's min_tokens does); at min_len they return
    ours = processor_probs(logits, history, min_tokens=len(history) + 1)
    assert all(ours[e] == 0 for e in EOS)
    assert processor_probs(logits, history, min_tokens=len(history))[EOS[0]] > 0.1


def test_presets_and_length_bounds():
    assert length_bounds(7, 2, 20) == (14, 140) and length_bounds(3, 0.5, 1.5) == (1, 4)
    assert length_bounds(0, 2, 20) == (0, 1)
    ras = sampling_kwargs("cosyvoice_ras", 14, 140)
    assert (ras["temperature"], ras["top_p"], ras["top_k"], ras["min_tokens"], ras["max_tokens"]) == (1, 1, -1, 0, 140)
    assert ras["extra_args"][RAS_KEY] == {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1, "min_tokens": 14}
    vl = sampling_kwargs("cosyvoice_vllm", 14, 140)        # CosyVoice2's inference_wrapper: SamplingParams(top_k=25)
    assert (vl["top_k"], vl["temperature"], vl["min_tokens"], vl["max_tokens"]) == (25, 1, 14, 140)
    with pytest.raises(ValueError, match="decoding must be one of"):
        sampling_kwargs("greedy", 1, 2)


def test_requests_that_would_bypass_the_processor_are_refused():
    from vllm import SamplingParams

    from grpo.model.ras_logits import CosyVoiceRAS

    for bad in ({"top_k": 25}, {"top_p": 0.8}, {"min_tokens": 3}, {"temperature": 0.7}):
        kwargs = {**sampling_kwargs("cosyvoice_ras", 3, 10), **bad}
        with pytest.raises(ValueError, match="CosyVoice RAS requests need"):
            CosyVoiceRAS.validate_params(SamplingParams(**kwargs))
    with pytest.raises(ValueError, match="needs exactly"):
        CosyVoiceRAS.validate_params(SamplingParams(extra_args={RAS_KEY: {"top_p": 0.8}}))
    with pytest.raises(ValueError, match="speculative"):
        CosyVoiceRAS(SimpleNamespace(speculative_config=object()), torch.device("cpu"), False)
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        CosyVoiceRAS(SimpleNamespace(speculative_config=None, use_v2_model_runner=True), torch.device("cpu"), False)


@pytest.mark.vllm
def test_vllm_samples_from_the_ras_distribution(tiny_cfg):
    """The evaluation's engine (VLLMRollout) with the processor loaded: the log-probability vLLM samples each token
    with (processed_logprobs) is log P_ras of transformers' logits for that prefix and that history; before min_len
    no stop id appears; a request without the extra_args is left alone (plain top-k 25)."""
    from transformers import AutoModelForCausalLM

    from grpo.model.speech_vocab import SpeechVocab
    from grpo.train.rollout import VLLMRollout

    cfg = tiny_cfg()
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    rollout = VLLMRollout(cfg.model.hf_dir, vocab, max_model_len=256, logprobs_mode="processed_logprobs")
    model = AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32).eval()
    prompt = [vocab.sos_token_id, 5, 9, 14, 3, vocab.task_id_token_id]
    min_len = 30
    params = [rollout.speech_params(seed=s, logprobs=0, **sampling_kwargs("cosyvoice_ras", min_len, 60))
              for s in range(3)]
    params.append(rollout.speech_params(seed=7, logprobs=0, **sampling_kwargs("cosyvoice_vllm", 0, 60)))
    outs = rollout.llm.generate([{"prompt_token_ids": prompt}] * 4, params, use_tqdm=False)
    stops, checked = set(vocab.stop_token_ids), 0
    for out in outs[:3]:
        ids, logprobs = list(out.outputs[0].token_ids), out.outputs[0].logprobs
        assert len(ids) >= min_len and not stops & set(ids[:min_len])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:]
        for t, tok in enumerate(ids):
            want = ras_probs(logits[t], ids[:t], RASConfig(), vocab.stop_token_ids, forbid_stop=t < min_len)[tok]
            assert logprobs[t][tok].logprob == pytest.approx(float(want.log()), abs=2e-3), (t, tok)
            checked += 1
    assert checked >= 90
    # plain top-k 25 (CosyVoice's vLLM path): processed log-probs are vLLM's top-k renormalisation, not RAS's
    ids, logprobs = list(outs[3].outputs[0].token_ids), outs[3].outputs[0].logprobs
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:]
    top = logits[0].topk(25)
    want = (logits[0][ids[0]] - top.values.logsumexp(0)) if ids[0] in top.indices else None
    assert want is not None and logprobs[0][ids[0]].logprob == pytest.approx(float(want), abs=2e-3)
