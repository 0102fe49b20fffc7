"""Conversion llm.pt <-> HF, with CosyVoice's own classes (Qwen2LM, QwenTokenizer) as the reference."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from grpo.model.convert import cosyvoice_to_hf, hf_to_cosyvoice, hf_to_cosyvoice_state
from grpo.model.lm_head_bias import CALIBRATION_FILE
from grpo.model.speech_vocab import SpeechVocab, speech_token_strings
from grpo.model.tiny import load_cosyvoice_yaml


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


@torch.no_grad()
def hf_logits(hf_dir, ids):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return model(torch.tensor([ids])).logits[0]


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


def test_zero_bias_conversion_is_exact(model_copy, tmp_path):
    src, set_bias = model_copy
    set_bias(torch.zeros_like)
    report = cosyvoice_to_hf(src, tmp_path / "hf", "auto", calibration_samples=4)
    assert report["bias"] == "zero" and report["chosen"] == "exact"
    vocab = SpeechVocab.load(tmp_path / "hf")
    llm = cosyvoice_llm(src)
    T, rows = vocab.speech_token_offset, vocab.num_speech_rows
    for seed in range(3):
        text, speech, ids = random_case(vocab, seed)
        ref = cosyvoice_logits(llm, text, speech)
        out = hf_logits(tmp_path / "hf", ids)[:, T:T + rows]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert report["exact"]["kl_mean"] < 1e-9 and report["exact"]["top1_agreement"] == 1.0


def test_nonzero_bias_report_matches_recomputed_kl(model_copy, tmp_path):
    src, set_bias = model_copy
    set_bias(lambda b: torch.randn(b.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    for mode in ("drop", "fold"):
        out = tmp_path / f"hf_{mode}"
        report = cosyvoice_to_hf(src, out, mode, calibration_samples=8)
        assert report["chosen"] == mode
        vocab = SpeechVocab.load(out)
        llm = cosyvoice_llm(src)
        T = vocab.speech_token_offset
        allowed = torch.tensor([i - T for i in vocab.allowed_token_ids()])
        calib = json.loads((out / CALIBRATION_FILE).read_text())
        kls = []
        for k in range(1, len(calib["sequences"]), 2):   # the held-out half
            ids, p = calib["sequences"][k], calib["prompt_lengths"][k]
            text, speech = ids[1:p - 1], [i - T for i in ids[p:]]
            ref = F.log_softmax(cosyvoice_logits(llm, text, speech)[p - 1:-1, allowed], -1)
            new = F.log_softmax(hf_logits(out, ids)[p - 1:-1, T + allowed], -1)
            kls.append((ref.exp() * (ref - new)).sum(-1))
        kl = torch.cat(kls).mean().item()
        assert kl == pytest.approx(report["candidates"][mode]["kl_mean"], rel=1e-3, abs=1e-7)
        assert kl > 0
    assert "KL" in (tmp_path / "hf_fold" / "conversion_report.md").read_text()


@pytest.mark.parametrize("bias", ["zero", "random"])
def test_round_trip_is_bit_exact_and_loads_strictly(model_copy, tmp_path, bias):
    src, set_bias = model_copy
    if bias == "zero":
        set_bias(torch.zeros_like)
    else:
        set_bias(lambda b: torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))
    cosyvoice_to_hf(src, tmp_path / "hf", "auto", calibration_samples=4)
    hf_to_cosyvoice(tmp_path / "hf", tmp_path / "back" / "llm.pt")
    original = torch.load(src / "llm.pt", weights_only=True)
    back = torch.load(tmp_path / "back" / "llm.pt", weights_only=True)
    assert list(back) == list(original)
    for k in original:
        assert torch.equal(back[k], original[k]), k
    llm = load_cosyvoice_yaml(src, skip=["flow", "hift"])["llm"]
    llm.load_state_dict(back, strict=True)


def test_functional_export_reproduces_the_hf_policy(model_copy, tmp_path):
    src, set_bias = model_copy
    set_bias(lambda b: torch.randn(b.shape, generator=torch.Generator().manual_seed(2)))
    cosyvoice_to_hf(src, tmp_path / "hf", "drop", calibration_samples=4)
    vocab = SpeechVocab.load(tmp_path / "hf")
    exported = tmp_path / "cv_export"
    shutil.copytree(src, exported)
    torch.save(hf_to_cosyvoice_state(tmp_path / "hf", head="functional"), exported / "llm.pt")
    text, speech, ids = random_case(vocab, 7)
    T, rows = vocab.speech_token_offset, vocab.num_speech_rows
    torch.testing.assert_close(cosyvoice_logits(cosyvoice_llm(exported), text, speech),
                               hf_logits(tmp_path / "hf", ids)[:, T:T + rows], rtol=1e-5, atol=1e-5)


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


def test_cosyvoice3_layout_converts_exactly_and_round_trips(tiny_cfg, tmp_path):
    """The token2wav-cosyvoice package has no CosyVoice3LM; build its layout (speech_embedding and a
    bias-free llm_decoder of S+200 rows, no llm_embedding) on CosyVoice2's Qwen2 body."""
    src = Path(tiny_cfg().model.cosyvoice_dir)
    dst = tmp_path / "cv3"
    shutil.copytree(src, dst)
    sd = torch.load(dst / "llm.pt", weights_only=True)
    S, H = sd["speech_embedding.weight"].shape[0] - 3, sd["speech_embedding.weight"].shape[1]
    g = torch.Generator().manual_seed(3)
    del sd["llm_embedding.weight"], sd["llm_decoder.bias"]
    sd["speech_embedding.weight"] = torch.randn(S + 200, H, generator=g)
    sd["llm_decoder.weight"] = torch.randn(S + 200, H, generator=g) * 0.1
    torch.save(sd, dst / "llm.pt")
    report = cosyvoice_to_hf(dst, tmp_path / "hf3", "auto", calibration_samples=4)
    assert report["family"] == "cosyvoice3" and report["bias"] == "none"
    vocab = SpeechVocab.load(tmp_path / "hf3")
    assert vocab.sos_token_id == vocab.speech_token_offset + S and vocab.task_id_token_id == vocab.speech_token_offset + S + 2
    # reference forward: Qwen2 body of a Qwen2LM, CosyVoice3's sos/task rows from speech_embedding
    llm = load_cosyvoice_yaml(dst, skip=["flow", "hift"])["llm"]
    llm.llm_decoder = torch.nn.Linear(H, S + 200, bias=False)
    llm.speech_embedding = torch.nn.Embedding(S + 200, H)
    del llm.llm_embedding
    llm.load_state_dict(sd, strict=True)
    llm.eval()
    text, speech, ids = random_case(vocab, 4)
    ref = cosyvoice_logits(llm, text, speech, llm.speech_embedding.weight[S], llm.speech_embedding.weight[S + 2])
    allowed = torch.tensor(vocab.allowed_token_ids())   # speech tokens + stop ids (sos is never sampled)
    torch.testing.assert_close(hf_logits(tmp_path / "hf3", ids)[:, allowed],
                               ref[:, allowed - vocab.speech_token_offset], rtol=1e-5, atol=1e-5)
    back = hf_to_cosyvoice_state(tmp_path / "hf3")
    assert list(back) == list(sd)
    assert [k for k in sd if not torch.equal(back[k], sd[k])] == []


@pytest.mark.vllm
def test_vllm_serves_converted_model(tiny_cfg):
    from transformers import Qwen2ForCausalLM

    from grpo.train.rollout import SamplingConfig, TransformersRollout, VLLMRollout

    cfg = tiny_cfg()
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, return_dict=False)
               for t in ("今天天气很好。", "我们一起去公园散步吧。")]
    engine = VLLMRollout(cfg.model.hf_dir, vocab, max_model_len=256)
    hf = TransformersRollout(Qwen2ForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32), vocab,
                             tok.pad_token_id)
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=24)
    assert engine.generate(prompts, greedy, [0, 1]) == hf.generate(prompts, greedy, [0, 1])
    sampled = engine.generate(prompts, SamplingConfig(n=8, temperature=1.0, max_tokens=32), [5, 6])
    allowed = set(vocab.allowed_token_ids())
    tokens = [t for group in sampled for resp in group for t in resp]
    assert tokens and all(t in allowed for t in tokens)
