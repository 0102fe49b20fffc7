"""Stage 1: start Ray (local, or `reward.ray_address`), serve the app on reward.host:reward.port,
and block until Ctrl-C / SIGTERM, then shut Serve and Ray down cleanly."""

from __future__ import annotations

import logging
import os
import signal
import threading

from omegaconf import DictConfig

from grpo.config import REPO_ROOT
from grpo.node import cluster_check

log = logging.getLogger("reward_server")
APP_NAME = "reward"


def start(cfg: DictConfig) -> None:
    import ray

    r = cfg.reward
    address = r.get("ray_address") or "local"
    # on an existing cluster the replicas may land on other nodes: ship this repository's code with them
    runtime_env = None if address == "local" else {"working_dir": str(REPO_ROOT),
                                                   "excludes": [".venv", "exp", ".git", "outputs", "*.pt"]}
    if address == "local":
        # a Ray of its own shares the machine with training: its OOM killer (95 % of the node by default) would
        # take the replica for memory that main_ppo holds (seen in a real-size CPU run); the kernel's limit rules
        os.environ.setdefault("RAY_memory_usage_threshold", "0.98")
    init_kwargs = dict(include_dashboard=False, logging_level="WARNING", log_to_driver=True, configure_logging=False,
                       runtime_env=runtime_env)
    if address == "local":
        ray.init(address=address, **local_resources(cfg), **init_kwargs)
    else:
        cluster_check.join(address, **init_kwargs)
    deploy(cfg)


def local_resources(cfg: DictConfig) -> dict:
    """The local Ray's GPUs under a layout (reward.gpus: the stage already restricted CUDA_VISIBLE_DEVICES to the
    reward's part, grpo/node/gpu_layout.py): exactly those, so that the replicas' placement is Ray's to check."""
    if not cfg.reward.get("gpus") or cfg.get("device") == "cpu":
        return {}
    from grpo.node.gpu_layout import node_gpus

    return {"num_gpus": len(node_gpus())}


class ServeConflict(RuntimeError):
    """Serve already runs on the cluster with other HTTP options and other applications."""


def running_http_options() -> tuple[str, int] | None:
    """(host, port) of the Serve instance already running on the connected cluster, or None.

    Serve has no public getter; this reads the controller client's `http_config`
    (ray/serve/_private/client.py, ray 2.60.0), which `serve.start` itself compares against
    (ray/serve/_private/api.py `_check_http_options`: it only logs "The new HTTP config is ignored")."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    http = client.http_config
    return http.host, http.port


def deploy(cfg: DictConfig) -> None:
    """serve.start with reward.host/port, then this application. A running Serve instance keeps the HTTP
    options it was started with (serve.start silently ignores new ones): if they differ, Serve is restarted
    with ours when no other application runs there, and otherwise we stop with the options and the apps."""
    from ray import serve

    from reward_server.app import build_app

    r = cfg.reward
    wanted = (r.host, int(r.port))
    running = running_http_options()
    if running is not None and running != wanted:
        others = sorted(set(serve.status().applications) - {APP_NAME})
        if others:
            raise ServeConflict(
                f"Ray Serve already runs on this cluster at {running[0]}:{running[1]} with application(s) "
                f"{others}; its HTTP options cannot change without stopping them. Set reward.host={running[0]} "
                f"reward.port={running[1]} (and reward.url to match) to serve beside them, or stop Serve first.")
        log.warning("Serve was running at %s:%s with no other application: restarting it at %s:%s",
                    *running, *wanted)
        serve.shutdown()
    serve.start(http_options={"host": r.host, "port": r.port}, logging_config={"enable_access_log": False})
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)


def stop(cfg: DictConfig) -> None:
    """On a cluster of our own (reward.ray_address unset) Ray's shutdown ends Serve with it: deleting the
    application first would only wait out its replicas' graceful stop (~3 s here). On a shared cluster only this
    application is deleted; other applications keep running."""
    import ray
    from ray import serve

    try:
        if cfg.reward.get("ray_address") and ray.is_initialized():
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()


def run(cfg: DictConfig) -> int:
    stop_event = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop_event.set())
    log.info("starting reward server: backend %s on %s", cfg.reward.backend, cfg.reward.url)
    try:
        start(cfg)
        log.info("reward server ready at %s (GET /health, GET /metrics, POST /score); Ctrl-C stops it",
                 cfg.reward.url)
        stop_event.wait()
        log.info("stopping reward server")
    finally:
        stop(cfg)
    return 0
