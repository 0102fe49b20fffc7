"""Hostile request bodies, generated (hypothesis), as an attacker would try them: nesting deeper than the JSON
parser recurses, integers past Python's int-conversion limit, ids of any length, lone surrogates, random bytes,
random JSON in every field. Each is refused with a 4xx naming the problem (or scored, when it happens to be
valid), never a 5xx; the server counts each one in /metrics and stays healthy."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reward_server.protocol import Limits, RequestError, parse_request

FIELDS = ["id", "tokens", "text", "language"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def item_body(**item) -> bytes:
    return json.dumps({"items": [{"id": "a", "tokens": [1, 2], "text": "好", **item}]}).encode()


def hostile_bodies(max_id: int = 300_000):
    deep = st.integers(1_000, 20_000).map(lambda n: b"[" * n + b"]" * n)
    deep_in_an_item = st.integers(1_000, 5_000).map(
        lambda n: b'{"items": [{"id": "a", "tokens": ' + b"[" * n + b"]" * n + b', "text": "x"}]}')
    long_int = st.integers(4_301, 12_000).map(
        lambda n: b'{"items": [{"id": "a", "tokens": [' + b"7" * n + b'], "text": "x"}]}')
    long_id = st.integers(1_025, max_id).map(lambda n: item_body(id="i" * n))
    surrogate = st.sampled_from(["\\ud800", "\\udfff", "\\ud83d"]).flatmap(lambda s: st.sampled_from([
        ('{"items": [{"id": "a' + s + '", "tokens": [1], "text": "x"}]}').encode(),
        ('{"items": [{"id": "a", "tokens": [1], "text": "好' + s + '"}]}').encode()]))
    random_fields = st.lists(st.dictionaries(st.sampled_from(FIELDS), json_values), min_size=1, max_size=3).map(
        lambda items: json.dumps({"items": items}).encode())
    random_json = json_values.map(lambda v: json.dumps(v).encode())
    return st.one_of(deep, deep_in_an_item, long_int, long_id, surrogate, random_fields, random_json,
                     st.binary(max_size=300))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(hostile_bodies())
def test_every_hostile_body_is_a_client_error_or_valid(body):
    try:
        parse_request(body, Limits())
    except RequestError as exc:
        assert 400 <= exc.status < 500 and exc.error
        echoed = json.dumps(exc.body(), ensure_ascii=False).encode("utf-8")    # what the server will send
        assert len(echoed) < 2_000 + 300 * len(exc.problems)                  # ids and values are not echoed whole


def test_the_classes_by_hand():
    for body, status, says in [(b"[" * 50_000 + b"]" * 50_000, 400, "nested too deeply"),
                               (b'{"items": [{"id": "a", "tokens": [' + b"9" * 5_000 + b'], "text": "x"}]}', 400,
                                "JSON value refused"),
                               (item_body(id="i" * 200_000), 422, "200000 characters exceed the limit of 1024"),
                               (b'{"items": [{"id": "a", "tokens": [1], "text": "\\ud800"}]}', 422,
                                "not valid Unicode")]:
        with pytest.raises(RequestError) as err:
            parse_request(body, Limits())
        assert err.value.status == status and says in str(err.value.body()), err.value.body()
    with pytest.raises(RequestError) as err:
        parse_request(item_body(id="i" * 200_000), Limits())
    assert err.value.problems[0]["id"] is None                               # the long id is not echoed


def requests_count(url) -> float:
    import re

    return sum(float(v) for v in re.findall(r'^reward_requests_total\{[^}]*\} ([0-9.e+]+)$',
                                            httpx.get(f"{url}/metrics").text, re.M))


@pytest.mark.server
def test_the_server_turns_hostile_bodies_away_and_stays_healthy(synthetic_server):
    url, statuses = synthetic_server.url, []
    before = requests_count(url)

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(hostile_bodies(max_id=15_000))            # the fixture's server refuses bodies over 20 kB (413)
    def post(body):
        r = httpx.post(f"{url}/score", content=body, headers={"content-type": "application/json"}, timeout=60)
        statuses.append(r.status_code)
        assert r.status_code < 500, (r.status_code, r.text[:300], body[:200])
        if r.status_code >= 400:
            assert r.json()["error"]                                          # JSON naming the problem

    post()
    assert len(statuses) >= 60 and sum(400 <= s < 500 for s in statuses) >= 40
    assert requests_count(url) - before == len(statuses)                      # every one counted
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
