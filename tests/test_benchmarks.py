"""The benchmarks run as CI smokes: their JSON lines and the agreement checks (timings are not asserted:
they depend on the machine)."""

import json
import subprocess
import sys

import pytest

from grpo.config import REPO_ROOT


def run_benchmark(*args: str) -> dict:
    out = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.server
def test_server_benchmark_three_ways_agree(tiny_exp):
    """benchmarks/server_bench.py: the reference's way, sequential and ours score the same items identically
    and its last line is the JSON the README quotes."""
    result = run_benchmark("benchmarks/server_bench.py", "--backend", "synthetic", "--items", "64", "--replicas", "2",
                           f"exp_dir={tiny_exp}")
    assert {"backend", "items", "replicas", "reference_samples_per_s", "sequential_samples_per_s",
            "ours_samples_per_s", "ratio_vs_reference"} <= set(result)
    assert result["items"] == 64 and result["replicas"] == 2 and result["max_reward_difference"] == 0


def test_gpu_reward_benchmark_smoke_on_cpu():
    """benchmarks/gpu_reward.py at the real model sizes, two short items on this CPU."""
    result = run_benchmark("benchmarks/gpu_reward.py", "--items", "2", "--tokens", "25", "--prompt-tokens", "25",
                           "--repeats", "1", "--device", "cpu")
    assert result["device"] == "cpu" and result["items"] == 2
    for mode in ("batch1_float32", "batched_float32"):
        assert result[mode]["samples_per_s"] > 0 and result[mode]["peak_gib"] > 1     # real sizes: GiBs
