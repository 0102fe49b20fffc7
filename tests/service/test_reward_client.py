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
