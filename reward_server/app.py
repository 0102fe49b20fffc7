"""The Ray Serve application: validation, batching (@serve.batch), backend, scoring, metrics.

Run it with `bash run.sh 1 1` (stage 1, see reward_server/serve.py), or on an existing Ray cluster:
    serve run reward_server.app:app_builder overrides="profile=cosyvoice2 reward.num_replicas=4"
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
import uuid

import ray
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from grpo.node.memory import release_freed_memory
from reward_server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from reward_server.protocol import Limits, RequestError, parse_request

log = logging.getLogger("reward_server")
api = FastAPI(title="cosyvoice-grpo reward server")


def limits_from(reward_cfg) -> Limits:
    lim = reward_cfg["limits"]
    return Limits(max_items_per_request=lim["max_items_per_request"], max_tokens_per_item=lim["max_tokens_per_item"],
                  max_text_chars=lim["max_text_chars"], max_request_bytes=lim["max_request_bytes"],
                  speech_token_size=reward_cfg["speech_token_size"],
                  max_tokens_per_request=lim["max_tokens_per_request"], max_id_chars=lim["max_id_chars"])


def replica_threads(cpus_per_replica: float) -> int:
    """torch's intra-op threads in a replica: its CPU share, at least one. Ray sets OMP_NUM_THREADS to an actor's
    num_cpus only when the environment has none, so a node-wide OMP_NUM_THREADS (or torch's default, every core)
    would make replicas sharing a host fight over cores."""
    return max(1, int(cpus_per_replica))


class ItemFailure:
    """One item the backend could not score, alone (after bisection): reported with status "error"."""

    def __init__(self, kind: str, detail: str):
        self.kind, self.detail = kind, detail

    def as_result(self, item_id: str) -> dict:
        return {"id": item_id, "status": "error", "error": self.kind, "detail": self.detail}


@serve.deployment(logging_config={"enable_access_log": False})
@serve.ingress(api)
class RewardServer:
    def __init__(self, cfg: dict):
        from omegaconf import OmegaConf

        from reward_server.backends import build_backend

        conf = OmegaConf.create(cfg)
        r = conf.reward
        torch.set_num_threads(replica_threads(r.cpus_per_replica))
        self.backend = build_backend(conf, device="cuda" if r.gpus_per_replica > 0 else "cpu")
        release_freed_memory()
        self.limits = limits_from(cfg["reward"])
        from grpo.speech.components import RewardSpec

        self.scoring = dict(mapping=r.scoring.mapping, scale=r.scoring.scale, ignore_tones=r.scoring.ignore_tones,
                            spec=RewardSpec.from_config(r))
        self.auth_token = r.auth_token
        self.unhealthy_after = r.unhealthy_after_failures
        self.consecutive_failures = 0      # backend calls in a row that failed (reset by any success)
        self.sticky_fault_file = r.get("inject_sticky_fault_file")   # tests only: see inject_sticky_fault
        self.broken = False
        self.replica = f"{os.uname().nodename}:{os.getpid()}"
        self.node = ray.get_runtime_context().get_node_id()     # the Ray node (several may share a host name)
        self.metrics = ServerMetrics(self.replica, self.backend.name)
        self.score_batch.set_max_batch_size(r.max_batch_size)
        self.score_batch.set_batch_wait_timeout_s(r.batch_wait_timeout_s)
        log.info("reward replica %s ready: backend %s, %d torch threads", self.replica, self.backend.name,
                 torch.get_num_threads())

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def score_batch(self, items: list) -> list:
        """Items of concurrent requests gathered into one backend call; an item that fails gets an ItemFailure,
        the others their results (a failing batch is bisected until the failing items are alone)."""
        start = time.perf_counter()
        results = await asyncio.to_thread(self.score_isolating, items)
        release_freed_memory()
        self.metrics.batch(len(items), time.perf_counter() - start)
        return results

    def score_isolating(self, items: list) -> list:
        from reward_server.backends import score

        try:
            self.inject_sticky_fault()
            results = score(items, self.backend.transcribe(items), **self.scoring)
        except Exception as exc:
            self.consecutive_failures += 1
            if len(items) > 1:
                half = len(items) // 2
                return self.score_isolating(items[:half]) + self.score_isolating(items[half:])
            log.exception("backend failed on item %r", items[0].id)
            self.metrics.failure("backend")
            return [ItemFailure("backend", f"{type(exc).__name__}: {exc}"[:300])]
        self.consecutive_failures = 0
        return results

    def inject_sticky_fault(self) -> None:
        """Tests only (reward.inject_sticky_fault_file): the first replica that finds the file takes it and fails
        every call from then on, as a replica with a broken GPU would, until Serve replaces it."""
        if self.sticky_fault_file and not self.broken:
            try:
                os.remove(self.sticky_fault_file)
                self.broken = True
            except FileNotFoundError:
                pass
        if self.broken:
            raise RuntimeError("injected sticky fault")

    def healthy(self) -> bool:
        return self.consecutive_failures < self.unhealthy_after

    def check_health(self):
        """Serve calls this periodically; raising makes it replace the replica (a sticky backend failure)."""
        if not self.healthy():
            raise RuntimeError(f"{self.consecutive_failures} backend failures in a row")

    def _check_auth(self, request: Request) -> None:
        token = request.headers.get("authorization", "")
        if self.auth_token and not hmac.compare_digest(token.encode(), f"Bearer {self.auth_token}".encode()):
            raise RequestError(401, "missing or wrong bearer token")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it passes the limit: chunked bodies are not read whole first."""
        limit = self.limits.max_request_bytes
        try:
            declared = int(request.headers.get("content-length") or 0)
        except ValueError:
            raise RequestError(400, "Content-Length is not a number") from None
        if declared > limit:
            raise RequestError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestError(413, f"request body exceeds the limit of {limit} bytes")
        return bytes(body)

    @api.post("/score")
    async def score(self, request: Request):
        start = time.perf_counter()
        try:
            self._check_auth(request)
            items = parse_request(await self._read_body(request), self.limits)
        except RequestError as exc:
            self.metrics.failure(f"client_{exc.status}")
            self.metrics.request(exc.status, time.perf_counter() - start)
            return JSONResponse(exc.body(), status_code=exc.status)
        except Exception:   # reading or validating failed in a way no check names: a bug of ours, counted
            return self._internal_error("reading the request", start)
        in_flight = self.metrics.in_flight.labels(**self.metrics.labels)
        in_flight.inc(len(items))
        try:
            results = await asyncio.gather(*(self.score_batch(item) for item in items))
        except Exception:   # a bug of ours, not an item's: the traceback stays here, the caller gets an id
            return self._internal_error("scoring", start)
        finally:
            in_flight.dec(len(items))
        self.metrics.request(200, time.perf_counter() - start)
        return {"results": [r.as_result(it.id) if isinstance(r, ItemFailure)
                            else {**r, "status": "ok", "replica": self.replica, "node": self.node}
                            for it, r in zip(items, results)]}

    def _internal_error(self, during: str, start: float) -> JSONResponse:
        request_id = uuid.uuid4().hex[:12]
        log.exception("request %s failed while %s", request_id, during)
        self.metrics.failure("internal")
        self.metrics.request(500, time.perf_counter() - start)
        return JSONResponse({"error": "internal error", "request_id": request_id}, status_code=500)

    @api.get("/health")
    def health(self):
        body = {"status": "ok" if self.healthy() else "unhealthy", "backend": self.backend.name,
                "replica": self.replica, "node": self.node, "pid": os.getpid(),
                "consecutive_failures": self.consecutive_failures, "torch_threads": torch.get_num_threads()}
        return JSONResponse(body, status_code=200 if self.healthy() else 503)

    @api.get("/metrics")
    def metrics_text(self, request: Request):
        try:
            self._check_auth(request)
        except RequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def build_app(cfg):
    """A bound Serve application from the root config (OmegaConf)."""
    from omegaconf import OmegaConf

    r = cfg.reward
    deployment = RewardServer.options(
        num_replicas=r.num_replicas,
        max_ongoing_requests=r.max_ongoing_requests,
        health_check_period_s=r.health_check_period_s,
        ray_actor_options={"num_cpus": r.cpus_per_replica, "num_gpus": r.gpus_per_replica},
    )
    return deployment.bind(OmegaConf.to_container(cfg, resolve=True))


def app_builder(args: dict):
    """Entry for `serve run reward_server.app:app_builder overrides="key=value ..."`."""
    from grpo.config import load_config

    return build_app(load_config(str(args.get("overrides", "")).split()))
