"""Reward failures and components from every node reach the head node's logs (grpo.train.reward_ledger), on a
two-node Ray cluster started on this machine (two raylets, ray.cluster_utils.Cluster). One machine shares one
filesystem, so where a line was written is asserted from Ray's own node ids, stamped by the writer."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    worker = cluster.add_node(num_cpus=1, resources={"second_node": 1})
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield ray, worker.node_id
    ray.shutdown()
    cluster.shutdown()


def test_a_failure_and_components_on_the_other_node_are_written_on_the_head_node(two_nodes, tmp_path):
    from conftest import free_port
    from grpo.train import verl_watch

    ray, worker_node = two_nodes
    failures, components = tmp_path / "reward_failures.jsonl", tmp_path / "reward_components.jsonl"

    @ray.remote(num_cpus=0, resources={"second_node": 1})
    def reward_worker(port):
        import asyncio

        from grpo.train.reward_fn import compute_score
        from reward_server.client import RewardServerError

        kwargs = {"client": {"url": f"http://127.0.0.1:{port}", "retries": 0, "retry_budget_s": 1.0, "timeout_s": 2.0},
                  "failure_log": str(failures), "component_log": str(components)}
        # a response without speech: scored without the server, its components logged under its step
        asyncio.run(compute_score("cosyvoice2_tts", "no speech", "今天", {"sample_id": "quiet", "global_steps": 3},
                                  **kwargs))
        try:   # the server cannot be reached: the reward fails after the client's retries
            asyncio.run(compute_score("cosyvoice2_tts", "<|s_1|><|s_2|>", "今天", {"sample_id": "lost-7"}, **kwargs))
        except RewardServerError:
            return ray.get_runtime_context().get_node_id()
        return None

    ran_on = ray.get(reward_worker.remote(free_port()))
    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "second_node" not in n["Resources"])
    assert ran_on == worker_node != head
    (failure,) = [json.loads(x) for x in failures.read_text().splitlines()]
    assert failure["id"] == "lost-7" and failure["node_id"] == worker_node and failure["written_on"] == head
    (line,) = [json.loads(x) for x in components.read_text().splitlines()]
    assert line["step"] == 3 and line["sample_id"] == "quiet" and line["written_on"] == head

    # the launcher, watching its own node's file, stops the run on that other node's failure
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert verl_watch.watch(sleeper, failures, timeout_s=60) == 1
    finally:
        verl_watch.kill_tree(sleeper, str(tmp_path / "no-ray"))
