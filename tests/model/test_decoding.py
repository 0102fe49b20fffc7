"""CosyVoice's repetition-aware sampling (RAS) as this package's vLLM logits processor: its per-step distribution
against today's rule computed by hand, and against upstream CosyVoice's own `Qwen2LM.sampling_ids` + `ras_sampling`
(the pinned commit, grpo/upstream/pin.py) drawn many times."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ras_batch import one_row, processor, update

from grpo.decoding import RAS_KEY, RASConfig, length_bounds, ras_probs, sampling_kwargs

V = 40            # a small vocabulary; the last three ids play CosyVoice2's rows S, S+1, S+2 (S = speech_token_size)
EOS = (V - 3, V - 2, V - 1)
S = EOS[0]        # the row upstream masks before min_len
DEFAULT_RAS = RASConfig()   # the released yaml's ras_sampling settings


def processor_probs(logits, history, min_tokens=0, masked_id=S, cfg=DEFAULT_RAS):
    """What vLLM samples from after this package's processor: softmax of the row it returns."""
    from vllm import SamplingParams

    from grpo.model.ras_logits import CosyVoiceRAS

    params = SamplingParams(**sampling_kwargs("cosyvoice_ras", min_tokens, 100, ras=cfg, min_len_masked_id=masked_id),
                            stop_token_ids=list(EOS))
    CosyVoiceRAS.validate_params(params)
    return one_row(params, history, logits)


def rule_by_hand(logits, history, cfg=DEFAULT_RAS, masked=None):
    """Today's upstream rule written with numpy loops: P(y) = q(y)[y not in R] + sum over x in N and R of
    q(x) p(y)[y != x] / (1 - p(x)); `masked`: the id whose score is -inf first (before min_len)."""
    z = logits.double().numpy().copy()
    if masked is not None:
        z[masked] = -np.inf
    p = np.exp(z - z.max())
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
    out = np.zeros_like(p)
    for x in nucleus:
        if window.count(x) >= cfg.win_size * cfg.tau_r:          # drawn, repeated: drawn again without x
            rest = p.copy()
            rest[x] = 0.0
            out += q[x] * rest / rest.sum()
        else:
            out[x] += q[x]
    return out


def old_rule_by_hand(logits, history, cfg=DEFAULT_RAS):
    """The rule before upstream's fix f2ddcbe (token2wav-cosyvoice 0.1.0): the redraw could return x."""
    p = np.exp(logits.double().numpy() - logits.double().numpy().max())
    p /= p.sum()
    new = rule_by_hand(logits, [], cfg)                           # q itself: nothing repeats
    window = history[-cfg.win_size:]
    repeated = [x for x in range(len(p)) if window.count(x) >= cfg.win_size * cfg.tau_r and new[x] > 0]
    out = new.copy()
    out[repeated] = 0.0
    return out + new[repeated].sum() * p


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
@pytest.mark.parametrize("before_min_len", [False, True])
def test_processor_is_todays_rule(seed, name, before_min_len):
    logits = peaked_logits(seed)
    logits[S] = logits.max() + 0.5 if before_min_len else logits[S]    # the masked row would lead the nucleus
    history = history_for(name, logits)
    min_tokens = len(history) + 1 if before_min_len else len(history)
    np.testing.assert_allclose(processor_probs(logits, history, min_tokens),
                               rule_by_hand(logits, history, masked=S if before_min_len else None), atol=1e-6)


