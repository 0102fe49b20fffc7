"""Reward-server throughput, three ways, in one run, on the same backend, items and replica count:

  reference   the public recipe's way: verl's `prime` reward manager sends one item per request, up to 64 in
              flight, to a server with dynamic batching (max batch 32, 10 ms queue delay)
  sequential  batch size 1, one request at a time
  ours        the training client (concurrent calls sent together as small requests, a bounded number in
              flight so that each is routed as a replica frees up) against the same server as `reference`

Each way's rewards are compared item by item with the others. Each timing is the median of `--repeats` passes
over the items (the ways interleaved, after a short warm-up).

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


def make_items(n: int, seed: int = 0, tokens: int = 40, min_tokens: int | None = None) -> list[dict]:
    """`n` items of `tokens` speech tokens each, or of a length drawn from [min_tokens, tokens] (as rollouts vary)."""
    rng = random.Random(seed)
    lengths = [tokens if min_tokens is None else rng.randint(min_tokens, tokens) for _ in range(n)]
    return [{"id": f"bench-{i}", "tokens": [rng.randrange(6561) for _ in range(length)], "text": TEXTS[i % 4]}
            for i, length in enumerate(lengths)]


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


def timed(ways: dict, items: list[dict], repeats: int = 3, warmup: bool = True) -> tuple[dict, dict]:
    """Median samples/s of each way over `repeats` passes, the ways interleaved within each repeat (so that the
    machine's drift hits them alike), after one short warm-up call (unless told not to); and each way's last
    results."""
    if warmup:
        next(iter(ways.values()))(items[:2])
    rates: dict[str, list[float]] = {name: [] for name in ways}
    results = {}
    for _ in range(repeats):
        for name, fn in ways.items():
            start = time.perf_counter()
            results[name] = fn(items)
            rates[name].append(len(items) / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}, results


def server_overrides(args, batch: int) -> list[str]:
    """The servers' config: each replica's threads are the profile's reward.cpus_per_replica (1 by default; the
    realsize profiles: both cores)."""
    return [f"reward.backend={args.backend}", f"reward.max_batch_size={batch}", "reward.batch_wait_timeout_s=0.01",
            f"reward.num_replicas={args.replicas}", *args.overrides]


def serve(args, batch: int, log_path: Path) -> ServerProcess:
    return ServerProcess(server_overrides(args, batch), log_path=log_path).wait(timeout_s=600)


def compare(name: str, a: list[dict], b: list[dict]) -> tuple[float, int]:
    """Largest reward difference between two ways' results for the same items, and how many items differ."""
    by_id = {r["id"]: r["reward"] for r in b}
    diffs = [abs(r["reward"] - by_id[r["id"]]) for r in a]
    differing = sum(d > 0 for d in diffs)
    print(f"  rewards {name}: max |difference| {max(diffs):.2e}, {differing} of {len(diffs)} items differ")
    return max(diffs), differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="synthetic", choices=["cosyvoice2", "cosyvoice3", "synthetic"])
    parser.add_argument("--items", type=int, default=512)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="the server's dynamic batch (the reference: 32)")
    parser.add_argument("--tokens", type=int, default=40, help="speech tokens per item (25 a second)")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="items of lengths drawn from [min-tokens, tokens] (default: all of --tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per way (the median is reported)")
    parser.add_argument("--no-sequential", action="store_true", help="skip the batch-1 server")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="a 2-item call before the timed passes (--no-warmup: the real-size CPU smoke, where "
                             "each real-size item costs most of a minute and no figure is asserted)")
    parser.add_argument("--request-items", type=int, default=None,
                        help="items per client request (default: the training client's, see reward_fn)")
    parser.add_argument("--in-flight", type=int, default=None,
                        help="client requests in flight (default: the training client's, see reward_fn)")
    parser.add_argument("overrides", nargs="*", help="config overrides for the servers, e.g. exp_dir=exp/tiny")
    args = parser.parse_args()
    items = make_items(args.items, tokens=args.tokens, min_tokens=args.min_tokens)
    from grpo.config import load_config
    from grpo.train.reward_fn import reward_kwargs

    cfg = load_config(server_overrides(args, args.batch))
    client = reward_kwargs(cfg)["client"]
    args.request_items = args.request_items or client["max_items_per_request"]
    args.in_flight = args.in_flight or client["max_concurrency"]
    with tempfile.TemporaryDirectory() as tmp:
        server = serve(args, args.batch, Path(tmp) / "batched.log")
        try:
            rates, results = timed({"reference": lambda its: reference(server.url, its),
                                    "ours": lambda its: ours(server.url, its, args.request_items, args.in_flight)},
                                   items, args.repeats, args.warmup)
        finally:
            server.stop()
        if not args.no_sequential:
            server = serve(args, 1, Path(tmp) / "sequential.log")
            try:
                more_rates, more_results = timed({"sequential": lambda its: sequential(server.url, its)}, items,
                                                 args.repeats, args.warmup)
                rates.update(more_rates)
                results.update(more_results)
            finally:
                server.stop()
    for name, rate in rates.items():
        print(f"{name:10s} {rate:8.3f} samples/s")
    diff, differing = map(max, zip(*(compare(f"ours vs {name}", results["ours"], results[name])
                                     for name in results if name != "ours")))
    ratio = rates["ours"] / rates["reference"]
    print(f"ours / reference: {ratio:.2f}x")
    print(json.dumps({"backend": args.backend, "items": args.items, "replicas": args.replicas,
                      "reference_samples_per_s": round(rates["reference"], 3),
                      "sequential_samples_per_s": round(rates["sequential"], 3) if "sequential" in rates else None,
                      "ours_samples_per_s": round(rates["ours"], 3), "ratio_vs_reference": round(ratio, 3),
                      "max_reward_difference": diff, "items_with_different_rewards": differing,
                      "batch": args.batch, "request_items": args.request_items, "requests_in_flight": args.in_flight,
                      "tokens_per_item": args.tokens, "min_tokens_per_item": args.min_tokens,
                      "repeats": args.repeats, "warmup": args.warmup,
                      "cpus_per_replica": cfg.reward.cpus_per_replica}))


if __name__ == "__main__":
    main()
