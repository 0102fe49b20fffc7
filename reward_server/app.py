"""The Ray Serve application: validation, batching (@serve.batch), backend, scoring, metrics.

Run it with `bash run.sh 1 1` (stage 1, see reward_server/serve.py), or on an existing Ray cluster:
    serve run reward_server.app:app_builder overrides="profile=cosyvoice2 reward.num_replicas=4"
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from reward_server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from reward_server.protocol import Limits, RequestError, parse_request

log = logging.getLogger("reward_server")
api = FastAPI(title="cosyvoice-grpo reward server")


def limits_from(reward_cfg) -> Limits:
    lim = reward_cfg["limits"]
    return Limits(max_items_per_request=lim["max_items_per_request"], max_tokens_per_item=lim["max_tokens_per_item"],
                  max_text_chars=lim["max_text_chars"], max_request_bytes=lim["max_request_bytes"],
                  speech_token_size=reward_cfg["speech_token_size"])


@serve.deployment(logging_config={"enable_access_log": False})
@serve.ingress(api)
class RewardServer:
    def __init__(self, cfg: dict):
        from omegaconf import OmegaConf

        from reward_server.backends import build_backend

        conf = OmegaConf.create(cfg)
        r = conf.reward
        self.backend = build_backend(conf, device="cuda" if r.gpus_per_replica > 0 else "cpu")
        self.limits = limits_from(cfg["reward"])
        self.scoring = dict(mapping=r.scoring.mapping, scale=r.scoring.scale, ignore_tones=r.scoring.ignore_tones)
        self.auth_token = r.auth_token
        self.replica = f"{os.uname().nodename}:{os.getpid()}"
        self.metrics = ServerMetrics(self.replica, self.backend.name)
        self.score_batch.set_max_batch_size(r.max_batch_size)
        self.score_batch.set_batch_wait_timeout_s(r.batch_wait_timeout_s)
        log.info("reward replica %s ready: backend %s", self.replica, self.backend.name)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def score_batch(self, items: list) -> list:
        """Items of concurrent requests gathered into one backend call; errors go back to every caller."""
        from reward_server.backends import score

        start = time.perf_counter()

        def work():
            return score(items, self.backend.transcribe(items), **self.scoring)

        try:
            results = await asyncio.to_thread(work)
        except Exception as exc:  # reported per item as an internal error, never as a made-up reward
            log.exception("backend failed on a batch of %d items", len(items))
            self.metrics.failure("backend")
            return [exc] * len(items)
        self.metrics.batch(len(items), time.perf_counter() - start)
        return results

    def _check_auth(self, request: Request) -> None:
        if self.auth_token and request.headers.get("authorization") != f"Bearer {self.auth_token}":
            raise RequestError(401, "missing or wrong bearer token")

    @api.post("/score")
    async def score(self, request: Request):
        start = time.perf_counter()
        try:
            self._check_auth(request)
            declared = int(request.headers.get("content-length") or 0)
            if declared > self.limits.max_request_bytes:
                raise RequestError(413, f"request body of {declared} bytes exceeds the limit of "
                                        f"{self.limits.max_request_bytes}")
            items = parse_request(await request.body(), self.limits)
        except RequestError as exc:
            self.metrics.failure(f"client_{exc.status}")
            self.metrics.request(exc.status, time.perf_counter() - start)
            return JSONResponse(exc.body(), status_code=exc.status)
        in_flight = self.metrics.in_flight.labels(**self.metrics.labels)
        in_flight.inc(len(items))
        try:
            results = await asyncio.gather(*(self.score_batch(item) for item in items))
        finally:
            in_flight.dec(len(items))
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            self.metrics.request(500, time.perf_counter() - start)
            return JSONResponse({"error": "internal error while scoring", "detail": repr(errors[0])}, status_code=500)
        self.metrics.request(200, time.perf_counter() - start)
        return {"results": results}

    @api.get("/health")
    def health(self):
        return {"status": "ok", "backend": self.backend.name, "replica": self.replica, "pid": os.getpid()}

    @api.get("/metrics")
    def metrics_text(self):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def build_app(cfg):
    """A bound Serve application from the root config (OmegaConf)."""
    from omegaconf import OmegaConf

    r = cfg.reward
    deployment = RewardServer.options(
        num_replicas=r.num_replicas,
        max_ongoing_requests=r.max_ongoing_requests,
        ray_actor_options={"num_cpus": r.cpus_per_replica, "num_gpus": r.gpus_per_replica},
    )
    return deployment.bind(OmegaConf.to_container(cfg, resolve=True))


def app_builder(args: dict):
    """Entry for `serve run reward_server.app:app_builder overrides="key=value ..."`."""
    from grpo.config import load_config

    return build_app(load_config(str(args.get("overrides", "")).split()))
