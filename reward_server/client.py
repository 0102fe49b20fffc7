"""Async client for the reward server, used by training (grpo.reward_fn).

Concurrent calls share one connection pool per event loop, a semaphore bounds them, timeouts apply,
and connection errors or 5xx answers are retried with exponential backoff. After the last retry it
raises RewardServerError: there is never a silent 0.0.
"""

from __future__ import annotations

import asyncio
import logging
import random
import weakref
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)


class RewardServerError(RuntimeError):
    """The server could not score (unreachable, or failing) after every retry."""


class RewardRequestError(RewardServerError):
    """The server rejected the request (4xx): a bug in the caller, never retried."""

    def __init__(self, status: int, body):
        self.status, self.body = status, body
        super().__init__(f"reward server rejected the request with HTTP {status}: {body}")


@dataclass
class ClientConfig:
    url: str
    timeout_s: float = 120.0
    retries: int = 5
    backoff_s: float = 0.5
    max_concurrency: int = 64
    auth_token: str | None = None


class RewardClient:
    def __init__(self, config: ClientConfig):
        self.config = config
        self._http: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _session(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        # httpx clients are bound to the loop they were made in; verl may call from several loops
        key = asyncio.get_running_loop()
        if key not in self._http:
            headers = {"Authorization": f"Bearer {self.config.auth_token}"} if self.config.auth_token else {}
            limits = httpx.Limits(max_connections=self.config.max_concurrency,
                                  max_keepalive_connections=self.config.max_concurrency)
            self._http[key] = (httpx.AsyncClient(base_url=self.config.url, timeout=self.config.timeout_s,
                                                 headers=headers, limits=limits),
                               asyncio.Semaphore(self.config.max_concurrency))
        return self._http[key]

    async def score(self, items: list[dict]) -> list[dict]:
        """POST /score with retries; returns the results in input order."""
        http, semaphore = self._session()
        last_error = "no attempt"
        for attempt in range(self.config.retries + 1):
            if attempt:
                delay = self.config.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
                log.warning("reward server: %s; retry %d/%d in %.1f s", last_error, attempt, self.config.retries, delay)
                await asyncio.sleep(delay)
            try:
                async with semaphore:
                    resp = await http.post("/score", json={"items": items})
            except httpx.TransportError as exc:   # connection refused/reset, timeouts
                last_error = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code == 200:
                results = resp.json()["results"]
                if len(results) != len(items):
                    raise RewardServerError(f"server returned {len(results)} results for {len(items)} items")
                return results
            if resp.status_code >= 500:
                last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            try:
                body = resp.json()
            except ValueError:
                body = resp.text
            raise RewardRequestError(resp.status_code, body)
        raise RewardServerError(f"reward server at {self.config.url} failed after {self.config.retries} retries "
                                f"(last: {last_error})")

    async def score_one(self, item: dict) -> dict:
        return (await self.score([item]))[0]

    async def aclose(self) -> None:
        session = self._http.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session[0].aclose()
