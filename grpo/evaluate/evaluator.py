"""Stage 4: zero-shot CER of the base model and selected checkpoints.

Per checkpoint: vLLM generates speech tokens for every item (CosyVoice2's zero-shot input: prompt text
+ target text, then the prompt's speech tokens as the assistant prefix; speech tokens only, seeded) under
`eval.decoding` (grpo.decoding: CosyVoice's RAS by default) within CosyVoice's per-item length bounds,
CosyVoice's token2wav renders them with the item's own prompt speaker, the configured ASR transcribes,
and the Seed-TTS-eval protocol scores (grpo.evaluate.cer). Reports go to `eval.out_dir` (grpo.evaluate.report).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from grpo.evaluate import cer, report
from grpo.checkpoint_selection import select_checkpoints
from grpo.decoding import length_bounds, sampling_kwargs, text_token_count
from grpo.text_frontend import llm_text_ids, normalize
from grpo.train.local_engine import request_seed
from grpo.model.speech_vocab import SpeechVocab
from grpo.evaluate.test_sets import ZeroShotItem, load_set

log = logging.getLogger(__name__)


@dataclass
class Scored:
    id: str
    reference: str
    transcript: str
    error_rate: float | None     # None: failed (no speech, synthesis or ASR error), excluded from the mean
    tokens: int
    sim: float | None = None     # speaker similarity to the prompt (eval.speaker_model and a prompt_wav)


def prompt_features(items: list[ZeroShotItem], cfg: DictConfig) -> dict[str, dict]:
    """Each item's own prompt: speech tokens for the LLM, and flow conditioning (tokens, mel, speaker)."""
    from reward_server.token2wav import cosyvoice_frontend, load_wav_16k, tiny_prompt_features

    feats = {}
    if cfg.model.frontend == "tiny":
        for it in items:
            if not it.prompt_speech_tokens:
                raise ValueError(f"item {it.id}: the tiny frontend needs prompt_speech_tokens in the data")
            feats[it.id] = tiny_prompt_features(it.id, it.prompt_speech_tokens)
        return feats
    frontend = cosyvoice_frontend(cfg.model.cosyvoice_dir)
    for it in tqdm(items, desc="prompt features", mininterval=5):
        if not it.prompt_wav:
            raise ValueError(f"item {it.id}: needs prompt_wav for the CosyVoice frontend")
        f = frontend.frontend_zero_shot("", it.prompt_text, load_wav_16k(it.prompt_wav), 24000, "")
        feats[it.id] = {k: v.cpu() for k, v in f.items() if torch.is_tensor(v)}
    return feats


def build_inputs(items, feats, tokenizer, vocab: SpeechVocab, llm_prompt: bool = True,
                 frontend_dir: str | None = None) -> list[dict]:
    """Per item, what the LLM is fed: the (normalised) texts, the input ids and the target's token count.

    As CosyVoice's `frontend_zero_shot` + `Qwen2LM.inference`: each text through the frontend's
    `text_normalize` (`frontend_dir`: CosyVoice's tokenizer dir; None: raw), prompt text and target text
    tokenized separately and concatenated inside sos ... task_id, then the prompt's speech tokens
    (llm_prompt=True, zero-shot). llm_prompt=False is its cross-lingual input: the LLM sees the target alone."""
    inputs = []
    for it in items:
        text = normalize(it.text, frontend_dir) if frontend_dir else it.text
        prompt = (normalize(it.prompt_text, frontend_dir) if frontend_dir else it.prompt_text) if llm_prompt else ""
        ids = [vocab.sos_token_id, *llm_text_ids(tokenizer, text, prompt), vocab.task_id_token_id]
        if llm_prompt:
            ids += vocab.to_hf_ids(feats[it.id]["llm_prompt_speech_token"].flatten().tolist())
        inputs.append({"id": it.id, "prompt_text": prompt, "text": text, "input_ids": ids,
                       "text_tokens": text_token_count(tokenizer, text)})
    return inputs


