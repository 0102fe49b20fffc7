"""Synthetic speech: a fixed, seeded codebook maps each speech token to one unit (a TONE3 pinyin
syllable or an English word) or to silence, so "transcribing" tokens is a table look-up.

This exists for the `tiny` profile and tests only: random-weight models carry no signal, while the
codebook gives a task a tiny LLM can learn, which proves the RL loop is wired right. The unit
inventory covers only the units of the given texts (so every target is speakable).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from grpo.speech.scoring import text_to_units

SILENCE = -1


@dataclass
class Codebook:
    units: list[str]
    token_to_unit: list[int]        # unit index per speech token, SILENCE for none
    seed: int

    @property
    def speech_token_size(self) -> int:
        return len(self.token_to_unit)

    def transcribe(self, tokens: Iterable[int]) -> list[str]:
        """Speech tokens -> units (silence dropped). Raises on ids outside the speech vocabulary."""
        out = []
        for t in tokens:
            if not 0 <= t < len(self.token_to_unit):
                raise ValueError(f"speech token {t} outside [0, {len(self.token_to_unit)})")
            u = self.token_to_unit[t]
            if u != SILENCE:
                out.append(self.units[u])
        return out

    def tokens_for_units(self, units: Iterable[str], rng: random.Random, silence_prob: float = 0.0,
                         canonical_prob: float = 0.0) -> list[int]:
        """One token per unit, silence sprinkled in. With `canonical_prob` the unit's first token is used,
        otherwise one of its tokens at random (speech has preferred realisations, not uniform ones)."""
        silence = self.tokens_by_unit[SILENCE]
        out = []
        for u in units:
            if u not in self.unit_index:
                raise KeyError(f"unit {u!r} is not in the codebook (built from other texts?)")
            if silence and rng.random() < silence_prob:
                out.append(rng.choice(silence))
            choices = self.tokens_by_unit[self.unit_index[u]]
            out.append(choices[0] if rng.random() < canonical_prob else rng.choice(choices))
        return out

    def tokens_for_text(self, text: str, language: str, rng: random.Random, silence_prob: float = 0.0,
                        canonical_prob: float = 0.0) -> list[int]:
        return self.tokens_for_units(text_to_units(text, language), rng, silence_prob, canonical_prob)

    @cached_property
    def unit_index(self) -> dict[str, int]:
        return {u: i for i, u in enumerate(self.units)}

    @cached_property
    def tokens_by_unit(self) -> dict[int, list[int]]:
        by_unit: dict[int, list[int]] = {SILENCE: []}
        for token, u in enumerate(self.token_to_unit):
            by_unit.setdefault(u, []).append(token)
        return by_unit

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        data = {"kind": "synthetic-codebook", "seed": self.seed, "units": self.units,
                "token_to_unit": self.token_to_unit}
        Path(path).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")

    def misheard(self, fraction: float, seed: int) -> Codebook:
        """A second synthetic judge: a seeded `fraction` of the spoken tokens heard as another unit (a held-out
        ASR with other quirks than the reward's, so that the evaluation's hacking gap has something to see)."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"eval.synthetic_alt.fraction must be in [0, 1], got {fraction}")
        rng = random.Random(seed)
        spoken = [t for t, u in enumerate(self.token_to_unit) if u != SILENCE]
        heard = list(self.token_to_unit)
        for t in rng.sample(spoken, round(fraction * len(spoken))) if len(self.units) > 1 else []:
            heard[t] = rng.choice([u for u in range(len(self.units)) if u != heard[t]])
        return Codebook(units=self.units, token_to_unit=heard, seed=seed)

    @classmethod
    def load(cls, path: str | Path) -> Codebook:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"synthetic codebook {path} not found: run stage -1 (bash run.sh -1 -1)")
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(units=data["units"], token_to_unit=data["token_to_unit"], seed=data["seed"])


def build_codebook(texts: Iterable[tuple[str, str]], speech_token_size: int,
                   silence_fraction: float = 0.3, seed: int = 0) -> Codebook:
    """Units of (text, language) pairs; a seeded shuffle of the tokens, a share to silence, the rest
    dealt round-robin to the units (sorted, so the result depends only on the inventory and seed)."""
    units = sorted({u for text, lang in texts for u in text_to_units(text, lang)})
    if not units:
        raise ValueError("no units: the codebook needs at least one non-empty text")
    rng = random.Random(seed)
    tokens = list(range(speech_token_size))
    rng.shuffle(tokens)
    n_silence = int(round(speech_token_size * silence_fraction))
    if speech_token_size - n_silence < len(units):
        raise ValueError(f"{speech_token_size - n_silence} non-silent tokens cannot cover {len(units)} units")
    token_to_unit = [SILENCE] * speech_token_size
    for i, token in enumerate(tokens[n_silence:]):
        token_to_unit[token] = i % len(units)
    return Codebook(units=units, token_to_unit=token_to_unit, seed=seed)


class SyntheticVoices:
    """Stand-in speaker verifier for the synthetic backend (no audio exists there): each speech token and each
    prompt speaker has a seeded voice vector, and an utterance's similarity to its speaker is the cosine of
    its tokens' mean vector with the speaker's. Tokens that read the same unit differ in voice -- as real
    speech tokens carry some timbre -- so a policy can learn to sound like the speaker without misreading."""

    def __init__(self, speech_token_size: int, num_speakers: int, seed: int, dim: int = 8):
        import numpy as np

        gen = np.random.default_rng(seed)
        self.token_vectors = gen.standard_normal((speech_token_size, dim))
        self.speaker_vectors = gen.standard_normal((num_speakers, dim))

    @classmethod
    def of(cls, codebook: Codebook, num_speakers: int) -> SyntheticVoices:
        """The voices of a codebook's tokens (seeded by the codebook), as the synthetic reward hears them."""
        return cls(codebook.speech_token_size, num_speakers, codebook.seed)

    @property
    def num_speakers(self) -> int:
        return len(self.speaker_vectors)

    def similarity(self, tokens: list[int], speaker: int) -> float:
        from grpo.speech.speaker_similarity import cosine

        return cosine(self.token_vectors[list(tokens)].mean(axis=0), self.speaker_vectors[speaker])
