"""Authoring tool for data/zero_shot_tiny.jsonl (run once; the file is shipped).

Each item pairs a short training sentence as the prompt (its speech tokens: the default synthetic
codebook's canonical tokens) with another training sentence as the target. The 2-layer tiny LLM
memorises sentences rather than learning to read unseen text, and cannot continue a speech prompt, so
the tiny profile evaluates these targets with CosyVoice's cross-lingual input (`eval.llm_prompt=false`:
the prompt conditions token2wav only). See README, "What the tiny profile shows".

    python -m grpo.evaluate.tiny_zero_shot            # rewrites data/zero_shot_tiny.jsonl
"""

from __future__ import annotations

import json
import random

from grpo.config import REPO_ROOT, load_config
from grpo.model.prepare import build_default_codebook
from reward_server.scoring import text_to_units

OUT = REPO_ROOT / "data" / "zero_shot_tiny.jsonl"
N_ITEMS = 24


def main() -> None:
    cfg = load_config([])
    rows = [json.loads(line) for line in (REPO_ROOT / cfg.data.train_file).read_text(encoding="utf-8").splitlines()]
    rng = random.Random(0)
    zh = [r for r in rows if r.get("language", "zh") == "zh" and text_to_units(r["text"])]
    prompts = sorted((r for r in zh if len(r["text"]) <= 10), key=lambda r: r["id"])
    targets = [r for r in zh if len(r["text"]) >= 8]
    rng.shuffle(targets)
    items = [{"id": f"zs_tiny_{i:03d}", "prompt_text": prompts[i % len(prompts)]["text"], "text": t["text"],
              "language": "zh", "source_id": t["id"]} for i, t in enumerate(targets[:N_ITEMS])]
    write(items)                         # texts first: they are part of the codebook's unit inventory
    codebook = build_default_codebook(cfg)
    for item in items:
        item["prompt_speech_tokens"] = codebook.tokens_for_text(item["prompt_text"], "zh", rng, canonical_prob=1.0)
    write(items)
    print(f"wrote {len(items)} items to {OUT}")


def write(items: list[dict]) -> None:
    OUT.write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items), encoding="utf-8")


if __name__ == "__main__":
    main()
