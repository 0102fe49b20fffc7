"""Authoring tool for the tiny profile's two zero-shot sets (run once; the files are shipped).

- data/zero_shot_tiny.jsonl, **held out**: targets are sentences of data/zh_test.jsonl, which neither the
  warm start (random character strings, grpo/standins/warm_start.py) nor GRPO (data/zh_train.jsonl) trains on;
  every item says so (`"split": "held_out"`) and tests/evaluate/test_zero_shot_sets.py checks the disjointness.
- data/zero_shot_tiny_seen.jsonl, **seen**: targets are GRPO training sentences (`"split": "seen"`), evaluated
  beside the held-out set (eval.extra_sets) to show how much of the gain is memorisation.

Prompts are short training sentences with their canonical codebook tokens. The tiny LLM cannot continue a
speech prompt, so the tiny profile evaluates with CosyVoice's cross-lingual input (`eval.llm_prompt=false`:
the prompt conditions token2wav only). See docs/tiny-profile.md.

    python -m grpo.data.tiny_zero_shot            # rewrites both files
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from grpo.config import REPO_ROOT, load_config
from grpo.speech.scoring import text_to_units
from grpo.standins.tiny import build_default_codebook

HELD_OUT = REPO_ROOT / "data" / "zero_shot_tiny.jsonl"
SEEN = REPO_ROOT / "data" / "zero_shot_tiny_seen.jsonl"
N_ITEMS = 24


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def readable(text: str) -> bool:
    """Chinese characters (what the tiny LLM was taught to read) and sentence punctuation (which the codebook
    does not speak) only: no digits or Latin letters, which the codebook speaks as other units."""
    return all("\u4e00" <= ch <= "\u9fff" or ch in "，。？！" for ch in text)


def make_items(prefix: str, split: str, prompts: list[dict], targets: list[dict], rng: random.Random) -> list[dict]:
    targets = [r for r in targets if len(r["text"]) >= 8 and readable(r["text"])]
    rng.shuffle(targets)
    return [{"id": f"{prefix}_{i:03d}", "split": split, "prompt_text": prompts[i % len(prompts)]["text"],
             "text": t["text"], "language": "zh", "source_id": t["id"]} for i, t in enumerate(targets[:N_ITEMS])]


def main() -> None:
    cfg = load_config([])
    zh = lambda rows: [r for r in rows if r.get("language", "zh") == "zh" and text_to_units(r["text"])]  # noqa: E731
    train, held_out = zh(read_rows(REPO_ROOT / cfg.data.train_file)), zh(read_rows(REPO_ROOT / cfg.data.val_file))
    rng = random.Random(0)
    prompts = sorted((r for r in train if len(r["text"]) <= 10), key=lambda r: r["id"])
    sets = {HELD_OUT: make_items("zs_tiny", "held_out", prompts, held_out, rng),
            SEEN: make_items("zs_tiny_seen", "seen", prompts, train, rng)}
    for path, items in sets.items():
        write(path, items)               # texts first: they are part of the codebook's unit inventory
    codebook = build_default_codebook(cfg)
    for path, items in sets.items():
        for item in items:
            item["prompt_speech_tokens"] = codebook.tokens_for_text(item["prompt_text"], "zh", rng, canonical_prob=1.0)
        write(path, items)
        print(f"wrote {len(items)} items to {path}")


def write(path: Path, items: list[dict]) -> None:
    path.write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items), encoding="utf-8")


if __name__ == "__main__":
    main()
