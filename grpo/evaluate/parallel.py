"""Stage 4 over several devices (`eval.data_parallel`): the items split round-robin into one shard per worker,
each worker a fresh process on one GPU (its own vLLM, token2wav and judges), the results merged back in the
single-process order. Each item keeps its seeds (they follow its index in the whole set, not in its shard), so
the per-item figures equal a single process's whatever the worker count.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def shards(n_items: int, workers: int) -> list[list[int]]:
    """Item indices round-robin over `workers` shards (lengths differ by one at most; neighbours, which a set
    often orders by length or speaker, spread over every worker). Empty shards are dropped."""
    return [list(range(w, n_items, workers)) for w in range(min(workers, n_items))]


def worker_count(e: DictConfig, device: str) -> int:
    """eval.data_parallel: `auto` is one worker per GPU this stage sees (one on a CPU); a number is taken as is."""
    wanted = e.get("data_parallel", 1)
    if wanted == "auto":
        if device != "cuda":
            return 1
        from grpo.node.gpu_layout import node_gpus

        return max(1, len(node_gpus()))
    if not isinstance(wanted, int) or wanted < 1:
        raise ValueError(f"eval.data_parallel must be auto or a number >= 1, got {wanted!r}")
    return wanted


def _evaluate_shard(cfg: dict, items: list, indices: list[int], gpu: str | None, checkpoints: dict) -> dict:
    """In a fresh worker process: one Evaluator on this shard (on `gpu` alone), every checkpoint."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu          # before CUDA is first touched in this process
    from grpo.config import setup_logging
    from grpo.evaluate.evaluator import Evaluator

    setup_logging()
    with Evaluator(OmegaConf.create(cfg), items, indices) as evaluator:
        return {"inputs": evaluator.inputs,
                "scored": {name: evaluator.evaluate(name, path) for name, path in checkpoints.items()}}


def evaluate_parallel(cfg: DictConfig, items: list, checkpoints: dict, workers: int) -> tuple[list, dict]:
    """(the model inputs in item order, {checkpoint: Scored list in the single-process order}) from `workers`
    processes; GPUs assigned one per worker from those this stage sees."""
    parts = shards(len(items), workers)
    gpus: list[str | None] = [None] * len(parts)
    if cfg.device == "cuda":
        from grpo.node.gpu_layout import node_gpus

        visible = node_gpus()
        if len(visible) < len(parts):
            raise ValueError(f"eval.data_parallel={len(parts)} workers, but {len(visible)} GPU(s) are visible")
        gpus = visible[:len(parts)]
    log.info("stage 4 on %d workers (%s), %s items each", len(parts), ", ".join(g or "cpu" for g in gpus),
             "/".join(str(len(p)) for p in parts))
    plain = OmegaConf.to_container(cfg, resolve=True)
    with ProcessPoolExecutor(len(parts), mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
        futures = [pool.submit(_evaluate_shard, plain, [items[i] for i in part], part, gpu, checkpoints)
                   for part, gpu in zip(parts, gpus)]
        done = [f.result() for f in futures]
    inputs: list = [None] * len(items)
    for part, out in zip(parts, done):
        for i, x in zip(part, out["inputs"]):
            inputs[i] = x
    merged = {}
    for name in checkpoints:
        by_key = {(s.id, s.sample): s for out in done for s in out["scored"][name]}
        merged[name] = [by_key[it.id, j] for j in range(cfg.eval.num_samples) for it in items]
    return inputs, merged
