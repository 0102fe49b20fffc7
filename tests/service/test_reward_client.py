"""The reward client's reading of answers that need no server."""

import httpx

from reward_server.client import serve_not_routed_yet


def test_serves_404_before_the_app_is_deployed_is_transient_and_an_apps_404_is_not():
    """Ray Serve's proxy answers 404 "... Ping http://.../-/routes ..." while a restarted server's application is not
    deployed yet (seen: a server killed mid-step and started again on its port); the client retries that one. A 404
    of the application itself (FastAPI's JSON) and other client errors stay final."""
    serve = httpx.Response(404, text="Path '/score' not found. Ping http://.../-/routes for available routes.")
    assert serve_not_routed_yet(serve)
    assert not serve_not_routed_yet(httpx.Response(404, json={"detail": "Not Found"}))
    assert not serve_not_routed_yet(httpx.Response(422, text="Ping http://.../-/routes for available routes."))


def test_request_parts_by_hand():
    """A gathered burst: requests of at most max_items, at least one per slot when there are that many items."""
    from reward_server.client import request_parts

    def sizes(*args):
        parts = request_parts(*args)
        assert [p.start for p in parts[1:]] == [p.stop for p in parts[:-1]]          # contiguous, in order
        return [p.stop - p.start for p in parts]

    assert sizes(8, 8, 8) == [1] * 8            # one replica's batch worth, 2 replicas x 4 slots: one item each
    assert sizes(16, 8, 4) == [4, 4, 4, 4]
    assert sizes(512, 8, 8) == [8] * 64          # a large burst: capped at max_items
    assert sizes(10, 3, 2) == [3, 3, 2, 2]       # ceil(10 / 3) = 4 requests, as even as possible
    assert sizes(3, 8, 4) == [1, 1, 1]
    assert sizes(0, 8, 4) == []


def test_the_timeout_grows_with_the_measured_request_time():
    """A real HTTP server whose answers take 0.2 s, then 0.6 s: with timeout_s 0.3 the second request would time out,
    but the client has measured 0.2 s and waits timeout_factor (4) x 0.2 = 0.8 s. With the factor at 0 (the timeout
    fixed at timeout_s) the same request times out and, with no retries allowed, fails."""
    import asyncio
    import socket
    import threading
    import time

    import pytest
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from reward_server.client import ClientConfig, RewardClient, RewardServerError

    delays = []

    async def score(request):
        body = await request.json()
        await asyncio.sleep(delays.pop(0))
        return JSONResponse({"results": [{"id": it["id"], "status": "ok", "reward": 1.0} for it in body["items"]]})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/score", score, methods=["POST"])]),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        def run(factor):
            client = RewardClient(ClientConfig(f"http://127.0.0.1:{port}", timeout_s=0.3, timeout_factor=factor,
                                               retries=0))

            async def two():
                first = await client.score([{"id": "a"}])
                return first, client.request_timeout(), await client.score([{"id": "b"}])
            return asyncio.run(two())

        delays[:] = [0.2, 0.6]
        first, timeout, second = run(4.0)
        assert first[0]["status"] == second[0]["status"] == "ok"
        assert 0.8 <= timeout < 1.2                   # 4 x the measured 0.2 s (+ the loop's overhead)
        delays[:] = [0.2, 0.6]
        with pytest.raises(RewardServerError, match="ReadTimeout"):
            run(0.0)
    finally:
        server.should_exit = True
        thread.join(10)
