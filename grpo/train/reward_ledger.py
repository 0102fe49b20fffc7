"""One writer, on the head node, for the reward failure and component logs of every node.

verl 0.9.1 spreads its reward workers over all nodes (verl/experimental/reward_loop/reward_loop.py), while the
launcher watches `reward.failure_log` and reads `reward.component_log` on the node it runs on. So inside a Ray
cluster compute_score does not append to its own node's disk: it sends each line to one named actor pinned
to the head node by Ray's head-node resource (`node:__internal_head__`, as Ray Train's own state actor is
placed), and that actor appends it there, stamping the writer's and its own node ids. No shared filesystem is
needed. Outside Ray (the local engine, plain calls) the line is appended directly, as before.
"""

from __future__ import annotations

import json

LEDGER_NAME = "grpo_reward_ledger"
HEAD_NODE_RESOURCE = "node:__internal_head__"   # ray/_common/constants.py: HEAD_NODE_RESOURCE_NAME (Ray 2.60)


def append_line(path: str, record: dict) -> None:
    """One JSON line, appended in a single write (several reward workers append to the same file)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _ledger_class():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=64)
    class RewardLedger:
        def append(self, path: str, record: dict) -> str:
            node = ray.get_runtime_context().get_node_id()
            append_line(path, {**record, "written_on": node})
            return node

    return RewardLedger


def ledger():
    """The cluster's ledger actor (created on first use, on the head node), or None outside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return None
    return _ledger_class().options(name=LEDGER_NAME, get_if_exists=True,
                                   resources={HEAD_NODE_RESOURCE: 0.001}).remote()


async def record(path: str | None, line: dict) -> None:
    """Append `line` to `path` on the head node (through the ledger inside Ray, directly outside it)."""
    if not path:
        return
    actor = ledger()
    if actor is None:
        append_line(path, line)
        return
    import ray

    await actor.append.remote(path, {**line, "node_id": ray.get_runtime_context().get_node_id()})
