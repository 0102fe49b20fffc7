"""Scoring throughput (grpo.speech.scoring): sentence pairs per second on one core.

Pairs: the shipped Chinese sentences (median 13 characters; 9% hold digits, dates or symbols that need
text normalisation) against ASR-like hypotheses: the reference in spoken form (numbers as words, as
SenseVoice writes without ITN) with random character substitutions and deletions. Two patterns, each
timed 5 times (median):
  distinct - every reference and hypothesis is new (cold caches)
  grpo     - each reference scored against 8 hypotheses, as a GRPO group is
Prints the figures; the last line is one JSON object.

    .venv/bin/python benchmarks/scoring_bench.py
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from grpo.config import REPO_ROOT  # noqa: E402
from grpo.speech import scoring  # noqa: E402


def corrupt(text: str, chars: list[str], rng: random.Random) -> str:
    out = []
    for ch in text:
        r = rng.random()
        if r < 0.1:
            out.append(rng.choice(chars))       # substitution
        elif r < 0.15:
            continue                             # deletion
        else:
            out.append(ch)
    return "".join(out)


def clear_caches() -> None:
    for fn in (scoring.text_to_units, scoring.normalize, scoring._segment_cached):
        fn.cache_clear()


def run(pairs) -> float:
    clear_caches()
    start = time.perf_counter()
    for ref, hyp in pairs:
        scoring.reward_from_error_rate(scoring.error_rate(ref, hyp, "zh"))
    return len(pairs) / (time.perf_counter() - start)


def main() -> None:
    rows = [json.loads(line) for name in ("zh_train.jsonl", "zh_test.jsonl")
            for line in (REPO_ROOT / "data" / name).read_text(encoding="utf-8").splitlines()]
    refs = [r["text"] for r in rows]
    chars = sorted({c for t in refs for c in t if "\u4e00" <= c <= "\u9fff"})
    rng = random.Random(0)
    scoring.error_rate("2024年3月5日预热", "预热")   # load wetext FSTs and pypinyin dictionaries outside the timing
    spoken = scoring._normalizer("zh").normalize
    distinct = [rng.choice(refs) + rng.choice(chars) for _ in range(2000)]
    distinct = [(ref, corrupt(spoken(ref), chars, rng)) for ref in distinct]
    grpo = [(ref, corrupt(spoken(ref), chars, rng)) for ref in rng.sample(refs, 200) for _ in range(8)]
    results = {}
    for name, pairs in (("distinct", distinct), ("grpo", grpo)):
        rates = [run(pairs) for _ in range(5)]
        results[name] = round(statistics.median(rates))
        print(f"{name:9s} {len(pairs)} pairs: median {results[name]} pairs/s "
              f"(runs: {', '.join(str(round(r)) for r in rates)})")
    lengths = sorted(len(r) for r, _ in distinct)
    result = {"benchmark": "scoring", "pairs_per_s_distinct": results["distinct"], "pairs_per_s_grpo": results["grpo"],
              "median_reference_chars": lengths[len(lengths) // 2], "threads": 1}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
