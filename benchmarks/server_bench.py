"""Reward-server throughput, three ways, in one run, on the same backend, items and replica count:

  reference   the public recipe's way: verl's `prime` reward manager sends one item per request, up to 64 in
              flight, to a server with dynamic batching (max batch 32, 10 ms queue delay)
  sequential  batch size 1, one request at a time
  ours        the training client (concurrent calls sent together as small requests, a bounded number in
              flight so that each is routed as a replica frees up) against the same server as `reference`

Each way's rewards are compared item by item with the others. Each timing is the median of 3 passes over
the items after a warm-up.

    .venv/bin/python benchmarks/server_bench.py --backend synthetic --replicas 2
    .venv/bin/python benchmarks/server_bench.py --backend cosyvoice2 --items 128

Needs stage -1 of the tiny profile (bash run.sh -1 -1), or pass exp_dir=... overrides after `--`.
Prints figures; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from reward_server.client import ClientConfig, RewardClient
from reward_server.launch import ServerProcess

TEXTS = ["今天天气很好。", "我们一起去公园散步吧。", "请把窗户关上。", "这本书我已经读了三遍。"]


def make_items(n: int, seed: int = 0, tokens: int = 40) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"bench-{i}", "tokens": [rng.randrange(6561) for _ in range(tokens)], "text": TEXTS[i % 4]}
            for i in range(n)]


def reference(url: str, items: list[dict], in_flight: int = 64) -> list[dict]:
    """One item per request, `in_flight` requests at a time (verl's prime reward manager)."""
    async def go():
        gate = asyncio.Semaphore(in_flight)
        limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            async def one(item):
                async with gate:
                    resp = await http.post(f"{url}/score", json={"items": [item]})
                    resp.raise_for_status()
                    return resp.json()["results"][0]
            return await asyncio.gather(*(one(it) for it in items))
    return asyncio.run(go())


def sequential(url: str, items: list[dict]) -> list[dict]:
    with httpx.Client(timeout=600) as http:
        out = []
        for item in items:
            resp = http.post(f"{url}/score", json={"items": [item]})
            resp.raise_for_status()
            out.append(resp.json()["results"][0])
        return out


def ours(url: str, items: list[dict], request_items: int, in_flight: int) -> list[dict]:
    """Every sample through the training client at once, as verl's reward loop calls it."""
    async def go():
        client = RewardClient(ClientConfig(url, timeout_s=600, max_items_per_request=request_items,
                                           max_concurrency=in_flight))
        try:
            return await asyncio.gather(*(client.score_one(it) for it in items))
        finally:
            await client.aclose()
    return asyncio.run(go())


def timed(fn, items, repeats: int = 3) -> tuple[float, list[dict]]:
    """Median samples/s over `repeats` passes (after one warm-up pass) and the last pass's results."""
    fn(items[: min(len(items), 16)])
    rates, results = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        results = fn(items)
        rates.append(len(items) / (time.perf_counter() - start))
    return statistics.median(rates), results


def serve(args, batch: int, log_path: Path) -> ServerProcess:
    return ServerProcess([f"reward.backend={args.backend}", f"reward.max_batch_size={batch}",
                          "reward.batch_wait_timeout_s=0.01", f"reward.num_replicas={args.replicas}",
                          "reward.cpus_per_replica=1", *args.overrides], log_path=log_path).wait(timeout_s=600)


def compare(name: str, a: list[dict], b: list[dict]) -> float:
    """Largest reward difference between two ways' results for the same items."""
    by_id = {r["id"]: r["reward"] for r in b}
    diff = max(abs(r["reward"] - by_id[r["id"]]) for r in a)
    print(f"  rewards {name}: max |difference| {diff:.2e}")
    return diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="synthetic", choices=["cosyvoice2", "cosyvoice3", "synthetic"])
    parser.add_argument("--items", type=int, default=512)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="the server's dynamic batch (the reference: 32)")
    parser.add_argument("--tokens", type=int, default=40, help="speech tokens per item (25 a second)")
    parser.add_argument("--request-items", type=int, default=None,
                        help="items per client request (default: the training client's, see reward_fn)")
    parser.add_argument("--in-flight", type=int, default=None,
                        help="client requests in flight (default: the training client's, see reward_fn)")
    parser.add_argument("overrides", nargs="*", help="config overrides for the servers, e.g. exp_dir=exp/tiny")
    args = parser.parse_args()
    items = make_items(args.items, tokens=args.tokens)
    from grpo.config import load_config
    from grpo.train.reward_fn import reward_kwargs

    client = reward_kwargs(load_config([*args.overrides, f"reward.max_batch_size={args.batch}",
                                        f"reward.num_replicas={args.replicas}"]))
    args.request_items = args.request_items or client["max_items_per_request"]
    args.in_flight = args.in_flight or client["max_concurrency"]
    rates, results = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        server = serve(args, args.batch, Path(tmp) / "batched.log")
        try:
            rates["reference"], results["reference"] = timed(lambda its: reference(server.url, its), items)
            rates["ours"], results["ours"] = timed(
                lambda its: ours(server.url, its, args.request_items, args.in_flight), items)
        finally:
            server.stop()
        server = serve(args, 1, Path(tmp) / "sequential.log")
        try:
            rates["sequential"], results["sequential"] = timed(lambda its: sequential(server.url, its), items)
        finally:
            server.stop()
    for name in ("reference", "sequential", "ours"):
        print(f"{name:10s} {rates[name]:8.1f} samples/s")
    diff = max(compare("ours vs reference", results["ours"], results["reference"]),
               compare("ours vs sequential", results["ours"], results["sequential"]))
    ratio = rates["ours"] / rates["reference"]
    print(f"ours / reference: {ratio:.2f}x")
    print(json.dumps({"backend": args.backend, "items": args.items, "replicas": args.replicas,
                      "reference_samples_per_s": round(rates["reference"], 2),
                      "sequential_samples_per_s": round(rates["sequential"], 2),
                      "ours_samples_per_s": round(rates["ours"], 2), "ratio_vs_reference": round(ratio, 2),
                      "max_reward_difference": diff, "batch": args.batch, "request_items": args.request_items,
                      "requests_in_flight": args.in_flight,
                      "tokens_per_item": args.tokens}))


if __name__ == "__main__":
    main()
