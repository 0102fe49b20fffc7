"""Reward backends: a batch of items (speech tokens + reference text) -> transcripts -> rewards.

- `cosyvoice2`, `cosyvoice3`: that family's token2wav (prompt speaker chosen from the sample id, so the same id
  always gets the same speaker), 24 -> 16 kHz, then ASR (SenseVoice) on the whole batch.
- `synthetic`: the seeded codebook look-up (tiny profile and tests; no audio involved).
Both give a speaker similarity per item when asked for (grpo/speech/components.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from grpo.speech import scoring
from grpo.speech.components import RewardSpec, combine, duration_score
from grpo.speech.family import FAMILIES
from grpo.speech.speakers import speaker_index, stable_hash

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoreItem:
    id: str
    tokens: tuple[int, ...]
    text: str
    language: str = "zh"


@dataclass(frozen=True)
class Transcript:
    text: str
    units: tuple[str, ...] | None = None    # set when the backend yields units directly (synthetic)
    sim: float | None = None                # similarity to the item's prompt speaker, when computed


class Backend(Protocol):
    name: str

    def transcribe(self, items: list[ScoreItem]) -> list[Transcript]: ...


class SyntheticBackend:
    """Codebook look-up: each speech token is a pinyin syllable / English word, or silence."""

    name = "synthetic"

    def __init__(self, codebook_path, num_speakers: int = 4):
        from grpo.speech.codebook import Codebook, SyntheticVoices

        self.codebook = Codebook.load(codebook_path)
        self.voices = SyntheticVoices.of(self.codebook, num_speakers)
        log.warning("SYNTHETIC reward backend: transcripts come from a fixed codebook, not from audio "
                    "(%d units, %d tokens). For the tiny profile and tests only.",
                    len(self.codebook.units), self.codebook.speech_token_size)

    def transcribe(self, items: list[ScoreItem]) -> list[Transcript]:
        out = []
        for item in items:
            units = tuple(self.codebook.transcribe(item.tokens))
            sim = self.voices.similarity(item.tokens, speaker_index(item.id, self.voices.num_speakers))
            out.append(Transcript(text=" ".join(units), units=units, sim=sim))
        return out


class CosyVoiceBackend:
    """token2wav (the model family's flow + HiFT, grpo.speech.token2wav) with a deterministic prompt speaker, then
    batched ASR; with a speaker verifier (the model's campplus.onnx), each wav's similarity to its prompt speaker's
    embedding. Named after the model family it speaks with (`cosyvoice2`, `cosyvoice3`)."""

    def __init__(self, token2wav, speakers: dict, asr, verifier=None):
        from grpo.speech.asr import ASR_SAMPLE_RATE

        self.name = token2wav.family.name
        self.token2wav, self.asr, self.verifier = token2wav, asr, verifier
        self.speaker_names = sorted(speakers)
        self.speakers = speakers
        self.asr_rate = ASR_SAMPLE_RATE

    def speaker_for(self, item_id: str) -> str:
        return self.speaker_names[speaker_index(item_id, len(self.speaker_names))]

    def synthesize(self, items: list[ScoreItem]) -> list:
        """16 kHz audio: the flow runs on the whole batch, HiFT per item, each seeded by its id."""
        from grpo.speech.token2wav import resample

        wavs = self.token2wav.batch([list(it.tokens) for it in items],
                                    [self.speakers[self.speaker_for(it.id)] for it in items],
                                    [stable_hash(it.id) % (2**31) for it in items])
        return [resample(w, self.token2wav.sample_rate, self.asr_rate) for w in wavs]

    def transcribe(self, items: list[ScoreItem]) -> list[Transcript]:
        wavs = self.synthesize(items)
        texts = self.asr.transcribe(wavs, [it.language for it in items])
        if self.verifier is None:
            return [Transcript(text=t) for t in texts]
        sims = [self.verifier.similarity_to_embedding(w, self.speakers[self.speaker_for(it.id)]["flow_embedding"])
                for w, it in zip(wavs, items)]
        return [Transcript(text=t, sim=s) for t, s in zip(texts, sims)]


def score(items: list[ScoreItem], transcripts: list[Transcript], mapping: str = "tanh", scale: float = 3.0,
          ignore_tones: bool = False, spec: RewardSpec | None = None) -> list[dict]:
    """Each transcript's error rate against its reference text, the reward components, and their weighted
    combination (`spec`; default: cer alone)."""
    spec = spec or RewardSpec()
    results = []
    for item, tr in zip(items, transcripts, strict=True):
        ref = scoring.text_to_units(item.text, item.language, ignore_tones)
        if not ref:
            raise ValueError(f"item {item.id!r}: reference text has no speakable units")
        if tr.units is not None:
            hyp = tuple(u.rstrip("012345") for u in tr.units) if ignore_tones else tr.units
        else:
            hyp = scoring.text_to_units(tr.text, item.language, ignore_tones)
        c = scoring.units_error_rate(ref, hyp)
        band = spec.duration_band[item.language]
        components = {"cer": scoring.reward_from_error_rate(c, mapping, scale),
                      "duration": duration_score(len(item.tokens), len(ref), band, spec.duration_tolerance)}
        if tr.sim is not None:
            components["sim"] = max(0.0, tr.sim)
        results.append({"id": item.id, "reward": combine(components, spec.weights), "error_rate": c,
                        "transcript": tr.text, "components": components})
    return results


def build_backend(cfg, device: str = "cpu") -> Backend:
    """From the root config: reward.backend, model dirs, prompt speakers, ASR."""
    r = cfg.reward
    if r.backend == "synthetic":
        return SyntheticBackend(r.codebook.path, r.prompt_speakers.num_tiny)
    if r.backend in FAMILIES:
        from grpo.speech.asr import build_asr
        from grpo.speech.family import family_of_dir
        from grpo.speech.speakers import load_speakers
        from grpo.speech.token2wav import Token2Wav

        found = family_of_dir(cfg.model.cosyvoice_dir).name       # checked before any model is loaded
        if found != r.backend:
            raise ValueError(f"reward.backend={r.backend}, but model.cosyvoice_dir={cfg.model.cosyvoice_dir} holds a "
                             f"{found} model")
        speakers = load_speakers(r.prompt_speakers.features)    # built by stage -1, once, in the driver
        verifier = None
        if "sim" in RewardSpec.from_config(r).active:        # a model run per item: only when it counts
            from grpo.speech.speaker_similarity import SpeakerSimilarity

            verifier = SpeakerSimilarity(r.sim.model)
        t2w = Token2Wav(cfg.model.cosyvoice_dir, device, r.token2wav.dtype, r.token2wav.max_frames_per_batch,
                        r.token2wav.max_padding)
        return CosyVoiceBackend(t2w, speakers,
                                 build_asr(r.asr.kind, r.asr.model_dir, device, r.asr.language, r.asr.batch_size),
                                 verifier)
    raise ValueError(f"unknown reward.backend {r.backend!r}; expected {', '.join(FAMILIES)} or synthetic")
