"""Stage 1: start Ray (local, or `reward.ray_address`), serve the app on reward.host:reward.port,
and block until Ctrl-C / SIGTERM, then shut Serve and Ray down cleanly."""

from __future__ import annotations

import logging
import signal
import threading

from omegaconf import DictConfig

from grpo.config import REPO_ROOT

log = logging.getLogger("reward_server")
APP_NAME = "reward"


def start(cfg: DictConfig) -> None:
    import ray
    from ray import serve

    from reward_server.app import build_app

    r = cfg.reward
    address = r.get("ray_address") or "local"
    # on an existing cluster the replicas may land on other nodes: ship this repository's code with them
    runtime_env = None if address == "local" else {"working_dir": str(REPO_ROOT),
                                                   "excludes": [".venv", "exp", ".git", "outputs", "*.pt"]}
    ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=True,
             configure_logging=False, runtime_env=runtime_env)
    serve.start(http_options={"host": r.host, "port": r.port}, logging_config={"enable_access_log": False})
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)


def stop() -> None:
    import ray
    from ray import serve

    try:
        serve.delete(APP_NAME)       # only this application: others on a shared cluster keep running
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
        stop()
    return 0
