"""reward.gpus: the reward server on the node's last GPUs, training and evaluation on the rest
(grpo/node/gpu_layout.py).
No GPU here: the layout is checked where it is decided -- CUDA_VISIBLE_DEVICES per stage, the reward's local Ray
resources, verl's GPU count as CUDA would report it for the restricted list -- and a bad layout on the command line."""

import os
import subprocess
import sys

import pytest

from grpo.config import REPO_ROOT, load_config
from grpo.node.gpu_layout import LayoutError, apply, split

EIGHT = ",".join(str(i) for i in range(8))


def test_split_by_hand():
    gpus = [str(i) for i in range(8)]
    assert split(gpus, 2) == {"train": ["0", "1", "2", "3", "4", "5"], "reward": ["6", "7"]}
    assert split(["3", "5"], 1) == {"train": ["3"], "reward": ["5"]}       # the ids CUDA_VISIBLE_DEVICES names
    assert split(gpus, 0) == {"train": gpus, "reward": []}
    for bad in (8, 9, -1):
        with pytest.raises(LayoutError, match=f"reward.gpus={bad}: this node has 8 GPU.*may keep 1 to 7 of them"):
            split(gpus, bad)
    with pytest.raises(LayoutError, match=r"reward.gpus=1: this node has 1 GPU\(s\) \(0\): too few to split"):
        split(["0"], 1)


def test_each_stage_gets_its_part_of_the_node():
    cfg = load_config(["profile=cosyvoice2"])
    assert cfg.reward.gpus == 2 and cfg.reward.num_replicas * cfg.reward.gpus_per_replica <= cfg.reward.gpus
    parts = {}
    for stage in ("serve", "train", "evaluate", "models"):
        env = {"CUDA_VISIBLE_DEVICES": EIGHT}
        parts[stage] = (apply(cfg, stage, env), env["CUDA_VISIBLE_DEVICES"])
    assert parts["serve"] == (["6", "7"], "6,7")
    assert parts["train"] == parts["evaluate"] == (["0", "1", "2", "3", "4", "5"], "0,1,2,3,4,5")
    assert parts["models"] == (None, EIGHT)                         # stage -1 lays nothing out
    env = {"CUDA_VISIBLE_DEVICES": EIGHT}
    assert apply(load_config(["profile=cosyvoice2", "reward.gpus=0"]), "train", env) is None and env == {
        "CUDA_VISIBLE_DEVICES": EIGHT}                               # 0: every stage sees every GPU
    assert apply(load_config(["profile=realsize"]), "serve", env) is None          # a CPU run
    assert apply(cfg, "serve", {"CUDA_VISIBLE_DEVICES": ""}) is None    # no GPU at all: the device check speaks
    assert apply(load_config(["profile=cosyvoice2", "reward.ray_address=auto"]), "serve", env) is None


def test_replicas_that_do_not_fit_stop_in_one_line():
    cfg = load_config(["profile=cosyvoice2", "reward.num_replicas=5"])      # 5 x 0.5 > 2
    with pytest.raises(LayoutError, match=r"reward.num_replicas=5 x reward.gpus_per_replica=0.5 needs 2.5 GPUs"):
        apply(cfg, "serve", {"CUDA_VISIBLE_DEVICES": EIGHT})


def test_the_reward_ray_and_verl_see_their_parts(monkeypatch, tmp_path):
    """Stage 1's local Ray gets exactly the reward's GPUs; stage 2's verl command counts the training GPUs (6 of 8:
    torch.cuda.device_count() of the restricted list, simulated here) and a step of 48 x 8 samples divides over them."""
    from grpo.train import verl_launcher
    from reward_server.serve import local_resources

    cfg = load_config(["profile=cosyvoice2", f"exp_dir={tmp_path}"])      # the verl command creates train/
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", EIGHT)
    apply(cfg, "serve")
    assert local_resources(cfg) == {"num_gpus": 2}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", EIGHT)
    apply(cfg, "train")
    monkeypatch.setattr(verl_launcher, "visible_gpus", lambda: len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")))
    assert "trainer.n_gpus_per_node=6" in verl_launcher.build_overrides(cfg, cpu=False)
    verl_launcher.check_gpus(cfg.train)                    # 384 samples over 6 GPUs
    assert local_resources(load_config(["profile=realsize"])) == {}


def test_a_layout_the_node_cannot_give_stops_the_stage_in_one_line(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}
    out = subprocess.run([sys.executable, "-m", "grpo", "serve", "profile=cosyvoice2", f"exp_dir={tmp_path}"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("[grpo] reward.gpus=2: this node has 2 GPU(s) (0,1)"), out.stderr[-2000:]
    assert not list(tmp_path.iterdir())
