"""Scoring: normalise -> units (pinyin syllables for Chinese, words for English) -> error rate -> reward.

Chinese text is converted to simplified characters (zhconv), normalised with wetext (numbers, dates,
units to words), punctuation is removed, and the Han characters -- as pypinyin defines them, 〇 and the
CJK extensions included -- become TONE3 pinyin with tone sandhi and neutral tone 5; every other script
stays as case-folded words (Latin with its accents, kana, Hangul, Greek, ...), never dropped. English keeps
apostrophes inside words (don't), and decades and dollar amounts are spelled out before wetext, which
reads them wrongly ("1990s" as "... ninety seconds", "$5.50" as "five point five dollars"). The error
rate is jiwer's WER over those units, so a homophone (是/事) is no error and a wrong tone or polyphone
reading (行 xing2/hang2) is one.
"""

from __future__ import annotations

import math
import re
import unicodedata
from functools import lru_cache

import jiwer
from pypinyin import Style
from pypinyin.constants import RE_HANS
from pypinyin.converter import UltimateConverter
from pypinyin.core import Pinyin

LANGUAGES = ("zh", "en")
MAPPINGS = ("tanh", "linear", "exp")

# characters that need text normalisation (digits, currency, units, dates, times, math)
_NEEDS_TN = re.compile(r"[0-9０-９%％$¥￥€£℃°:：/+＋=×÷~～.\-]")
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")      # letters/digits of any script, inner apostrophes kept
_DECADE = re.compile(r"\b(\d{3})0s\b")          # 1990s, 2000s (wetext reads "s" as seconds)
_DOLLARS = re.compile(r"\$(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d{2}))?\b")


# what lazy_pinyin(style=TONE3, neutral_tone_with_five=True, tone_sandhi=True) uses, kept to call per segment
_PINYIN = Pinyin(UltimateConverter(neutral_tone_with_five=True, tone_sandhi=True))


@lru_cache(maxsize=4)
def _normalizer(language: str):
    from wetext import Normalizer

    return Normalizer(lang=language, operator="tn")


# every Unicode punctuation or symbol character of the Basic Multilingual Plane (both widths) -> space,
# except the apostrophe, which _WORD keeps inside words and drops elsewhere
_PUNCT_TO_SPACE = {cp: " " for cp in range(0x10000) if unicodedata.category(chr(cp))[0] in "PS" and chr(cp) != "'"}
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u02bc": "'", "\u2018": "'"})
_WORDS = jiwer.ReduceToListOfListOfWords()   # units are already normalised: only split on spaces


def strip_punctuation(text: str) -> str:
    """Replace every Unicode punctuation or symbol character (both widths) by a space."""
    return text.translate(_PUNCT_TO_SPACE)


def _english_number(digits: str) -> str:
    return _normalizer("en").normalize(digits.replace(",", ""))


def _spell_english(text: str) -> str:
    """What wetext reads wrongly, spelled out first: decades (1990s -> nineteen nineties) and dollar amounts
    ($5.50 -> five dollars fifty cents)."""
    def decade(m):
        words = _normalizer("en").normalize(f"in {m.group(1)}0").split()[1:]   # read as a year
        last = words[-1]
        words[-1] = last[:-1] + "ies" if last.endswith("y") else last + "s"
        return " ".join(words)

    def dollars(m):
        whole, cents = m.group(1), m.group(2)
        out = f"{_english_number(whole)} dollar{'' if whole == '1' else 's'}"
        if cents and int(cents):
            out += f" {_english_number(str(int(cents)))} cent{'' if int(cents) == 1 else 's'}"
        return out

    return _DOLLARS.sub(dollars, _DECADE.sub(decade, text))


@lru_cache(maxsize=65536)
def normalize(text: str, language: str = "zh") -> str:
    """wetext text normalisation (only when the text has something to normalise), no punctuation, case-folded;
    Chinese in simplified characters."""
    if language not in LANGUAGES:
        raise ValueError(f"unknown language {language!r}; expected one of {LANGUAGES}")
    text = unicodedata.normalize("NFKC", text).translate(_APOSTROPHES)
    if language == "zh":
        import zhconv

        text = zhconv.convert(text, "zh-cn")
    else:
        text = _spell_english(text)
    if _NEEDS_TN.search(text):
        text = _normalizer(language).normalize(text)
    return " ".join(strip_punctuation(text).casefold().split())


def _pinyin_units(text: str) -> list[str]:
    units: list[str] = []
    for segment in _PINYIN.seg(text):
        if RE_HANS.match(segment):
            units.extend(py[0] for py in _segment_cached(segment))
        else:
            units.extend(_WORD.findall(segment))
    return units


@lru_cache(maxsize=65536)
def _segment_cached(segment: str) -> tuple[tuple[str, ...], ...]:
    # pypinyin converts each segment independently (tone sandhi included), so caching per segment is exact
    return tuple(tuple(py) for py in _PINYIN._converter.convert(segment, Style.TONE3, False, "default", strict=True))


@lru_cache(maxsize=65536)
def text_to_units(text: str, language: str = "zh", ignore_tones: bool = False) -> tuple[str, ...]:
    """Units the error rate is computed over: TONE3 pinyin syllables (zh) or words (en)."""
    norm = normalize(text, language)
    units = _pinyin_units(norm) if language == "zh" else _WORD.findall(norm)
    if ignore_tones:
        units = [u.rstrip("012345") for u in units]
    return tuple(units)


def units_error_rate(reference: tuple[str, ...] | list[str], hypothesis: tuple[str, ...] | list[str]) -> float:
    """Levenshtein distance over units / reference length (jiwer). Empty reference is an error."""
    if not reference:
        raise ValueError("empty reference: nothing to score against")
    if not hypothesis:
        return 1.0
    return float(jiwer.wer(" ".join(reference), " ".join(hypothesis), reference_transform=_WORDS,
                           hypothesis_transform=_WORDS))


def error_rate(reference: str, hypothesis: str, language: str = "zh", ignore_tones: bool = False) -> float:
    """Pinyin-level (zh) or word-level (en) error rate of an ASR transcript against the input text."""
    ref = text_to_units(reference, language, ignore_tones)
    if not ref:
        raise ValueError(f"reference {reference!r} has no speakable units after normalisation")
    return units_error_rate(ref, text_to_units(hypothesis, language, ignore_tones))


def reward_from_error_rate(c: float, mapping: str = "tanh", scale: float = 3.0) -> float:
    """Map an error rate (>= 0, may exceed 1) to a reward in [0, 1]; default 1 - tanh(3c)."""
    if not (c >= 0 and math.isfinite(c)):
        raise ValueError(f"error rate must be a finite number >= 0, got {c!r}")
    if mapping == "tanh":
        r = 1.0 - math.tanh(scale * c)
    elif mapping == "linear":
        r = 1.0 - scale * c
    elif mapping == "exp":
        r = math.exp(-scale * c)
    else:
        raise ValueError(f"unknown reward mapping {mapping!r}; expected one of {MAPPINGS}")
    return min(1.0, max(0.0, r))
