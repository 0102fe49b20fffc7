"""Async client for the reward server, used by training (grpo.train.reward_fn).

verl calls the reward function once per response, concurrently. `score_one` gathers the calls made
within `batch_wait_s` into POSTs of up to `max_items_per_request` items (and spread over at least
`max_concurrency` POSTs when there are that many items), at most `max_concurrency` of them in flight: a step's
responses reach the server as a stream of small requests that the server's @serve.batch joins into full
batches, each routed to a replica as earlier ones complete. (A burst of
requests sent at once is routed before any replica's queue grows: measured, all of them can land on
one replica while the others idle.)
Connection errors, 5xx, 429 and 503 answers, Serve's 404 while the application is not yet deployed, and items
the server reports as failed (status "error") are retried with exponential backoff and jitter until
`retry_budget_s` has passed (long enough to ride out a replica restart) or `retries` attempts were made; then
those callers -- and only those -- get RewardServerError: there is never a silent 0.0. A 4xx names the bad
items: those callers get RewardRequestError and the rest of the request is sent again without them; a request
over the server's size limits (413) is split in halves. A request's read timeout is `timeout_s` or, once requests
have been answered, `timeout_factor` times the slowest of them, whichever is longer (`request_timeout`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import weakref
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)


class RewardServerError(RuntimeError):
    """The server could not score (unreachable, or failing) after every retry."""


def serve_not_routed_yet(resp: httpx.Response) -> bool:
    """Ray Serve's proxy is up but the reward application is not (yet) deployed on it -- a server (re)starting on
    the same port: its 404 "Path '/score' not found. Ping http://.../-/routes for available routes." (ray 2.60.0,
    ray/serve/_private/proxy.py). Transient, unlike a 404 of the application itself."""
    return resp.status_code == 404 and "/-/routes for available routes" in resp.text


class RewardRequestError(RewardServerError):
    """The server rejected the request (4xx): a bug in the caller, never retried."""

    def __init__(self, status: int, body):
        self.status, self.body = status, body
        super().__init__(f"reward server rejected the request with HTTP {status}: {body}")


@dataclass
class ClientConfig:
    url: str
    timeout_s: float = 120.0          # a request's read timeout, at least; it grows with the measured time:
    timeout_factor: float = 4.0       # ... to this many times the slowest request answered so far
    retries: int | None = None        # at most this many retries (None: as many as the budget allows)
    backoff_s: float = 0.5
    retry_budget_s: float = 120.0     # stop retrying this long after the first attempt
    max_backoff_s: float = 10.0
    max_concurrency: int = 8            # requests in flight (grpo.train.reward_fn: 4 per replica)
    auth_token: str | None = None
    batch_wait_s: float = 0.005
    max_items_per_request: int = 8      # a quarter of the server's reward.max_batch_size


class _LoopState:
    """What belongs to one event loop: the connection pool, the concurrency bound, the pending batch."""

    def __init__(self, config: ClientConfig):
        headers = {"Authorization": f"Bearer {config.auth_token}"} if config.auth_token else {}
        limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
        self.http = httpx.AsyncClient(base_url=config.url, timeout=config.timeout_s, headers=headers, limits=limits)
        self.semaphore = asyncio.Semaphore(config.max_concurrency)
        self.pending: list[tuple[dict, asyncio.Future]] = []
        self.tasks: set[asyncio.Task] = set()
        self.flusher: asyncio.TimerHandle | None = None


def request_parts(n: int, max_items: int, slots: int) -> list[slice]:
    """`n` items gathered together, cut into requests of at most `max_items`, and into at least `slots` requests
    (the requests in flight) when there are that many items: a small burst is spread over every slot, so that
    several replicas share it (one request of 8 items goes to one replica while the others idle; the server's
    dynamic batching joins the small requests that reach the same replica again). Sizes differ by one at most."""
    count = min(n, max(-(-n // max_items), slots))
    size, extra = divmod(n, count) if count else (0, 0)
    parts, start = [], 0
    for k in range(count):
        stop = start + size + (k < extra)
        parts.append(slice(start, stop))
        start = stop
    return parts


class RewardClient:
    def __init__(self, config: ClientConfig):
        self.config = config
        self.retries_made = 0      # retried POSTs since creation (all loops), for logs and tests
        self.slowest_s = 0.0       # the slowest answered request so far (queue + batch), all loops
        # httpx clients are bound to the loop they were made in; verl may call from several loops
        self._loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            self._loops[loop] = _LoopState(self.config)
        return self._loops[loop]

    def request_timeout(self) -> float:
        """The read timeout of the next request: timeout_s, or timeout_factor x the slowest request answered so far
        if that is longer -- sized from what this run measures (a larger model, a longer queue, a slower GPU), not
        from a guess. A request that never answers still ends: the first ones wait timeout_s at most."""
        return max(self.config.timeout_s, self.config.timeout_factor * self.slowest_s)

    def _measured(self, seconds: float) -> None:
        before = self.request_timeout()
        self.slowest_s = max(self.slowest_s, seconds)
        if self.request_timeout() >= 2 * before:
            log.info("reward server: a request took %.1f s; the client's timeout is now %.0f s "
                     "(reward.client.timeout_factor x the slowest)", seconds, self.request_timeout())

    def _retry_allowed(self, attempt: int, started: float) -> bool:
        if self.config.retries is not None and attempt > self.config.retries:
            return False
        return time.monotonic() - started < self.config.retry_budget_s

    async def _backoff(self, attempt: int, why: str) -> None:
        self.retries_made += 1
        delay = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** (attempt - 1)) * (0.5 + random.random())
        log.warning("reward server: %s; retry %d in %.1f s", why, attempt, delay)
        await asyncio.sleep(delay)

    async def score(self, items: list[dict]) -> list[dict]:
        """POST /score with retries; returns the results in input order. Items the server failed on are sent
        again; if they still fail when the retries run out, their results carry status "error"."""
        state = self._state()
        results: list[dict | None] = [None] * len(items)
        todo = list(range(len(items)))
        started, attempt, last_error = time.monotonic(), 0, "no attempt"
        while True:
            if attempt:
                if not self._retry_allowed(attempt, started):
                    break
                await self._backoff(attempt, last_error)
            attempt += 1
            try:
                async with state.semaphore:
                    sent = time.monotonic()
                    resp = await state.http.post("/score", json={"items": [items[i] for i in todo]},
                                                 timeout=httpx.Timeout(self.request_timeout(), connect=10.0))
                    if resp.status_code == 200:
                        self._measured(time.monotonic() - sent)
            except httpx.TransportError as exc:   # connection refused/reset, timeouts
                last_error = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code == 200:
                answer = resp.json()["results"]
                if len(answer) != len(todo):
                    raise RewardServerError(f"server returned {len(answer)} results for {len(todo)} items")
                for i, result in zip(todo, answer):
                    results[i] = result
                failed = [(i, result) for i, result in zip(todo, answer) if result.get("status", "ok") != "ok"]
                if not failed:
                    return results
                todo = [i for i, _ in failed]
                last_error = f"{len(todo)} item(s) failed on the server ({failed[0][1].get('detail', '')[:100]})"
                continue
            if resp.status_code >= 500 or resp.status_code == 429 or serve_not_routed_yet(resp):
                last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            try:
                body = resp.json()
            except ValueError:
                body = resp.text
            raise RewardRequestError(resp.status_code, body)
        if all(r is None for r in results):
            raise RewardServerError(f"reward server at {self.config.url} failed after {attempt - 1} retries "
                                    f"(last: {last_error})")
        return [r if r is not None else {"id": items[i].get("id"), "status": "error", "error": "unanswered",
                                         "detail": last_error} for i, r in enumerate(results)]

    async def score_one(self, item: dict) -> dict:
        """Score one item, sent together with the other items requested within batch_wait_s."""
        state = self._state()
        future = asyncio.get_running_loop().create_future()
        state.pending.append((item, future))
        if len(state.pending) >= self.config.max_items_per_request * self.config.max_concurrency:
            self._flush(state)       # enough for every request slot at its largest: no need to wait
        elif state.flusher is None:
            state.flusher = asyncio.get_running_loop().call_later(self.config.batch_wait_s, self._flush, state)
        return await future

    def _flush(self, state: _LoopState) -> None:
        if state.flusher is not None:
            state.flusher.cancel()
            state.flusher = None
        batch, state.pending = state.pending, []
        for part in request_parts(len(batch), self.config.max_items_per_request, self.config.max_concurrency):
            task = asyncio.get_running_loop().create_task(self._send(batch[part]))
            state.tasks.add(task)                       # keep a reference until it is done
            task.add_done_callback(state.tasks.discard)

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
            for (item, future), result in zip(batch, results):
                if future.done():
                    continue
                if result.get("status", "ok") == "ok":
                    future.set_result(result)
                else:   # this item alone failed on the server, after every retry
                    future.set_exception(RewardServerError(
                        f"reward server could not score item {item.get('id')!r}: {result.get('error')} "
                        f"({result.get('detail', '')})"))
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