def test_todays_rule_by_hand_on_four_tokens():
    """p = (0.5, 0.25, 0.15, 0.1): mass before each is 0, 0.5, 0.75, 0.9 -> the nucleus is the first three
    (vLLM's top-p would keep two), q = (0.5, 0.25, 0.15) / 0.9; top_k 2 cuts it to two."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    got = processor_probs(logits, [], masked_id=3)
    np.testing.assert_allclose(got, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0], atol=1e-6)
    got = processor_probs(logits, [], masked_id=3, cfg=RASConfig(top_k=2))
    np.testing.assert_allclose(got, [2 / 3, 1 / 3, 0.0, 0.0], atol=1e-6)
    # token 0 once in the window (1 >= 10 * 0.1): drawing it (q0 = 0.5/0.9) means a draw from p without it,
    # (0, 0.25, 0.15, 0.1) / 0.5 -> token 0 can no longer come out (the old rule gave it q0 * 0.5 = 0.28)
    q0 = 0.5 / 0.9
    want = [0.0, 0.25 / 0.9 + q0 * 0.5, 0.15 / 0.9 + q0 * 0.3, q0 * 0.2]
    np.testing.assert_allclose(processor_probs(logits, [0], masked_id=3), want, atol=1e-6)
    assert sum(want) == pytest.approx(1.0)
    # before min_len, id 0 masked first: p = (0.5, 0.3, 0.2) on ids 1..3 -> nucleus {1, 2} (mass before 2: 0.5),
    # q = (0.5, 0.3) / 0.8; nothing repeats
    np.testing.assert_allclose(processor_probs(logits, [], min_tokens=1, masked_id=0),
                               [0.0, 0.5 / 0.8, 0.3 / 0.8, 0.0], atol=1e-6)


def draws(fn, n):
    torch.manual_seed(1234)
    counts = np.zeros(V)
    for _ in range(n):
        counts[int(fn())] += 1
    return counts / n


N_DRAWS = 15000
# total variation of an empirical distribution over <= 40 outcomes from 15,000 draws: its mean is below
# sqrt(40 / (2 pi 15000)) ~ 0.021 (sum of the |error| expectations, halved); 0.03 leaves room for noise (the draws
# are seeded: 0.006-0.016 for the six cases below, 0.004-0.012 at 30,000 draws, for twice the time)
TV_BOUND = 0.03


def upstream_step(logits, history, before_min_len):
    """One draw of upstream's Qwen2LM.sampling_ids with the released yaml's ras_sampling (fresh scores each call:
    upstream writes -inf into them)."""
    from cosyvoice.llm.llm import Qwen2LM
    from cosyvoice.utils.common import ras_sampling

    lm = SimpleNamespace(sampling=ras_sampling, speech_token_size=S)
    return Qwen2LM.sampling_ids(lm, logits.log_softmax(-1), history, 25, ignore_eos=before_min_len)


@pytest.mark.parametrize("name", ["empty", "top token once", "two repeats, one outside the window"])
@pytest.mark.parametrize("before_min_len", [False, True])
def test_processor_matches_upstreams_sampler_drawn(name, before_min_len):
    logits = peaked_logits(3)
    logits[S] = logits.max() + 0.5          # the eos row leads: masked before min_len, most likely after
    history = history_for(name, logits)
    empirical = draws(lambda: upstream_step(logits, history, before_min_len), N_DRAWS)
    ours = processor_probs(logits, history, min_tokens=len(history) + before_min_len)
    assert 0.5 * np.abs(empirical - ours).sum() < TV_BOUND
    if before_min_len:
        assert empirical[S] == 0 and ours[S] == 0


def test_a_repeated_leading_token_is_never_redrawn():
    """The case upstream's fix changed most: a repeated top token with most of the mass. Upstream's draws never
    return it; the old rule kept most of its probability, far outside the sampling noise."""
    logits = torch.full((V,), -4.0)
    logits[7], logits[8], logits[9] = 4.0, 3.0, 2.5
    history = [7]
    empirical = draws(lambda: upstream_step(logits, history, False), N_DRAWS)
    ours = processor_probs(logits, history)
    assert empirical[7] == 0 and ours[7] == 0
    assert 0.5 * np.abs(empirical - ours).sum() < TV_BOUND
    # the 0.1.0 rule: p7 = e^4 / (e^4 + e^3 + e^2.5 + 37 e^-4) = 0.623, nucleus {7, 8} (mass before 9: 0.853),
    # q7 = 0.623 / 0.853 = 0.730, so token 7 kept q7 * p7 = 0.455
    assert old_rule_by_hand(logits, history)[7] == pytest.approx(0.455, abs=0.002)


def test_before_min_len_only_row_s_is_held_back():
    """Upstream masks row speech_token_size only: CosyVoice2's other stop rows (S+1, S+2) stay drawable, and
    a draw of one ends the utterance early, as upstream's loop does."""
    logits = peaked_logits(4)
    logits[EOS[1]] = logits.max() + 1.0                            # S+1 is the most likely token, S the next
    logits[S] = logits[EOS[1]] - 0.5
    empirical = draws(lambda: upstream_step(logits, [], True), N_DRAWS)
    ours = processor_probs(logits, [], min_tokens=1)
    assert empirical[EOS[1]] > 0.3 and ours[EOS[1]] == pytest.approx(empirical[EOS[1]], abs=0.02)
    assert ours[S] == 0 and 0.5 * np.abs(empirical - ours).sum() < TV_BOUND
    assert processor_probs(logits, [], min_tokens=0)[S] > 0      # from min_len on, row S is back


