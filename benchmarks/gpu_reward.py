"""A reward backend at the real model sizes: CosyVoice2-0.5B's flow and HiFT (`--family cosyvoice2`) or
Fun-CosyVoice3-0.5B-2512's DiT flow and causal HiFT (`--family cosyvoice3`), and SenseVoiceSmall's encoder (512 wide,
50 + 20 blocks) at the realsize profiles' sizes (conf/profile/realsize.yaml), built from their configs with random
weights -- nothing is downloaded. It measures
samples/s one item at a time vs batched (length buckets, at most `--max-padding` of a flow pass padding; on a GPU
also every item in one pass), fp32 vs bf16 autocast, and peak memory, over items of varied lengths.

    .venv/bin/python benchmarks/gpu_reward.py                         # a GPU: 64 items of 50-150 tokens (2-6 s)
    .venv/bin/python benchmarks/gpu_reward.py --family cosyvoice3     # the same for CosyVoice3
    .venv/bin/python benchmarks/gpu_reward.py --items 2 --tokens 12 --no-warmup   # a CPU smoke (CI's: tests/project)

Random weights make the work real (every layer runs at its size) and the transcripts meaningless; the
SenseVoice vocabulary is padded to the released 25,055 pieces. Needs only torch and this repository's pure-Python
dependencies. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

# the released sizes, as the realsize profile builds them (conf/profile/realsize.yaml, model.realsize)
REALSIZE = OmegaConf.load(Path(__file__).resolve().parent.parent / "conf" / "profile" / "realsize.yaml").model.realsize


def build_models(root: Path, texts: list[str], family_name: str) -> tuple[Path, Path]:
    """flow.pt + hift.pt + the family's yaml, and a SenseVoiceSmall directory, all at the real sizes."""
    from grpo.speech.cosyvoice_dir import load_cosyvoice_yaml
    from grpo.speech.family import family
    from grpo.standins.released_layout import write_cosyvoice_yaml
    from grpo.standins.tiny import build_sensevoice_dir

    cv_dir, sv_dir = root / family_name, root / "SenseVoiceSmall"
    cv_dir.mkdir(parents=True)
    write_cosyvoice_yaml(cv_dir, REALSIZE, family(family_name))
    torch.manual_seed(0)
    configs = load_cosyvoice_yaml(cv_dir, skip=["llm"])
    for name in ("flow", "hift"):
        torch.save(configs[name].state_dict(), cv_dir / f"{name}.pt")
    build_sensevoice_dir(sv_dir, REALSIZE.sensevoice, texts, seed=0)
    return cv_dir, sv_dir


def peak_memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # KiB -> GiB (process high-water mark)


def measure(backend, items, batched: bool, device: str, repeats: int, warmup: bool = True) -> dict:
    """Median samples/s of `repeats` passes (after a warm-up pass unless told not to) and the peak memory while
    running."""
    def one_pass():
        if batched:
            backend.transcribe(items)
        else:
            for item in items:
                backend.transcribe([item])
        if device == "cuda":
            torch.cuda.synchronize()

    if warmup:
        one_pass()                                               # kernels, allocator, caches
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        rates.append(len(items) / (time.perf_counter() - start))
    return {"samples_per_s": round(sorted(rates)[len(rates) // 2], 3), "peak_gib": round(peak_memory_gib(device), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="cosyvoice2", choices=["cosyvoice2", "cosyvoice3"])
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=150, help="speech tokens per item (25 a second): the longest")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="items' lengths drawn from [min-tokens, tokens], as rollouts vary (default: tokens / 3)")
    parser.add_argument("--max-padding", type=float, default=0.1,
                        help="token2wav's padding bound for the batched way (reward.token2wav.max_padding)")
    parser.add_argument("--one-bucket", action=argparse.BooleanOptionalAction, default=None,
                        help="also the batched way without the padding bound (every item in one flow pass, up to "
                             "max_frames_per_batch): default on a GPU, where the trade-off is batch size vs padding")
    parser.add_argument("--prompt-tokens", type=int, default=75, help="prompt speaker length in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="an unmeasured pass before the measured ones (--no-warmup: the CPU smoke, where a pass "
                             "of real-size renders costs minutes and no figure is asserted)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default=None, help="comma list; default float32,bfloat16 (CUDA) or float32")
    args = parser.parse_args()
    from grpo.config import REPO_ROOT
    from grpo.speech.asr import FunASR
    from grpo.speech.token2wav import Token2Wav
    from grpo.standins.tiny_speakers import tiny_speakers
    from reward_server.backends import CosyVoiceBackend, ScoreItem

    dtypes = (args.dtypes or ("float32,bfloat16" if args.device == "cuda" else "float32")).split(",")
    texts = [json.loads(line)["text"] for line in (REPO_ROOT / "data" / "zh_train.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    shortest = args.tokens // 3 if args.min_tokens is None else args.min_tokens
    lengths = [rng.randint(shortest, args.tokens) for _ in range(args.items)]
    items = [ScoreItem(f"bench-{i}", tuple(rng.randrange(6561) for _ in range(n)), texts[i % len(texts)])
             for i, n in enumerate(lengths)]
    one_bucket = args.device == "cuda" if args.one_bucket is None else args.one_bucket
    speakers = tiny_speakers(4, 0, prompt_tokens=args.prompt_tokens)
    result = {"benchmark": "gpu_reward", "family": args.family,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "items": args.items, "tokens_per_item": [shortest, args.tokens], "max_padding": args.max_padding,
              "threads": torch.get_num_threads(), "warmup": args.warmup}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        cv_dir, sv_dir = build_models(Path(tmp), texts, args.family)
        print(f"real-size models built in {time.perf_counter() - start:.0f} s")
        asr = FunASR(sv_dir, device=args.device, batch_size=max(1, args.items))
        ways = [("batch1", False, args.max_padding), ("batched", True, args.max_padding)]
        if one_bucket:
            ways.append(("batched_one_bucket", True, float("inf")))
        for dtype in dtypes:
            for mode, batched, max_padding in ways:
                t2w = Token2Wav(cv_dir, args.device, dtype, max_padding=max_padding)
                figures = measure(CosyVoiceBackend(t2w, speakers, asr), items, batched, args.device, args.repeats,
                                  args.warmup)
                result[f"{mode}_{dtype}"] = figures
                print(f"{mode:18s} {dtype:9s} {figures['samples_per_s']:8.2f} samples/s, "
                      f"peak {figures['peak_gib']} GiB")
    base = result["batch1_float32"]["samples_per_s"]
    for dtype in dtypes:
        for mode, _, _ in ways[1:]:
            result[f"speedup_{mode}_{dtype}"] = round(result[f"{mode}_{dtype}"]["samples_per_s"] / base, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
