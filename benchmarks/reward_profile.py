"""Where a reward item's time goes: one batched backend call against the same items one by one, per component.

The backend is the reward server's own (`reward_server.backends.build_backend`, the profile's models and prompt
speakers); its modules are timed with forward hooks and method wrappers, so nothing is re-implemented here.
Rows: the flow's text side (CosyVoice2's conformer encoder / CosyVoice3's look-ahead layer), the flow's estimator
(10 Euler steps with classifier-free guidance), HiFT, ASR (funasr's generate: front end + encoder + decoding)
and its encoder alone, the scoring (normalisation, pinyin, error rate), and the rest of the backend call
(speaker features, resampling, padding, glue). Medians of `--repeats` passes after a warm-up.

    .venv/bin/python benchmarks/reward_profile.py --items 8 --tokens 50 profile=realsize
    .venv/bin/python benchmarks/reward_profile.py --items 8 --tokens 50 profile=realsize3

Needs stage -1 of the profile. Prints a table; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from server_bench import make_items

ROWS = ("flow text side", "flow estimator", "hift", "asr (all)", "asr encoder", "scoring", "rest of backend")


class Clock:
    """Seconds spent inside each named call, summed until `reset`."""

    def __init__(self):
        self.spent: dict[str, float] = defaultdict(float)
        self._started: dict[str, list[float]] = defaultdict(list)

    def hook_module(self, name: str, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(lambda *_: self._started[name].append(time.perf_counter()))
        module.register_forward_hook(lambda *_: self._stop(name))

    def wrap_method(self, name: str, obj, attr: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            with self.span(name):
                return inner(*args, **kwargs)
        setattr(obj, attr, timed)

    @contextmanager
    def span(self, name: str):
        self._started[name].append(time.perf_counter())
        try:
            yield
        finally:
            self._stop(name)

    def _stop(self, name: str) -> None:
        self.spent[name] += time.perf_counter() - self._started[name].pop()

    def reset(self) -> dict[str, float]:
        spent, self.spent = dict(self.spent), defaultdict(float)
        return spent


def instrument(backend) -> Clock:
    """Hooks on the backend's token2wav and ASR modules."""
    clock = Clock()
    t2w = backend.token2wav
    text_side = t2w.flow.pre_lookahead_layer if t2w.dit else t2w.flow.encoder
    clock.hook_module("flow text side", text_side)
    clock.hook_module("flow estimator", t2w.flow.decoder.estimator)
    clock.wrap_method("hift", t2w.hift, "inference")
    clock.wrap_method("asr (all)", backend.asr.model, "generate")
    clock.hook_module("asr encoder", backend.asr.model.model.encoder)
    return clock


def one_pass(backend, clock: Clock, items: list, batched: bool, scoring: dict) -> dict[str, float]:
    from reward_server.backends import score

    groups = [items] if batched else [[it] for it in items]
    start = time.perf_counter()
    for group in groups:
        with clock.span("backend"):
            transcripts = backend.transcribe(group)
        with clock.span("scoring"):
            score(group, transcripts, **scoring)
    spent = clock.reset()
    spent["total"] = time.perf_counter() - start
    inner = sum(spent.get(k, 0.0) for k in ("flow text side", "flow estimator", "hift", "asr (all)"))
    spent["rest of backend"] = spent.pop("backend") - inner
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=50, help="speech tokens per item (25 a second)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="items of lengths drawn from [min-tokens, tokens] (default: all of --tokens)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: a reward replica's, reward.cpus_per_replica)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. profile=realsize")
    args = parser.parse_args()
    from grpo.config import load_config
    from grpo.speech.components import RewardSpec
    from reward_server.app import replica_threads
    from reward_server.backends import ScoreItem, build_backend

    cfg = load_config(args.overrides)
    torch.set_num_threads(args.threads or replica_threads(cfg.reward.cpus_per_replica))
    r = cfg.reward
    backend = build_backend(cfg, device="cpu")
    scoring = dict(mapping=r.scoring.mapping, scale=r.scoring.scale, ignore_tones=r.scoring.ignore_tones,
                   spec=RewardSpec.from_config(r))
    clock = instrument(backend)
    made = make_items(args.items, tokens=args.tokens, min_tokens=args.min_tokens)
    items = [ScoreItem(it["id"], tuple(it["tokens"]), it["text"]) for it in made]
    one_pass(backend, clock, items[:2], True, scoring)          # warm-up
    runs = {"batched": [], "one by one": []}
    for _ in range(args.repeats):
        for way in runs:                                         # interleaved, so drift hits both alike
            runs[way].append(one_pass(backend, clock, items, way == "batched", scoring))
    table = {way: {row: statistics.median(p.get(row, 0.0) for p in passes) for row in (*ROWS, "total")}
             for way, passes in runs.items()}
    n = len(items)
    print(f"{backend.name}, {n} items of {args.tokens} tokens, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}; seconds per item")
    print(f"{'':18s} {'batched':>9s} {'one by one':>11s} {'ratio':>7s}")
    for row in (*ROWS, "total"):
        b, s = table["batched"][row] / n, table["one by one"][row] / n
        print(f"{row:18s} {b:9.3f} {s:11.3f} {b / s if s else float('nan'):7.2f}")
    per_item = {way: {k: round(v / n, 4) for k, v in t.items()} for way, t in table.items()}
    print(json.dumps({"backend": backend.name, "items": n, "tokens_per_item": args.tokens,
                      "min_tokens_per_item": args.min_tokens, "threads": torch.get_num_threads(),
                      "repeats": args.repeats, "seconds_per_item": per_item}))


if __name__ == "__main__":
    main()