def ras_params(min_tokens=0, cfg=DEFAULT_RAS):
    from vllm import SamplingParams

    return SamplingParams(**sampling_kwargs("cosyvoice_ras", min_tokens, 100, ras=cfg, min_len_masked_id=S),
                          stop_token_ids=list(EOS))


def test_the_batch_processor_reads_each_requests_own_history_under_interleaving():
    """vLLM's persistent batch adds, removes, moves and swaps requests between steps, and each request's output
    list grows in place: every RAS row must be P_ras of its own logits and its own tokens, other rows untouched."""
    from vllm import SamplingParams

    proc = processor()
    g = torch.Generator().manual_seed(11)
    outs = {name: [] for name in "abcd"}
    params = {"a": ras_params(min_tokens=3), "b": ras_params(), "c": SamplingParams(top_k=25),
              "d": ras_params(cfg=RASConfig(top_p=0.6, top_k=5, win_size=4, tau_r=0.5))}
    update(proc, 3, added=[(0, params["a"], outs["a"]), (1, params["b"], outs["b"]), (2, params["c"], outs["c"])])
    slots = ["a", "b", "c"]
    events = {2: dict(removed=[1]), 3: dict(added=[(1, params["d"], outs["d"])]), 5: dict(moved=[(0, 2, True)]),
              7: dict(removed=[1], moved=[(2, 1, False)])}
    checked = 0
    for step in range(10):
        if step in events:
            e = events[step]
            for i in e.get("removed", []):
                slots[i] = None
            for i, _, out in e.get("added", []):
                slots[i] = next(k for k in outs if outs[k] is out)
            for a, b, swap in e.get("moved", []):
                slots[a], slots[b] = (slots[b], slots[a]) if swap else (None, slots[a])
            update(proc, len(slots), **e)
        logits = torch.randn(len(slots), V, generator=g) * 2.5
        logits[:, S] += 2.0
        got = proc.apply(logits.clone()).softmax(-1)
        for row, name in enumerate(slots):
            if name is None:
                continue
            if name == "c":                                              # no RAS: left as it was
                assert torch.equal(got[row], logits[row].softmax(-1))
            else:
                ras = params[name].extra_args[RAS_KEY]
                cfg = RASConfig(ras["top_p"], ras["top_k"], ras["win_size"], ras["tau_r"])
                want = ras_probs(logits[row], outs[name], cfg, S if len(outs[name]) < ras["min_tokens"] else None)
                torch.testing.assert_close(got[row], want, rtol=0, atol=1e-6)
                checked += 1
            # the request draws a token and vLLM appends it to its live list; repeats make RAS act
            outs[name].append(int(logits[row].argmax()) if step % 3 else 7)
    assert checked >= 15 and outs["a"].count(7) >= 3            # RAS had repeats to act on


def test_the_processor_works_over_the_head_rows_only_and_refuses_placeholders():
    """With the head's decoder rows known, columns outside them come back -inf (probability 0, as the masked head
    gives them) and the rows inside are P_ras over the whole vocabulary; a window still holding vLLM's async
    placeholder (-1) stops the step."""
    full, rows = processor(), processor(head_rows=[10, V])
    logits = peaked_logits(6)
    logits[:10] = -8192.0                                              # the masked head's text rows
    history = [int(logits.argmax())] * 2
    for p in (full, rows):
        update(p, 1, added=[(0, ras_params(), list(history))])
    a, b = full.apply(logits.clone()[None])[0], rows.apply(logits.clone()[None])[0]
    assert torch.isinf(b[:10]).all()
    torch.testing.assert_close(a.softmax(-1), b.softmax(-1), rtol=0, atol=1e-6)  # float32 rounding (eps 1.2e-7)
    update(rows, 1, added=[(0, ras_params(), [12, -1])])
    with pytest.raises(RuntimeError, match="placeholder"):
        rows.apply(logits.clone()[None])


def test_ras_is_registered_only_for_engines_that_decode_with_it():
    from grpo.decoding import RAS_PROCESSOR, logits_processors
    from grpo.train.rollout import VLLMRollout

    assert logits_processors("plain") == [] and logits_processors("plain", "cosyvoice_vllm") == []
    assert logits_processors("plain", "cosyvoice_ras") == [RAS_PROCESSOR]
    with pytest.raises(ValueError, match="decoding must be one of"):
        logits_processors("ras")
    engine = object.__new__(VLLMRollout)                # no engine is started: the check comes first
    engine.processors = []
    with pytest.raises(ValueError, match="without the RAS processor"):
        engine.run([[1, 2]], [ras_params()])


