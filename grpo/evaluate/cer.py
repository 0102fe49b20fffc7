"""CER/WER exactly as Seed-TTS-eval (and CV3-Eval's run_wer.py) compute it.

Per utterance: Chinese transcripts converted to simplified (zhconv); every character of
`zhon.hanzi.punctuation + string.punctuation` except the apostrophe removed from both texts; double
spaces collapsed; Chinese split into characters, English lower-cased words; error rate with jiwer.
The reported figure is the **mean of per-utterance rates** (not the corpus-level rate).
"""

from __future__ import annotations

import string

import jiwer
import numpy as np
import zhconv
from zhon.hanzi import punctuation as ZH_PUNCTUATION

PUNCTUATION = "".join(ch for ch in ZH_PUNCTUATION + string.punctuation if ch != "'")
_STRIP = str.maketrans("", "", PUNCTUATION)


def prepare(text: str, language: str) -> str:
    text = text.translate(_STRIP).replace("  ", " ")
    if language == "zh":
        return " ".join(text)
    if language == "en":
        return text.lower()
    raise ValueError(f"unknown language {language!r}; expected zh or en")


def utterance_error_rate(reference: str, hypothesis: str, language: str) -> float:
    """One utterance's CER (zh) or WER (en). An empty reference after normalisation is an error."""
    if language == "zh":
        hypothesis = zhconv.convert(hypothesis, "zh-cn")
    ref, hyp = prepare(reference, language), prepare(hypothesis, language)
    if not ref.split():
        raise ValueError(f"reference {reference!r} is empty after removing punctuation")
    if not hyp.split():
        return 1.0
    return float(jiwer.wer(ref, hyp))


def mean_error_rate(rates) -> float:
    """Seed-TTS-eval's figure: the mean of per-utterance rates."""
    rates = list(rates)
    return float(np.mean(rates)) if rates else float("nan")


def corpus_error_rate(references, hypotheses, language: str) -> float:
    """Corpus-level rate (total edits / total reference units), for comparison only: NOT what is reported."""
    refs, hyps = [], []
    for r, h in zip(references, hypotheses):
        refs.append(prepare(r, language))
        hyps.append(prepare(zhconv.convert(h, "zh-cn") if language == "zh" else h, language) or "<empty>")
    return float(jiwer.wer(refs, hyps))
