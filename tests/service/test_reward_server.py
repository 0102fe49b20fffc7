"""The reward server started for real (subprocess, Ray Serve on 127.0.0.1): API, validation, robustness."""

import asyncio
import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections import Counter

import httpx
import pytest

from grpo.speech.codebook import Codebook
from grpo.speech.scoring import reward_from_error_rate, text_to_units, units_error_rate
from reward_server.client import ClientConfig, RewardClient, RewardRequestError, RewardServerError

pytestmark = pytest.mark.server

TEXTS = ["今天天气很好。", "我们一起去公园散步吧。", "Time flies when you are having fun.", "他在2019年大学毕业。"]


def expected(codebook, tokens, text, language):
    c = units_error_rate(text_to_units(text, language), codebook.transcribe(tokens))
    return reward_from_error_rate(c), c


@pytest.fixture(scope="module")
def codebook(tiny_cfg):
    return Codebook.load(tiny_cfg().reward.codebook.path)


def item(i, codebook, rng, correct=True):
    text = TEXTS[i % len(TEXTS)]
    lang = "en" if text.isascii() else "zh"
    tokens = codebook.tokens_for_text(text, lang, rng) if correct else [rng.randrange(6561) for _ in range(8)]
    return {"id": f"sample-{i}", "tokens": tokens, "text": text, "language": lang}


def test_valid_request_scores_in_order(synthetic_server, codebook):
    rng = random.Random(0)
    items = [item(i, codebook, rng, correct=i % 2 == 0) for i in range(6)]
    r = httpx.post(f"{synthetic_server.url}/score", json={"items": items}, timeout=30)
    assert r.status_code == 200
    results = r.json()["results"]
    assert [x["id"] for x in results] == [i["id"] for i in items]
    for it, res in zip(items, results):
        reward, c = expected(codebook, it["tokens"], it["text"], it["language"])
        assert res["reward"] == pytest.approx(reward) and res["error_rate"] == pytest.approx(c)
    assert results[0]["reward"] == 1.0 and results[0]["transcript"] == " ".join(text_to_units(TEXTS[0]))


BAD = [
    ("bad json", b'{"items": [', 400, "malformed JSON"),
    ("bad utf-8", b'{"items": [{"id": "\xff"}]}', 400, "UTF-8"),
    ("no items", json.dumps({"foo": 1}).encode(), 422, 'items'),
    ("empty items", json.dumps({"items": []}).encode(), 422, "non-empty"),
    ("missing fields", json.dumps({"items": [{"id": "a"}]}).encode(), 422, "tokens"),
    ("wrong types", json.dumps({"items": [{"id": 3, "tokens": "12", "text": 5}]}).encode(), 422, "id"),
    ("token out of range", json.dumps({"items": [{"id": "a", "tokens": [1, 7000], "text": "好"}]}).encode(), 422,
     "outside the speech vocabulary"),
    ("negative token", json.dumps({"items": [{"id": "a", "tokens": [-1], "text": "好"}]}).encode(), 422, "outside"),
    ("bool token", json.dumps({"items": [{"id": "a", "tokens": [True], "text": "好"}]}).encode(), 422, "non-integer"),
    ("empty tokens", json.dumps({"items": [{"id": "a", "tokens": [], "text": "好"}]}).encode(), 422, "empty"),
    ("too many tokens", json.dumps({"items": [{"id": "a", "tokens": [1] * 101, "text": "好"}]}).encode(), 422,
     "exceed the limit"),
    ("text too long", json.dumps({"items": [{"id": "a", "tokens": [1], "text": "好" * 61}]}).encode(), 422,
     "exceed the limit"),
    ("unknown language", json.dumps({"items": [{"id": "a", "tokens": [1], "text": "hi", "language": "de"}]}).encode(),
     422, "unknown language"),
    ("punctuation only", json.dumps({"items": [{"id": "a", "tokens": [1], "text": "！？"}]}).encode(), 422,
     "nothing speakable"),
    ("too many items", json.dumps({"items": [{"id": "a", "tokens": [1], "text": "好"}] * 51}).encode(), 413,
     "exceed the limit"),
    ("body too large", json.dumps({"items": [{"id": "a" * 30000, "tokens": [1], "text": "好"}]}).encode(), 413,
     "exceeds the limit"),
    ("too many tokens in all", json.dumps({"items": [{"id": f"a{i}", "tokens": [1] * 60, "text": "好"}
                                                     for i in range(20)]}).encode(), 413,
     "1200 speech tokens in one request exceed the limit of 1000"),
]


