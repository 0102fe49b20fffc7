"""Stage 4's evaluator: zero-shot CER of one model directory on a set (the driver is grpo/evaluate/stage.py).

Per checkpoint: vLLM generates speech tokens for every item (CosyVoice2's zero-shot input: prompt text
+ target text, then the prompt's speech tokens as the assistant prefix; speech tokens only, seeded) under
`eval.decoding` (grpo.decoding: CosyVoice's RAS by default) within CosyVoice's per-item length bounds,
CosyVoice's token2wav renders them with the item's own prompt speaker, the configured ASR transcribes,
and the Seed-TTS-eval protocol scores (grpo.evaluate.cer). Reports go to `eval.out_dir` (grpo.evaluate.report).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from grpo.data.test_sets import ZeroShotItem
from grpo.decoding import length_bounds, request_seed, sampling_kwargs, text_token_count
from grpo.evaluate import cer
from grpo.evaluate.html_report import SYNTHETIC_JUDGES, SYNTHETIC_SPEAKER
from grpo.layout import EvalDir
from grpo.model.speech_vocab import SpeechVocab
from grpo.node.device import resolve as resolve_device
from grpo.speech.speakers import speaker_index
from grpo.speech.text_frontend import llm_text_ids, normalize_prompt, target_segments

log = logging.getLogger(__name__)


@dataclass
class Scored:
    id: str
    reference: str
    transcript: str
    error_rate: float | None     # None: failed (no speech, synthesis or ASR error), excluded from the mean
    tokens: int
    sim: float | None = None     # speaker similarity to the prompt (eval.speaker_model and a prompt_wav)
    sample: int = 0              # which of the item's eval.num_samples decodes
    language: str = "zh"
    wav: str = ""                # relative to eval.out_dir
    judges: dict = field(default_factory=dict)   # extra judge -> (transcript, error_rate)


def prompt_features(items: list[ZeroShotItem], cfg: DictConfig) -> dict[str, dict]:
    """Each item's own prompt: speech tokens for the LLM, and flow conditioning (tokens, mel, speaker)."""
    from grpo.speech.token2wav import SAMPLE_RATE, cosyvoice_frontend
    from grpo.standins.tiny_speakers import tiny_prompt_features

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
        f = frontend.frontend_zero_shot("", it.prompt_text, str(it.prompt_wav), SAMPLE_RATE, "")
        feats[it.id] = {k: v.cpu() for k, v in f.items() if torch.is_tensor(v)}
    return feats


def build_inputs(items, feats, tokenizer, vocab: SpeechVocab, llm_prompt: bool = True,
                 frontend_dir: str | None = None) -> list[dict]:
    """Per item, what the LLM is fed: the (normalised) texts, the input ids and the target's token count.

    As CosyVoice's `inference_zero_shot` + `Qwen2LM.inference`: each text through the frontend's
    `text_normalize` (the target's segments joined, grpo.speech.text_frontend; `frontend_dir`: CosyVoice's tokenizer
    dir; None: raw), prompt text and target text tokenized separately and concatenated inside sos ... task_id, then
    the prompt's speech tokens (llm_prompt=True, zero-shot). The prompt text starts with the family's prefix
    (CosyVoice3: "You are a helpful assistant.<|endofprompt|>", which also keeps upstream's frontend from
    normalising it). llm_prompt=False is its cross-lingual input: the LLM sees the prefix and the target alone."""
    fam = vocab.model_family
    inputs, several = [], []
    for it in items:
        segments = target_segments(it.text, frontend_dir, fam.name) if frontend_dir else [it.text]
        text = "".join(segments)
        if len(segments) > 1:
            several.append(it.id)
        prompt = fam.prompt_prefix
        if llm_prompt:
            prompt = fam.prompt_prefix + it.prompt_text
            prompt = normalize_prompt(prompt, frontend_dir, fam.name) if frontend_dir else prompt
        ids = [vocab.sos_token_id, *llm_text_ids(tokenizer, text, prompt), vocab.task_id_token_id]
        if llm_prompt:
            ids += vocab.to_hf_ids(feats[it.id]["llm_prompt_speech_token"].flatten().tolist())
        inputs.append({"id": it.id, "prompt_text": prompt, "text": text, "input_ids": ids,
                       "text_tokens": text_token_count(tokenizer, text)})
    if several:
        log.warning("%d item(s) (e.g. %s) split into several segments, which CosyVoice synthesises one by one; "
                    "here each is one LLM input, its segments joined", len(several), several[0])
    return inputs


