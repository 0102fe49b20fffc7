"""ASR behind one interface: a batch of 16 kHz mono waveforms -> transcripts."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)

ASR_SAMPLE_RATE = 16000
_SENSEVOICE_TAG = re.compile(r"<\|[^|]*\|>")


class ASR(Protocol):
    def transcribe(self, wavs: list[np.ndarray], languages: list[str] | None = None) -> list[str]: ...


def by_language(wavs: list[np.ndarray], languages: list[str], transcribe) -> list[str]:
    """`transcribe(wavs, language)` once per language present, the transcripts back in input order."""
    out = [""] * len(wavs)
    for language in dict.fromkeys(languages):
        rows = [i for i, lang in enumerate(languages) if lang == language]
        for i, text in zip(rows, transcribe([wavs[i] for i in rows], language), strict=True):
            out[i] = text
    return out


class FunASR:
    """A funasr model (SenseVoiceSmall, Paraformer-zh) through AutoModel from a local directory.

    `language`: "item" (default) decodes each waveform in its item's language (a batch is split by language),
    "auto" lets SenseVoice detect it (noisy RL audio then comes back as Cantonese or Japanese), a code fixes it."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", language: str = "item", batch_size: int = 16):
        from funasr import AutoModel

        if not Path(model_dir, "config.yaml").exists():
            raise FileNotFoundError(f"{model_dir}/config.yaml not found: not a funasr model directory")
        # ncpu: AutoModel sets torch's intra-op threads to it, default 4 (funasr/auto/auto_model.py, build_model,
        # `torch.set_num_threads(ncpu)`): on a 2-core machine that oversubscribes every later torch op of the
        # process -- CosyVoice3's DiT flow in a reward replica ran 15x slower. Keep the process's own setting.
        self.model = AutoModel(model=str(model_dir), device=device, disable_update=True, log_level="ERROR",
                               ncpu=torch.get_num_threads())
        self.language, self.batch_size = language, batch_size

    def transcribe(self, wavs: list[np.ndarray], languages: list[str] | None = None) -> list[str]:
        if self.language != "item" or languages is None:
            fixed = "auto" if self.language == "item" else self.language
            languages = [fixed] * len(wavs)
        return by_language(wavs, languages, self._generate)       # one generate call per language

    def _generate(self, wavs: list[np.ndarray], language: str) -> list[str]:
        """One generate call, the waveforms sorted by length so that funasr's batches (consecutive `batch_size`
        inputs, padded to the longest) hold similar lengths; results returned in input order."""
        if not wavs:
            return []
        order = sorted(range(len(wavs)), key=lambda i: len(wavs[i]))
        results = self.model.generate(input=[wavs[i].astype(np.float32) for i in order], cache={},
                                      language=language, use_itn=False, batch_size=self.batch_size, disable_pbar=True)
        if len(results) != len(wavs):
            raise RuntimeError(f"ASR returned {len(results)} results for {len(wavs)} inputs")
        out = [""] * len(wavs)
        for i, r in zip(order, results):
            # SenseVoice prefixes language/emotion/event tags: <|zh|><|NEUTRAL|><|Speech|><|woitn|>text
            out[i] = _SENSEVOICE_TAG.sub("", r["text"]).strip()
        return out


class WhisperASR:
    """Whisper (large-v3 for Seed-TTS-eval's English) through transformers, from a local directory."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", batch_size: int = 16, max_new_tokens: int = 128):
        import torch
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        if not Path(model_dir, "config.json").exists():
            raise FileNotFoundError(f"{model_dir}/config.json not found: not a Whisper model directory")
        self.device, self.batch_size, self.max_new_tokens = device, batch_size, max_new_tokens
        self.processor = WhisperProcessor.from_pretrained(str(model_dir))
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        self.model = WhisperForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()

    def transcribe(self, wavs: list[np.ndarray], languages: list[str] | None = None) -> list[str]:
        return by_language(wavs, languages or ["en"] * len(wavs), self._generate)

    def _generate(self, wavs: list[np.ndarray], language: str) -> list[str]:
        import torch

        out = []
        for start in range(0, len(wavs), self.batch_size):
            feats = self.processor(wavs[start:start + self.batch_size], sampling_rate=ASR_SAMPLE_RATE,
                                   return_tensors="pt")
            with torch.inference_mode():
                ids = self.model.generate(feats.input_features.to(self.device, self.model.dtype), language=language,
                                          task="transcribe", max_new_tokens=self.max_new_tokens)
            out += [text.strip() for text in self.processor.batch_decode(ids, skip_special_tokens=True)]
        return out


class ByLanguage:
    """One ASR per language, as Seed-TTS-eval: Paraformer-zh for Chinese, Whisper-large-v3 for English. Each
    model is loaded on first use."""

    def __init__(self, factories: dict):
        self.factories, self.models = factories, {}

    def transcribe(self, wavs: list[np.ndarray], languages: list[str] | None = None) -> list[str]:
        if languages is None:
            raise ValueError("a per-language ASR needs each waveform's language")
        return by_language(wavs, languages, self._transcribe)

    def _transcribe(self, wavs: list[np.ndarray], language: str) -> list[str]:
        if language not in self.factories:
            raise ValueError(f"no evaluation ASR for language {language!r} (have {sorted(self.factories)})")
        if language not in self.models:
            self.models[language] = self.factories[language]()
        return self.models[language].transcribe(wavs, [language] * len(wavs))


class PocketsphinxASR:
    """CMU PocketSphinx with its bundled en-us model: a real English ASR that installs offline (tests)."""

    def __init__(self, **_):
        from pocketsphinx import Decoder

        self.decoder = Decoder(samprate=ASR_SAMPLE_RATE, loglevel="FATAL")

    def transcribe(self, wavs: list[np.ndarray], languages: list[str] | None = None) -> list[str]:
        out = []   # English only: `languages` is ignored
        for wav in wavs:
            pcm = (np.clip(wav, -1, 1) * 32767).astype(np.int16).tobytes()
            self.decoder.start_utt()
            self.decoder.process_raw(pcm, full_utt=True)
            self.decoder.end_utt()
            hyp = self.decoder.hyp()
            out.append(hyp.hypstr if hyp is not None else "")
        return out


def build_asr(kind: str, model_dir: str | Path | None = None, device: str = "cpu", language: str = "item",
              batch_size: int = 16) -> ASR:
    if kind in ("sensevoice", "paraformer"):
        return FunASR(model_dir, device=device, language=language, batch_size=batch_size)
    if kind == "whisper":
        return WhisperASR(model_dir, device=device, batch_size=batch_size)
    if kind == "pocketsphinx":
        return PocketsphinxASR()
    raise ValueError(f"unknown ASR {kind!r}; expected sensevoice, paraformer, whisper or pocketsphinx")
