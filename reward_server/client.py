"""Async client for the reward server, used by training (grpo.train.reward_fn).

verl calls the reward function once per response, concurrently. `score_one` gathers the calls made
within `batch_wait_s` into one POST (up to `max_items_per_request` items), so a step's responses reach
the server as a few requests that fill its @serve.batch batches instead of hundreds of tiny ones.
Connection errors and 5xx answers are retried with exponential backoff; after the last retry the
callers get RewardServerError: there is never a silent 0.0. A 4xx names the bad items: those callers
get RewardRequestError and the rest of the request is sent again without them; a request over the
server's size limits (413) is split in halves.
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
    batch_wait_s: float = 0.005
    max_items_per_request: int = 256


class _LoopState:
    """What belongs to one event loop: the connection pool, the concurrency bound, the pending batch."""

    def __init__(self, config: ClientConfig):
        headers = {"Authorization": f"Bearer {config.auth_token}"} if config.auth_token else {}
        limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
        self.http = httpx.AsyncClient(base_url=config.url, timeout=config.timeout_s, headers=headers, limits=limits)
        self.semaphore = asyncio.Semaphore(config.max_concurrency)
        self.pending: list[tuple[dict, asyncio.Future]] = []
        self.flusher: asyncio.TimerHandle | None = None


class RewardClient:
    def __init__(self, config: ClientConfig):
        self.config = config
        self.retries_made = 0      # retried POSTs since creation (all loops), for logs and tests
        # httpx clients are bound to the loop they were made in; verl may call from several loops
        self._loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            self._loops[loop] = _LoopState(self.config)
        return self._loops[loop]

    async def score(self, items: list[dict]) -> list[dict]:
        """One POST /score with retries; returns the results in input order."""
        state = self._state()
        last_error = "no attempt"
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.retries_made += 1
                delay = self.config.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
                log.warning("reward server: %s; retry %d/%d in %.1f s", last_error, attempt, self.config.retries, delay)
                await asyncio.sleep(delay)
            try:
                async with state.semaphore:
                    resp = await state.http.post("/score", json={"items": items})
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
        """Score one item, sent together with the other items requested within batch_wait_s."""
        state = self._state()
        future = asyncio.get_running_loop().create_future()
        state.pending.append((item, future))
        if len(state.pending) >= self.config.max_items_per_request:
            self._flush(state)
        elif state.flusher is None:
            state.flusher = asyncio.get_running_loop().call_later(self.config.batch_wait_s, self._flush, state)
        return await future

    def _flush(self, state: _LoopState) -> None:
        if state.flusher is not None:
            state.flusher.cancel()
            state.flusher = None
        batch, state.pending = state.pending, []
        if batch:
            asyncio.get_running_loop().create_task(self._send(batch))

    async def _send(self, batch: list[tuple[dict, asyncio.Future]]) -> None:
        while batch:
            try:
                results = await self.score([item for item, _ in batch])
            except RewardRequestError as exc:
                if exc.status == 413 and len(batch) > 1:       # over the server's size limits: halve
                    half = len(batch) // 2
                    await asyncio.gather(self._send(batch[:half]), self._send(batch[half:]))
                    return
                bad = {p.get("item") for p in (exc.body.get("problems", []) if isinstance(exc.body, dict) else [])}
                if not bad or None in bad:
                    self._fail(batch, exc)
                    return
                self._fail([b for i, b in enumerate(batch) if i in bad], exc)
                batch = [b for i, b in enumerate(batch) if i not in bad]   # send the good ones again
                continue
            except Exception as exc:                                     # RewardServerError and the like
                self._fail(batch, exc)
                return
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
            return

    @staticmethod
    def _fail(batch, exc: Exception) -> None:
        for _, future in batch:
            if not future.done():
                future.set_exception(exc)

    async def aclose(self) -> None:
        state = self._loops.pop(asyncio.get_running_loop(), None)
        if state is not None:
            await state.http.aclose()
