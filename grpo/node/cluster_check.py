"""Before main_ppo joins an existing Ray cluster: does every node see what verl's workers will load there?

verl's workers open the model dir (actor, vLLM servers), the parquet files (its TaskRunner's dataloader) and
the agent-loop config by path, on whichever node Ray places them, and import this package (the repository is
on their `sys.path` as on the driver's). Nothing of that is shipped: the paths must exist on every node (a
shared filesystem, or the same copy at the same path, e.g. the Docker image plus a synced `exp/`). One task
pinned to each alive node looks; a missing path stops the launch naming the node and the path. What *is*
carried to every node: main_ppo's config (with the `grpo_decoding` node) and the CPU platform's environment
(`ray_kwargs.ray_init.runtime_env.env_vars`).
"""

from __future__ import annotations

import os


def missing_on_this_node(paths: list[str]) -> tuple[str, str, list[str]]:
    """(node id, host, the paths this node does not see)."""
    import ray

    return (ray.get_runtime_context().get_node_id(), os.uname().nodename, [p for p in paths if not os.path.exists(p)])


def join(address: str, **init_kwargs) -> None:
    """`ray.init` on the existing cluster at `address`; SystemExit in one line when it cannot be joined.

    Ray 2.60 gives a refused token (its head found ~/.ray/auth_token, which any `ray.init()` that started a
    local cluster writes) only as warnings and then the same ConnectionError as a head that is not there."""
    import ray

    try:
        ray.init(address=address, **init_kwargs)
    except ConnectionError as e:
        raise SystemExit(f"cannot join the Ray cluster at {address} ({e}): is its head running there? A head "
                         "started with Ray's token authentication (it is on once ~/.ray/auth_token exists) refuses "
                         "clients without it: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (or RAY_AUTH_TOKEN) "
                         "on every node and client as on the head (see docs/multi-node.md)") from None


def check_nodes(address: str, paths: list[str]) -> list[str]:
    """The ids of the alive nodes of the cluster at `address`, each checked for `paths`; SystemExit naming the
    first node and path missing."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    join(address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        probe = ray.remote(num_cpus=0)(missing_on_this_node)
        results = ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                           .remote(paths) for node in nodes])
    finally:
        ray.shutdown()
    for node, host, missing in results:
        if missing:
            raise SystemExit(f"Ray node {node} ({host}) does not see {missing[0]} (missing there: {missing}); "
                             "every node must see the model dir, data and repository at the same paths "
                             "(see docs/multi-node.md)")
    return [node for node, _, _ in results]
