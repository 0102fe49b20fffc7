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