def test_presets_and_length_bounds():
    assert length_bounds(7, 2, 20) == (14, 140) and length_bounds(3, 0.5, 1.5) == (1, 4)
    assert length_bounds(0, 2, 20) == (0, 1)
    ras = sampling_kwargs("cosyvoice_ras", 14, 140, min_len_masked_id=99)
    assert (ras["temperature"], ras["top_p"], ras["top_k"], ras["min_tokens"], ras["max_tokens"]) == (1, 1, -1, 0, 140)
    assert ras["extra_args"][RAS_KEY] == {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1, "min_tokens": 14,
                                          "min_len_masked_id": 99}
    with pytest.raises(ValueError, match="held back before min_len"):
        sampling_kwargs("cosyvoice_ras", 14, 140)
    vl = sampling_kwargs("cosyvoice_vllm", 14, 140)        # CosyVoice2's inference_wrapper: SamplingParams(top_k=25)
    assert (vl["top_k"], vl["temperature"], vl["min_tokens"], vl["max_tokens"]) == (25, 1, 14, 140)
    with pytest.raises(ValueError, match="decoding must be one of"):
        sampling_kwargs("greedy", 1, 2)


def test_requests_that_would_bypass_the_processor_are_refused():
    from vllm import SamplingParams

    from grpo.model.ras_logits import CosyVoiceRAS

    for bad in ({"top_k": 25}, {"top_p": 0.8}, {"min_tokens": 3}, {"temperature": 0.7}):
        kwargs = {**sampling_kwargs("cosyvoice_ras", 3, 10, min_len_masked_id=S), **bad}
        with pytest.raises(ValueError, match="CosyVoice RAS requests need"):
            CosyVoiceRAS.validate_params(SamplingParams(**kwargs))
    with pytest.raises(ValueError, match="needs exactly"):
        CosyVoiceRAS.validate_params(SamplingParams(extra_args={RAS_KEY: {"top_p": 0.8}}))
    old_style = sampling_kwargs("cosyvoice_ras", 3, 10, min_len_masked_id=S)      # a request without the masked id
    del old_style["extra_args"][RAS_KEY]["min_len_masked_id"]
    with pytest.raises(ValueError, match="needs exactly"):
        CosyVoiceRAS.validate_params(SamplingParams(**old_style))
    with pytest.raises(ValueError, match="speculative"):
        CosyVoiceRAS(SimpleNamespace(speculative_config=object()), torch.device("cpu"), False)
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        CosyVoiceRAS(SimpleNamespace(speculative_config=None, use_v2_model_runner=True), torch.device("cpu"), False)


@pytest.mark.vllm
def test_vllm_samples_from_the_ras_distribution(tiny_cfg):
    """The evaluation's engine (VLLMRollout) with the processor loaded: the log-probability vLLM samples each token
    with (processed_logprobs) is log P_ras of transformers' logits for that prefix and that history; before min_len
    row S (CosyVoice2's first stop id) never appears; a request without the extra_args is left alone (plain top-k 25).
    """
    from transformers import AutoModelForCausalLM

    from grpo.model.speech_vocab import SpeechVocab
    from grpo.train.rollout import VLLMRollout

    cfg = tiny_cfg()
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    rollout = VLLMRollout(cfg.model.hf_dir, vocab, max_model_len=256, logprobs_mode="processed_logprobs",
                          decodings=("cosyvoice_ras", "cosyvoice_vllm"))
    model = AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32).eval()
    prompt = [vocab.sos_token_id, 5, 9, 14, 3, vocab.task_id_token_id]
    min_len = 30
    masked = vocab.min_len_masked_id
    assert masked == vocab.stop_token_ids[0]                  # CosyVoice2: row S is its end of speech
    params = [rollout.speech_params(seed=s, logprobs=0, **sampling_kwargs("cosyvoice_ras", min_len, 60,
                                                                          min_len_masked_id=masked))
              for s in range(3)]
    params.append(rollout.speech_params(seed=7, logprobs=0, **sampling_kwargs("cosyvoice_vllm", 0, 60)))
    outs = rollout.llm.generate([{"prompt_token_ids": prompt}] * 4, params, use_tqdm=False)
    checked = 0
    for out in outs[:3]:
        ids, logprobs = list(out.outputs[0].token_ids), out.outputs[0].logprobs
        assert masked not in ids[:min_len]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:]
        for t, tok in enumerate(ids):
            want = ras_probs(logits[t], ids[:t], RASConfig(), masked if t < min_len else None)[tok]
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
    rollout.close()