RENDER_CHUNK = 64       # utterances per Token2Wav.batch call in stage 4 (length buckets are formed inside one)


class Evaluator:
    def __init__(self, cfg: DictConfig, items: list[ZeroShotItem], indices: list[int] | None = None):
        """`indices`: each item's index in the whole set (its seeds follow it; grpo.evaluate.parallel's shards)."""
        from transformers import AutoTokenizer

        from grpo.train.rollout import VLLMRollout

        self.cfg, self.e, self.items = cfg, cfg.eval, items
        self.indices = list(range(len(items))) if indices is None else list(indices)
        self.device = resolve_device(cfg)      # once: token2wav and every judge run there
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
        self.engine = VLLMRollout(base, self.vocab, self.e.dtype, cfg.train.rollout.gpu_memory_utilization,
                                  cfg.train.rollout.enforce_eager, max_len, cfg.seed,
                                  cfg.train.rollout.cpu_kv_cache_gib, decodings=(self.e.decoding,))
        self.token2wav = None
        audio_judges = [j for j in [self.e.asr, *extra_judges(self.e)] if j not in SYNTHETIC_JUDGES]
        hears_speaker = self.e.speaker_model and self.e.speaker_model != SYNTHETIC_SPEAKER
        if self.e.write_wavs or audio_judges or hears_speaker:
            from grpo.speech.token2wav import Token2Wav

            frames = self.e.token2wav_batch_frames
            if not isinstance(frames, int) or isinstance(frames, bool) or frames < 0:
                raise ValueError(f"eval.token2wav_batch_frames: expected 0 (one utterance at a time) or a number of "
                                 f"mel frames, got {frames!r}")
            bound = {"max_frames_per_batch": frames} if frames else {}     # 0: the batched path is never taken
            # float32 on every device, as upstream's per-utterance path runs (the reward's bf16 is not the protocol)
            self.token2wav = Token2Wav(cfg.model.cosyvoice_dir, self.device, dtype="float32",
                                       max_padding=cfg.reward.token2wav.max_padding, **bound)
        if self.e.num_samples < 1:
            raise ValueError(f"eval.num_samples must be at least 1, got {self.e.num_samples}")
        self.extra = extra_judges(self.e)
        self.judges = {n: self._judge(n) for n in [self.e.asr, *self.extra]}
        self.sim = self.synthetic_voices = None
        if self.e.speaker_model == SYNTHETIC_SPEAKER:      # the reward's own stand-in, read from the tokens
            from grpo.speech.codebook import SyntheticVoices

            self.synthetic_voices = SyntheticVoices.of(self._judge("synthetic"), cfg.reward.prompt_speakers.num_tiny)
        elif self.e.speaker_model:
            from grpo.speech.speaker_similarity import SpeakerSimilarity
            from grpo.speech.token2wav import load_wav_16k

            self.sim = SpeakerSimilarity(self.e.speaker_model)
            self.prompt_wavs = {it.id: load_wav_16k(it.prompt_wav)[0].numpy() for it in items if it.prompt_wav}
            if not self.prompt_wavs:
                log.warning("eval.speaker_model is set but no item has a prompt_wav: no speaker similarity")

    def close(self) -> None:
        """Shut the vLLM engine down (in-process, it holds its memory until then: grpo.train.rollout)."""
        self.engine.close()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _judge(self, name: str):
        """An ASR by name: a transcribe(wavs, languages) model, or a Codebook (synthetic judges read tokens)."""
        if name in SYNTHETIC_JUDGES:
            from grpo.speech.codebook import Codebook

            book = Codebook.load(self.cfg.reward.codebook.path)
            return book if name == "synthetic" else book.misheard(self.e.synthetic_alt.fraction,
                                                                   self.e.synthetic_alt.seed)
        from grpo.speech.asr import ByLanguage, build_asr

        device = self.device
        m, batch = self.cfg.model, {"batch_size": self.e.asr_batch_size}
        dirs = {"sensevoice": m.sensevoice_dir, "paraformer": m.paraformer_dir, "whisper": m.whisper_dir}
        if name == "seedtts":        # Seed-TTS-eval: Paraformer-zh for Chinese, Whisper-large-v3 for English
            return ByLanguage({"zh": lambda: build_asr("paraformer", dirs["paraformer"], device, **batch),
                               "en": lambda: build_asr("whisper", dirs["whisper"], device, **batch)})
        if name not in dirs:
            raise ValueError(f"eval.asr / eval.judges: expected seedtts, {', '.join(dirs)}, synthetic or "
                             f"synthetic_alt, got {name!r}")
        return build_asr(name, dirs[name], device, **batch)

    def generate(self, model_dir: Path) -> list[list[list[int]]]:
        """eval.num_samples samples per item under `eval.decoding`, within the item's CosyVoice length bounds;
        sample j of item i has seed request_seed(eval.seed, j, i), the same for every checkpoint."""
        self.engine.load_weights_from(model_dir)
        params = [[self.engine.speech_params(n=1, seed=request_seed(self.e.seed, j, self.indices[i]), **sampling_kwargs(
            self.e.decoding, x["min_tokens"], x["max_tokens"], self.e.temperature, self.e.top_p, self.e.top_k,
            min_len_masked_id=self.vocab.min_len_masked_id))
            for i, x in enumerate(self.inputs)] for j in range(self.e.num_samples)]
        flat = self.engine.run(self.prompts * self.e.num_samples, [q for row in params for q in row])
        n = len(self.inputs)
        return [[self.vocab.to_speech_tokens(flat[j * n + i][0]) for j in range(self.e.num_samples)]
                for i in range(n)]

    def _read(self, judge, name: str, keys, tokens, wavs16, by_id) -> dict:
        """(transcript, rate) per (item id, sample) for one judge: token judges read the tokens, ASRs the 16 kHz
        audio."""
        from grpo.speech.scoring import text_to_units, units_error_rate

        out = {}
        if name in SYNTHETIC_JUDGES:
            for key in keys:
                units = judge.transcribe(tokens[key])
                out[key] = (" ".join(units), units_error_rate(text_to_units(by_id[key[0]].text,
                                                                            by_id[key[0]].language), units))
            return out
        keys = [k for k in keys if k in wavs16]
        try:
            texts = judge.transcribe([wavs16[k] for k in keys], [by_id[k[0]].language for k in keys]) if keys else []
        except Exception as exc:
            log.warning("ASR %s failed for a batch of %d: %s", name, len(keys), exc)
            texts = [None] * len(keys)
        for k, hyp in zip(keys, texts):
            it = by_id[k[0]]
            out[k] = ("", None) if hyp is None else (hyp, cer.utterance_error_rate(it.text, hyp, it.language))
        return out

    def render(self, keys: list, tokens: dict, name: str) -> dict:
        """Audio per (item id, sample), None where token2wav failed. Seeds follow the item id and sample. With
        eval.token2wav_batch_frames, chunks of RENDER_CHUNK utterances in batched flow passes (a chunk that fails
        is rendered again one by one, so that only the failing utterance counts as failed); else upstream's own
        per-utterance flow.inference."""
        from grpo.speech.speakers import stable_hash

        seed = {k: (stable_hash(k[0]) + k[1]) % (2**31) for k in keys}
        out = {}
        chunk = RENDER_CHUNK if self.e.token2wav_batch_frames else 1
        with tqdm(total=len(keys), desc=f"token2wav {name}", mininterval=5) as bar:
            for start in range(0, len(keys), chunk):
                part = keys[start:start + chunk]
                if len(part) > 1:
                    try:
                        wavs = self.token2wav.batch([tokens[k] for k in part], [self.feats[k[0]] for k in part],
                                                    [seed[k] for k in part])
                        out.update(zip(part, wavs))
                        bar.update(len(part))
                        continue
                    except Exception as exc:
                        log.warning("batched token2wav failed for %d utterances (%s); one by one", len(part), exc)
                for k in part:
                    try:
                        out[k] = self.token2wav(tokens[k], self.feats[k[0]], seed=seed[k])
                    except Exception as exc:
                        log.warning("token2wav failed for %s (sample %d): %s", k[0], k[1], exc)
                        out[k] = None
                    bar.update(1)
        return out

    def evaluate(self, name: str, model_dir: Path) -> list[Scored]:
        import soundfile as sf

        from grpo.speech.token2wav import resample

        speech = self.generate(model_dir)
        wav_dir = EvalDir(self.e.out_dir).wavs(name)
        wav_dir.mkdir(parents=True, exist_ok=True)
        by_id = {it.id: it for it in self.items}
        tokens = {(it.id, j): toks for it, group in zip(self.items, speech) for j, toks in enumerate(group)}
        wavs, paths = {}, {}
        failed = {k for k, toks in tokens.items() if not toks}
        if self.token2wav is not None:
            todo = [k for k in tokens if k not in failed]
            for k, wav in self.render(todo, tokens, name).items():
                if wav is None:              # counted as a failure, never scored as perfect or zero
                    failed.add(k)
                    continue
                wavs[k] = wav
                if self.e.write_wavs:
                    i, j = k
                    rel = f"{name}/{i}.wav" if j == 0 else f"{name}/{i}_s{j}.wav"
                    sf.write(Path(self.e.out_dir) / rel, wav, self.token2wav.sample_rate)
                    wavs[k] = sf.read(Path(self.e.out_dir) / rel, dtype="float32")[0]   # what the file holds
                    paths[k] = rel                      # (16-bit): judges hear it, as Seed-TTS-eval reads wavs
        keys = [k for k in tokens if k not in failed]
        hears_audio = self.sim is not None or any(n not in SYNTHETIC_JUDGES for n in self.judges)
        wavs16 = ({k: resample(w, self.token2wav.sample_rate, 16000) for k, w in wavs.items()}   # once, for all
                  if hears_audio else {})
        read = {n: self._read(judge, n, keys, tokens, wavs16, by_id) for n, judge in self.judges.items()}
        primary = read[self.e.asr]
        results = []
        for j in range(self.e.num_samples):
            for it in self.items:
                k = (it.id, j)
                hyp, rate = primary.get(k, ("", None))
                s = Scored(it.id, it.text, hyp, rate, len(tokens[k]), sample=j, language=it.language,
                           wav=paths.get(k, ""),
                           judges={n: read[n].get(k, ("", None)) for n in self.extra})
                if self.sim is not None and k in wavs and it.id in self.prompt_wavs and rate is not None:
                    s.sim = self.sim.similarity(wavs16[k], self.prompt_wavs[it.id])
                elif self.synthetic_voices is not None and rate is not None:
                    s.sim = self.synthetic_voices.similarity(tokens[k], speaker_index(it.id,
                                                                                   self.synthetic_voices.num_speakers))
                results.append(s)
        return results


def extra_judges(e) -> list[str]:
    """The judges scored beside eval.asr: eval.judges, and the reward's own ASR (eval.reward_judge) if not listed."""
    return [j for j in dict.fromkeys([*e.judges, e.reward_judge]) if j and j != e.asr]
