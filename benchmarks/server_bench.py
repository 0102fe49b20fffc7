"""Reward-server throughput: this server's way (every sample scored concurrently through the training
client, which sends concurrent calls together, the server batching them with @serve.batch) versus the
public reference's way (batch size 1, one sequential request per sample), same backend and machine,
in one run.

    .venv/bin/python benchmarks/server_bench.py [--backend cosyvoice2|synthetic] [--samples 256] [--replicas 2]

Needs stage -1 of the tiny profile (bash run.sh -1 -1). Each mode gets a fresh server; samples are
40 speech tokens (1.6 s of audio) with a Chinese reference. Prints figures; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from reward_server.client import ClientConfig, RewardClient
from reward_server.launch import ServerProcess


def make_items(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    texts = ["今天天气很好。", "我们一起去公园散步吧。", "请把窗户关上。", "这本书我已经读了三遍。"]
    return [{"id": f"bench-{i}", "tokens": [rng.randrange(6561) for _ in range(40)], "text": texts[i % 4]}
            for i in range(n)]


def sequential(url: str, items: list[dict]) -> float:
    with httpx.Client(timeout=300) as client:
        start = time.perf_counter()
        for it in items:
            client.post(f"{url}/score", json={"items": [it]}).raise_for_status()
        return len(items) / (time.perf_counter() - start)


def concurrent(url: str, items: list[dict], concurrency: int) -> float:
    """All samples at once through the training client: one score_one call per sample, as verl makes them;
    the client sends the calls of a few milliseconds together and the server batches them."""
    async def go():
        client = RewardClient(ClientConfig(url, timeout_s=300, max_concurrency=concurrency))
        start = time.perf_counter()
        await asyncio.gather(*(client.score_one(it) for it in items))
        elapsed = time.perf_counter() - start
        await client.aclose()
        return len(items) / elapsed
    return asyncio.run(go())


def measure(backend: str, batch: int, replicas: int, mode: str, items: list[dict], concurrency: int,
            log_dir: Path) -> float:
    server = ServerProcess([f"reward.backend={backend}", f"reward.max_batch_size={batch}", "reward.cpus_per_replica=1",
                            f"reward.num_replicas={replicas}", "reward.batch_wait_timeout_s=0.02"],
                           log_path=log_dir / f"{mode}.log").wait()
    try:
        warm = make_items(8, seed=99)
        sequential(server.url, warm)            # load models, fill caches
        rates = [sequential(server.url, items) if mode == "reference" else concurrent(server.url, items, concurrency)
                 for _ in range(3)]
        rates.sort()
        print(f"{mode:9s} batch {batch:3d}, {replicas} replica(s): {', '.join(f'{r:.1f}' for r in rates)} samples/s "
              f"(median {rates[1]:.1f})")
        return rates[1]
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cosyvoice2", choices=["cosyvoice2", "synthetic"])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the batched server (the reference: 1)")
    args = parser.parse_args()
    items = make_items(args.samples)
    with tempfile.TemporaryDirectory() as tmp:
        ref = measure(args.backend, 1, 1, "reference", items, 1, Path(tmp))
        ours = measure(args.backend, args.batch, args.replicas, "batched", items, args.concurrency, Path(tmp))
    print(f"ratio: {ours / ref:.2f}x")
    print(json.dumps({"benchmark": "reward_server", "backend": args.backend, "samples": args.samples,
                      "reference_samples_per_s": round(ref, 2), "batched_samples_per_s": round(ours, 2),
                      "ratio": round(ours / ref, 2), "max_batch_size": args.batch, "replicas": args.replicas,
                      "concurrency": args.concurrency}))


if __name__ == "__main__":
    main()