@pytest.mark.parametrize("name,body,status,message", BAD, ids=[b[0] for b in BAD])
def test_malformed_requests_get_4xx_naming_the_problem(synthetic_server, name, body, status, message):
    r = httpx.post(f"{synthetic_server.url}/score", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.text
    assert httpx.get(f"{synthetic_server.url}/health").status_code == 200


def test_errors_name_every_bad_item(synthetic_server):
    items = [{"id": "ok", "tokens": [1], "text": "好"}, {"id": "b1", "tokens": [], "text": "好"},
             {"id": "b2", "tokens": [1], "text": ""}]
    problems = httpx.post(f"{synthetic_server.url}/score", json={"items": items}).json()["problems"]
    assert {(p["item"], p["id"], p["field"]) for p in problems} == {(1, "b1", "tokens"), (2, "b2", "text")}


def test_a_failing_item_fails_alone_and_is_counted(synthetic_server, codebook):
    """6800 is inside the declared vocabulary (7000) but outside the codebook (6561): the backend raises on that
    item. In a batch of 32 it fails alone (status "error"); the other 31 get their exact rewards."""
    rng = random.Random(3)
    items = [item(i, codebook, rng, correct=i % 3 == 0) for i in range(32)]
    items[17] = {**items[17], "tokens": [6800, 5]}
    r = httpx.post(f"{synthetic_server.url}/score", json={"items": items}, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["id"] for x in results] == [it["id"] for it in items]
    assert results[17]["status"] == "error" and results[17]["error"] == "backend" and "reward" not in results[17]
    for k, (it, res) in enumerate(zip(items, results)):
        if k != 17:
            assert res["status"] == "ok"
            assert res["reward"] == pytest.approx(expected(codebook, it["tokens"], it["text"], it["language"])[0])
    metrics = httpx.get(f"{synthetic_server.url}/metrics").text
    assert 'reward_failures_total{backend="synthetic",kind="backend"' in metrics
    assert "reward_batch_size_bucket" in metrics and "reward_request_latency_seconds_bucket" in metrics
    assert httpx.get(f"{synthetic_server.url}/health").status_code == 200     # one failure is not sticky


def test_a_chunked_body_over_the_limit_is_refused(synthetic_server):
    def body():   # no Content-Length: the server must count while it reads
        yield b'{"items": [{"id": "'
        for _ in range(30):
            yield b"a" * 1000
        yield b'", "tokens": [1], "text": "x"}]}'

    r = httpx.post(f"{synthetic_server.url}/score", content=body(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit of 20000 bytes" in r.text


def test_load_1000_concurrent_requests_with_malformed_ones(synthetic_server, codebook):
    rng = random.Random(7)
    requests = []
    for i in range(1000):
        if i % 5 == 0:   # 20% malformed, of several kinds
            bad = [b"{oops", json.dumps({"items": [{"id": "z", "tokens": []}]}).encode(),
                   json.dumps({"items": [{"id": "z", "tokens": [9999], "text": "好"}]}).encode()]
            requests.append(("bad", rng.choice(bad)))
        else:
            requests.append(("good", item(i, codebook, rng, correct=rng.random() < 0.5)))

    async def fire():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            async def one(kind, payload):
                if kind == "good":
                    return await client.post(f"{synthetic_server.url}/score", json={"items": [payload]})
                return await client.post(f"{synthetic_server.url}/score", content=payload)
            return await asyncio.gather(*(one(k, p) for k, p in requests))

    start = time.perf_counter()
    responses = asyncio.run(fire())
    elapsed = time.perf_counter() - start
    for (kind, payload), resp in zip(requests, responses):
        if kind == "bad":
            assert 400 <= resp.status_code < 500
        else:
            assert resp.status_code == 200, resp.text
            reward, _ = expected(codebook, payload["tokens"], payload["text"], payload["language"])
            assert resp.json()["results"][0]["reward"] == pytest.approx(reward)
    assert httpx.get(f"{synthetic_server.url}/health").status_code == 200
    print(f"1000 requests in {elapsed:.1f} s")


def in_flight(url) -> float:
    import re

    m = re.search(r'^reward_items_in_flight\{[^}]*\} ([0-9.e+]+)$', httpx.get(f"{url}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def own_server(tiny_exp, tmp_path, *overrides):
    """A synthetic-backend server of the test's own (these tests break its replica)."""
    from conftest import FAST_TINY, ServerProcess

    return ServerProcess([f"exp_dir={tiny_exp}", *FAST_TINY, "reward.backend=synthetic", *overrides],
                         log_path=tmp_path / "server.log").wait()


def score_all(client, items) -> list[dict]:
    """Every item through the client at once (one score_one call each, as verl makes them)."""
    async def run():
        try:
            return await asyncio.gather(*(client.score_one(it) for it in items))
        finally:
            await client.aclose()
    return asyncio.run(run())


def assert_exact_rewards(codebook, items, results):
    for it, res in zip(items, results, strict=True):
        assert res["id"] == it["id"] and res["status"] == "ok"
        assert res["reward"] == pytest.approx(expected(codebook, it["tokens"], it["text"], it["language"])[0])


def test_a_killed_replica_then_one_with_a_sticky_fault_are_replaced_and_the_client_rides_through(
        tiny_exp, codebook, tmp_path):
    """One server (a start costs ~15 s here), a replica lost two ways. Killed while it holds requests: those fail
    (500), the client retries, the new replica answers; the batch window is long (2 s) so that the kill certainly
    meets items inside the replica. Then a sticky fault: the first replica to see the fault file fails every call
    from then on (as with a broken GPU); after 2 failures in a row its health check fails, Serve replaces it, and
    the client's time-budgeted retries get every reward from the newer replica."""
    fault = tmp_path / "sticky-fault"
    server = own_server(tiny_exp, tmp_path, "reward.max_batch_size=64", "reward.batch_wait_timeout_s=2.0",
                        f"reward.inject_sticky_fault_file={fault}", "reward.unhealthy_after_failures=2",
                        "reward.health_check_period_s=1")
    rng = random.Random(11)
    items = [item(i, codebook, rng, correct=rng.random() < 0.5) for i in range(40)]
    try:
        old_pid = httpx.get(f"{server.url}/health").json()["pid"]
        client = RewardClient(ClientConfig(server.url, timeout_s=60, retries=10, backoff_s=0.5))

        async def run():
            tasks = [asyncio.create_task(client.score_one(it)) for it in items]
            deadline = time.monotonic() + 30
            while await asyncio.to_thread(in_flight, server.url) < len(items):    # all held in the replica's batch
                assert time.monotonic() < deadline, "the items never reached the replica"
                await asyncio.sleep(0.05)
            os.kill(old_pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            await client.aclose()
            return results

        assert_exact_rewards(codebook, items, asyncio.run(run()))
        killed_pid, old_pid = old_pid, httpx.get(f"{server.url}/health", timeout=120).json()["pid"]
        assert old_pid != killed_pid
        assert client.retries_made > 0

        items = [item(i, codebook, rng, correct=rng.random() < 0.5) for i in range(20)]
        client = RewardClient(ClientConfig(server.url, timeout_s=30, retry_budget_s=120, backoff_s=0.5))
        fault.touch()
        results = score_all(client, items)
        assert not fault.exists()                                  # a replica took the fault
        assert_exact_rewards(codebook, items, results)
        assert client.retries_made > 0
        health = httpx.get(f"{server.url}/health", timeout=60)
        assert health.status_code == 200 and health.json()["pid"] not in (old_pid, killed_pid)
    finally:
        server.stop()


def test_client_raises_after_retries_and_never_returns_zero(synthetic_server):
    clients = []

    async def run(url, item):
        client = RewardClient(ClientConfig(url, timeout_s=5, retries=2, backoff_s=0.05))
        clients.append(client)
        try:
            return await client.score_one(item)
        finally:
            await client.aclose()

    from conftest import free_port

    with pytest.raises(RewardServerError, match="failed after 2 retries"):
        asyncio.run(run(f"http://127.0.0.1:{free_port()}", {"id": "a", "tokens": [1], "text": "好"}))
    with pytest.raises(RewardServerError, match="could not score item 'a': backend"):   # retried, then raised
        asyncio.run(run(synthetic_server.url, {"id": "a", "tokens": [6800], "text": "好"}))
    assert clients[-1].retries_made == 2                         # the failed item was sent again, twice
    with pytest.raises(RewardRequestError) as err:               # client error: raised at once
        asyncio.run(run(synthetic_server.url, {"id": "a", "tokens": [], "text": "好"}))
    assert clients[-1].retries_made == 0
    assert err.value.status == 422


def test_an_item_failing_on_the_server_fails_only_its_caller(synthetic_server, codebook):
    """One request holding good items and one the backend fails on (token 6800 > the codebook's 6561): after the
    retries only that caller raises; the others get the rewards the codebook gives by hand, from one batch."""
    rng = random.Random(11)
    good = [item(i, codebook, rng, correct=i % 2 == 0) for i in range(5)]
    bad = {"id": "broken", "tokens": [6800, 1, 2], "text": "好"}
    calls = [good[0], bad, *good[1:]]           # the bad item early: a whole-batch failure would reach the rest

    async def run():
        client = RewardClient(ClientConfig(synthetic_server.url, retries=1, backoff_s=0.05, batch_wait_s=0.05))
        try:
            return await asyncio.gather(*(client.score_one(c) for c in calls), return_exceptions=True), client
        finally:
            await client.aclose()

    out, client = asyncio.run(run())
    assert isinstance(out[1], RewardServerError) and "'broken'" in str(out[1])
    assert client.retries_made == 1                          # the bad item alone was sent again, once
    for it, res in zip([calls[0], *calls[2:]], [out[0], *out[2:]]):
        assert isinstance(res, dict), res
        reward, c = expected(codebook, it["tokens"], it["text"], it["language"])
        assert res["id"] == it["id"] and res["reward"] == pytest.approx(reward)
        assert res["error_rate"] == pytest.approx(c)


def requests_count(url) -> float:
    import re

    return sum(float(v) for v in re.findall(r'^reward_requests_total\{[^}]*\} ([0-9.e+]+)$',
                                            httpx.get(f"{url}/metrics").text, re.M))


def test_client_sends_concurrent_calls_together_and_isolates_bad_items(synthetic_server, codebook):
    rng = random.Random(5)
    good = [item(i, codebook, rng) for i in range(120)]
    bad = {"id": "bad", "tokens": [], "text": "好"}                 # 422: empty tokens
    before = requests_count(synthetic_server.url)

    async def run():
        client = RewardClient(ClientConfig(synthetic_server.url, retries=2, backoff_s=0.05, max_items_per_request=256))
        out = await asyncio.gather(*(client.score_one(it) for it in good[:60] + [bad] + good[60:]),
                                   return_exceptions=True)
        await client.aclose()
        return out

    out = asyncio.run(run())
    assert isinstance(out[60], RewardRequestError) and out[60].status == 422
    results = out[:60] + out[61:]
    assert all(isinstance(r, dict) for r in results) and [r["id"] for r in results] == [g["id"] for g in good]
    sent = requests_count(synthetic_server.url) - before
    # 121 calls: split by the server's limits (50 items, 20 kB) and resent once without the bad item
    assert sent <= 12, f"{sent} requests for 121 calls"


def test_a_small_burst_is_spread_over_the_request_slots(synthetic_server, codebook):
    """8 calls at once with 8 request slots go out as 8 requests (one request of 8 would keep every replica
    but one idle)."""
    rng = random.Random(6)
    items = [item(i, codebook, rng) for i in range(8)]
    before = requests_count(synthetic_server.url)
    results = score_all(RewardClient(ClientConfig(synthetic_server.url, max_items_per_request=8, max_concurrency=8)),
                        items)
    assert_exact_rewards(codebook, items, results)
    assert requests_count(synthetic_server.url) - before == 8


def test_serve_already_running_elsewhere_is_restarted_alone_and_refused_beside_other_apps(tiny_cfg):
    """serve.start ignores new HTTP options when Serve runs: with another application there, deploy stops with
    the running options and that app's name; once it is alone, Serve is restarted on our port."""
    import ray
    from ray import serve

    from conftest import free_port
    from reward_server.app import build_app
    from reward_server.serve import APP_NAME, ServeConflict, deploy

    first, ours = free_port(), free_port()
    cfg = tiny_cfg("reward.backend=synthetic", f"reward.port={ours}")
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")     # Ray's socket paths must stay under 108 bytes
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_dir, logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": first})
        serve.run(build_app(cfg), name="someone_elses", route_prefix="/other", blocking=False)
        with pytest.raises(ServeConflict, match=rf"127\.0\.0\.1:{first}.*someone_elses.*reward\.port={first}"):
            deploy(cfg)
        assert httpx.get(f"http://127.0.0.1:{first}/other/health", timeout=10).status_code == 200   # left alone
        serve.delete("someone_elses")
        deploy(cfg)
        assert APP_NAME in serve.status().applications
        assert httpx.get(f"http://127.0.0.1:{ours}/health", timeout=30).json()["backend"] == "synthetic"
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_a_burst_through_the_client_reaches_every_replica_each_on_its_cpu_share(tiny_exp, codebook, tmp_path,
                                                                               monkeypatch):
    """The training client sends a step's burst as small requests, a bounded number in flight, so each is routed
    as a replica frees up and every replica works (all at once, they can all land on one replica). Right after
    start-up the proxy's router may know one replica only: the test first waits until /health answers from
    both. Each replica's torch threads are reward.cpus_per_replica (1), even with OMP_NUM_THREADS=2 in the node's
    environment (Ray then leaves it as is, and every replica on the host would use that many threads)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    server = own_server(tiny_exp, tmp_path, "reward.num_replicas=2", "reward.max_batch_size=32",
                        "reward.cpus_per_replica=1")
    rng = random.Random(17)
    items = [item(i, codebook, rng, correct=rng.random() < 0.5) for i in range(256)]
    from grpo.config import load_config
    from grpo.train.reward_fn import reward_kwargs

    kwargs = reward_kwargs(load_config([f"exp_dir={tiny_exp}", "reward.max_batch_size=32", "reward.num_replicas=2"]))
    client = RewardClient(ClientConfig(server.url, max_items_per_request=kwargs["client"]["max_items_per_request"],
                                       max_concurrency=kwargs["client"]["max_concurrency"]))
    try:
        deadline, threads = time.monotonic() + 60, {}
        while len(threads) < 2:
            assert time.monotonic() < deadline, f"the proxy routes to {set(threads)} only"
            health = httpx.get(f"{server.url}/health").json()
            threads[health["replica"]] = health["torch_threads"]
        assert set(threads.values()) == {1}, threads
        results = score_all(client, items)
        assert_exact_rewards(codebook, items, results)
        per_replica = Counter(r["replica"] for r in results)
        # every replica takes part: at least an eighth each. The split follows each replica's speed, and in the suite
        # the other xdist worker's test loads the same cores (176 / 80 beside the main_ppo test's start-up)
        assert len(per_replica) == 2 and min(per_replica.values()) >= len(items) // 8, per_replica
    finally:
        server.stop()
