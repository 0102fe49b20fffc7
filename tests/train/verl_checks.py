"""Checks shared by the main_ppo tests (test_verl_cpu_run.py, test_verl_two_nodes.py)."""

import re
from pathlib import Path

import httpx


def items_scored(url) -> float:
    return sum(float(v) for v in re.findall(r"^reward_items_total\{[^}]*\} ([0-9.e+]+)$",
                                            httpx.get(f"{url}/metrics").text, re.M))


def check_length_bounds(cfg, logged, validations: int = 8):
    """Each logged sample (training and validation) within its own item's bounds, from the data: the text of its
    sample_id in the parquet, counted with CosyVoice's tokenizer; validation requests carried RAS."""
    import datasets
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer

    cosy = get_qwen_tokenizer(f"{cfg.model.cosyvoice_dir}/CosyVoice-BlankEN", skip_special_tokens=True)
    texts = {}
    for split in ("train", "val"):
        for row in datasets.Dataset.from_parquet(str(Path(cfg.data.out_dir) / f"{split}.parquet")):
            texts[row["extra_info"]["sample_id"]] = row["extra_info"]["normalized_text"]   # what the LLM read
    ceiling = cfg.train.max_response_tokens
    val = [x for x in logged if x["validate"]]
    assert len(val) == validations and all(x["ras"] for x in val)
    for x in logged:
        n = len(cosy.encode(texts[x["sample_id"]]))
        hi = min(3 * n, ceiling)
        lo = min(n, hi)
        assert (x["min_tokens"], x["max_tokens"]) == ((0, hi) if x["ras"] else (lo, hi)), x   # RAS: min inside
        assert lo <= x["speech_tokens"] <= hi, x