class Evaluator:
    def __init__(self, cfg: DictConfig, items: list[ZeroShotItem]):
        from transformers import AutoTokenizer

        from grpo.train.rollout import VLLMRollout

        self.cfg, self.e, self.items = cfg, cfg.eval, items
        base = Path(cfg.model.hf_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.vocab = SpeechVocab.load(base)
        self.feats = prompt_features(items, cfg)
        frontend = cfg.data.frontend_tokenizer_dir if self.e.text_frontend else None
        self.inputs = build_inputs(items, self.feats, self.tokenizer, self.vocab, self.e.llm_prompt, frontend)
        self.prompts = [x["input_ids"] for x in self.inputs]
        for x in self.inputs:
            x["min_tokens"], x["max_tokens"] = length_bounds(x["text_tokens"], self.e.min_token_text_ratio,
                                                             self.e.max_token_text_ratio)
            x["decoding"] = self.e.decoding
        max_len = max(len(p) for p in self.prompts) + max(x["max_tokens"] for x in self.inputs) + 8
        dtype = cfg.train.rollout.dtype
        self.engine = VLLMRollout(base, self.vocab, dtype, cfg.train.rollout.gpu_memory_utilization,
                                  cfg.train.rollout.enforce_eager, max_len, cfg.seed,
                                  cfg.train.rollout.cpu_kv_cache_gib)
        self.token2wav = None
        if self.e.write_wavs or self.e.asr != "synthetic" or self.e.speaker_model:
            from reward_server.token2wav import Token2Wav

            self.token2wav = Token2Wav(cfg.model.cosyvoice_dir, "cuda" if torch.cuda.is_available() else "cpu")
        self.asr = self._asr()
        self.sim = None
        if self.e.speaker_model:
            from grpo.evaluate.speaker_similarity import SpeakerSimilarity
            from reward_server.token2wav import load_wav_16k

            self.sim = SpeakerSimilarity(self.e.speaker_model)
            self.prompt_wavs = {it.id: load_wav_16k(it.prompt_wav)[0].numpy() for it in items if it.prompt_wav}
            if not self.prompt_wavs:
                log.warning("eval.speaker_model is set but no item has a prompt_wav: no speaker similarity")

    def _asr(self):
        if self.e.asr == "synthetic":
            from reward_server.codebook import Codebook

            return Codebook.load(self.cfg.reward.codebook.path)
        from reward_server.asr import ByLanguage, build_asr

        device = "cuda" if torch.cuda.is_available() else "cpu"
        m = self.cfg.model
        dirs = {"sensevoice": m.sensevoice_dir, "paraformer": m.paraformer_dir, "whisper": m.whisper_dir}
        if self.e.asr == "seedtts":        # Seed-TTS-eval: Paraformer-zh for Chinese, Whisper-large-v3 for English
            return ByLanguage({"zh": lambda: build_asr("paraformer", dirs["paraformer"], device),
                               "en": lambda: build_asr("whisper", dirs["whisper"], device)})
        if self.e.asr not in dirs:
            raise ValueError(f"eval.asr must be seedtts, {', '.join(dirs)} or synthetic, got {self.e.asr!r}")
        return build_asr(self.e.asr, dirs[self.e.asr], device)

    def generate(self, model_dir: Path) -> list[list[int]]:
        """One sample per item under `eval.decoding`, within the item's CosyVoice length bounds."""
        self.engine.load_weights_from(model_dir)
        params = [self.engine.speech_params(n=1, seed=request_seed(self.e.seed, 0, i), **sampling_kwargs(
            self.e.decoding, x["min_tokens"], x["max_tokens"], self.e.temperature, self.e.top_p, self.e.top_k))
            for i, x in enumerate(self.inputs)]
        return [self.vocab.to_speech_tokens(group[0]) for group in self.engine.run(self.prompts, params)]

    def evaluate(self, name: str, model_dir: Path) -> list[Scored]:
        import soundfile as sf

        from reward_server.scoring import text_to_units, units_error_rate
        from reward_server.token2wav import resample, stable_hash

        speech = self.generate(model_dir)
        wav_dir = Path(self.e.out_dir) / name
        wav_dir.mkdir(parents=True, exist_ok=True)
        n_tokens = {it.id: len(tokens) for it, tokens in zip(self.items, speech)}
        by_id = {it.id: it for it in self.items}
        wavs, results = {}, {}
        for it, tokens in tqdm(list(zip(self.items, speech)), desc=f"token2wav {name}", mininterval=5):
            if not tokens:
                results[it.id] = Scored(it.id, it.text, "", None, 0)
                continue
            if self.token2wav is not None:
                try:
                    wav = self.token2wav(tokens, self.feats[it.id], seed=stable_hash(it.id) % (2**31))
                except Exception as exc:   # counted as a failure, never scored as perfect or zero
                    log.warning("token2wav failed for %s: %s", it.id, exc)
                    results[it.id] = Scored(it.id, it.text, "", None, len(tokens))
                    continue
                if self.e.write_wavs:
                    sf.write(wav_dir / f"{it.id}.wav", wav, self.token2wav.sample_rate)
                wavs[it.id] = wav
            if self.e.asr == "synthetic":
                units = self.asr.transcribe(tokens)
                rate = units_error_rate(text_to_units(it.text, it.language), units)
                results[it.id] = Scored(it.id, it.text, " ".join(units), rate, len(tokens))
        if self.e.asr != "synthetic" and wavs:
            ids = list(wavs)
            try:
                texts = self.asr.transcribe([resample(wavs[i], self.token2wav.sample_rate, 16000) for i in ids],
                                            [by_id[i].language for i in ids])
            except Exception as exc:
                log.warning("ASR failed for a batch of %d: %s", len(ids), exc)
                texts = [None] * len(ids)
            for i, hyp in zip(ids, texts):
                it = by_id[i]
                rate = None if hyp is None else cer.utterance_error_rate(it.text, hyp, it.language)
                results[i] = Scored(i, it.text, hyp or "", rate, n_tokens[i])
        if self.sim is not None:
            for i, wav in wavs.items():
                if i in self.prompt_wavs and results[i].error_rate is not None:
                    results[i].sim = self.sim.similarity(resample(wav, self.token2wav.sample_rate, 16000),
                                                         self.prompt_wavs[i])
        return [results[it.id] for it in self.items]


def write_inputs(path: Path, inputs: list[dict]) -> None:
    """eval/inputs.jsonl: per item what the model was fed (texts after the frontend, ids, length bounds, decoding)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for x in inputs:
            f.write(json.dumps(x, ensure_ascii=False) + "\n")


def run(cfg: DictConfig) -> int:
    e = cfg.eval
    items = load_set(e.set, e.data_path, e.get("language"))
    if e.max_items:
        items = items[: e.max_items]
    if not items:
        raise ValueError(f"no items in {e.data_path}")
    checkpoints = select_checkpoints(cfg, e.checkpoints)
    log.info("evaluating %d checkpoint(s) on %d items: %s", len(checkpoints), len(items), ", ".join(checkpoints))
    evaluator = Evaluator(cfg, items)
    write_inputs(Path(e.out_dir) / "inputs.jsonl", evaluator.inputs)
    unit = "pinyin syllable (synthetic codebook)" if e.asr == "synthetic" else "Seed-TTS-eval CER/WER"
    summary = {}
    for name, path in checkpoints.items():
        scored = evaluator.evaluate(name, path)
        summary[name] = report.write_checkpoint(Path(e.out_dir), name, scored, unit)
        log.info("%s: CER %.4f over %d items (%d failures)", name, summary[name]["cer"], summary[name]["count"],
                 summary[name]["failures"])
    report.write_summary(Path(e.out_dir), summary)
    return 0
