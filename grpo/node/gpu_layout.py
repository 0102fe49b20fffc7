"""Which of a node's GPUs each stage of the one-command run uses (`reward.gpus`).

With `reward.gpus: k` (> 0) the reward server keeps the last k GPUs of the node (of CUDA_VISIBLE_DEVICES, or of
every GPU nvidia-smi lists) for its replicas, and training (verl's `n_gpus_per_node: auto` then counts the
others) and evaluation get the rest, so that the rank-0 actor, vLLM and the reward models never share a device.
Each stage restricts its own process (and so the Ray workers it starts) with CUDA_VISIBLE_DEVICES before CUDA is
first touched. `reward.gpus: 0` shares every GPU (the replicas then land where Ray puts them). The layout
applies to one node; on a Ray cluster of several, place the reward server with `reward.ray_address` instead.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

# stage -> the part of the node it runs on
PARTS = {"serve": "reward", "train": "train", "evaluate": "train"}


class LayoutError(SystemExit):
    """A layout the node cannot give; its message is the one line a user sees."""


def node_gpus(environ: dict | None = None) -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else every GPU nvidia-smi lists (without
    initialising CUDA, which would fix torch's view before the layout restricts it)."""
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    from grpo.node.device import query_gpus

    return query_gpus("index")


def split(gpus: list[str], reward_gpus: int) -> dict[str, list[str]]:
    """{"train": the first len(gpus) - reward_gpus GPUs, "reward": the last reward_gpus}."""
    if not 0 <= reward_gpus < len(gpus):
        have = f"reward.gpus={reward_gpus}: this node has {len(gpus)} GPU(s) ({','.join(gpus)})"
        if len(gpus) < 2:
            raise LayoutError(f"{have}: too few to split; set reward.gpus=0 (every stage shares them)")
        raise LayoutError(f"{have}; the reward server may keep 1 to {len(gpus) - 1} of them and leave the rest "
                          "to training, or 0 to share them all")
    cut = len(gpus) - reward_gpus
    return {"train": gpus[:cut], "reward": gpus[cut:]}


def check_replicas(r: DictConfig) -> None:
    """The replicas must fit on the reward's GPUs: num_replicas x gpus_per_replica <= reward.gpus."""
    need = r.num_replicas * r.gpus_per_replica
    if need > r.gpus:
        raise LayoutError(f"reward.num_replicas={r.num_replicas} x reward.gpus_per_replica={r.gpus_per_replica} "
                          f"needs {need:g} GPUs, but reward.gpus={r.gpus}; lower the replicas or give a replica "
                          "a fraction of a GPU (gpus_per_replica: 0.5 puts two on each)")


def apply(cfg: DictConfig, stage: str, environ: dict | None = None) -> list[str] | None:
    """Restrict this process to its stage's part of the node (sets CUDA_VISIBLE_DEVICES); returns that part, or
    None when no layout applies (reward.gpus 0, a CPU run, a stage that uses no GPU, a remote reward cluster)."""
    environ = os.environ if environ is None else environ
    r = cfg.reward
    if not r.get("gpus") or cfg.get("device") == "cpu" or stage not in PARTS:
        return None
    if stage == "serve" and r.get("ray_address"):
        return None
    gpus = node_gpus(environ)
    if not gpus:          # no GPU at all: the device check that follows says so (device=cuda) or the run is CPU
        return None
    check_replicas(r)
    part = split(gpus, int(r.gpus))[PARTS[stage]]
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(part)
    return part
