"""Per-key live usage through a real daemon on loopback (tiny model, SQLite): GET /admin/keys'
`usage` (requests and tokens in the minute equal to what the responses said, the share, in
flight while a stream runs, refusals by reason: a rate limit, a budget, a suspension), its
orders (?sort=, worst first by default), `controlplane keys list`, and the Prometheus series
(requests_throttled_total by key and reason, the queue time by priority class)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.admin.test_admin_api import MODEL, TOKEN
from tests.tenants.test_budgets_daemon import metric

KEYS = {"a": "sk-a-0123456789abcdef", "b": "sk-b-0123456789abcdef", "s": "sk-s-0123456789ab"}


@pytest.fixture(scope="module")
def served(make_module_daemon):
    return make_module_daemon(
        admin=True,
        engine={"max_num_seqs": 4, "max_model_len": 256},
        api_keys=[{"name": n, "key": k} for n, k in KEYS.items()],
        limits={"requests_per_minute": 3},
    )


def complete(c: httpx.Client, max_tokens: int = 3) -> httpx.Response:
    return c.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi there", "max_tokens": max_tokens}
    )


def tokens(r: httpx.Response) -> int:
    u = r.json()["usage"]
    return u["prompt_tokens"] + u["completion_tokens"]


def keys(d: Any, sort: str | None = None) -> list[dict[str, Any]]:
    with d.client(TOKEN) as c:
        r = c.get("/admin/keys", params={"sort": sort} if sort else None)
        assert r.status_code == 200, r.text
        return r.json()["keys"]


def test_usage_refusals_share_and_order(served, capsys):
    d = served
    with d.client(KEYS["a"]) as a, d.client(KEYS["b"]) as b, d.client(TOKEN) as admin:
        used_a = [complete(a) for _ in range(3)]
        assert all(r.status_code == 200 for r in used_a)
        assert complete(a).status_code == 429  # requests_per_minute 3
        used_b = complete(b)
        assert used_b.status_code == 200
        # A table key with a budget of 0 (reject): its request is refused as insufficient_quota.
        made = admin.post("/admin/keys", json={"name": "broke", "budget_usd": 0})
        assert made.status_code == 201, made.text
        with d.client(made.json()["secret"]) as broke:
            r = complete(broke)
            assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
        # A suspended key's 403, counted too.
        assert admin.post("/admin/keys/s/suspend").status_code == 200
        with d.client(KEYS["s"]) as s:
            assert complete(s).status_code == 403

    listed = keys(d)
    by = {k["name"]: k["usage"] for k in listed}
    ta, tb = sum(tokens(r) for r in used_a), tokens(used_b)
    assert by["a"]["requests_per_minute"] == 3 and by["a"]["tokens_per_minute"] == ta
    assert by["b"]["requests_per_minute"] == 1 and by["b"]["tokens_per_minute"] == tb
    assert by["a"]["share"] == pytest.approx(ta / (ta + tb), abs=1e-4)
    assert by["a"]["throttled"] == {"requests_per_minute": 1}
    assert by["broke"]["throttled"] == {"insufficient_quota": 1}
    assert by["s"]["throttled"] == {"suspended": 1} and by["s"]["share"] == 0.0
    assert all(u["in_flight"] == 0 for u in by.values())
    # Worst first: the refused keys, then by share (a over b).
    names = [k["name"] for k in listed]
    assert set(names[:3]) == {"a", "broke", "s"}
    assert names.index("a") < names.index("b")
    assert [k["name"] for k in keys(d, "name")] == sorted(names)
    assert keys(d, "tokens_per_minute")[0]["name"] == "a"
    with d.client(TOKEN) as admin:
        r = admin.get("/admin/keys", params={"sort": "loudest"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "sort"

    # Prometheus: refusals by key and reason; the queue wait by class (config keys: 0).
    name = "controlplane:requests_throttled_total"
    assert metric(d, name, api_key="a", reason="requests_per_minute") == 1
    assert metric(d, name, api_key="broke", reason="insufficient_quota") == 1
    assert metric(d, name, api_key="s", reason="suspended") == 1
    queued = "controlplane:request_queue_time_by_class_seconds_count"
    assert metric(d, queued, priority_class="0") >= 4

    from controlplane.cli import main

    assert main(["keys", "list", "--url", d.url, "--token", TOKEN, "--sort", "name"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("a "))
    assert f"rpm=3 tpm={ta}" in line and "requests_per_minute:1" in line, line


def test_in_flight_while_a_stream_runs(served):
    d = served
    body = {"model": MODEL, "prompt": "count", "max_tokens": 200, "stream": True}
    with d.client(KEYS["b"]) as b, b.stream("POST", "/v1/completions", json=body) as s:
        assert s.status_code == 200
        lines = s.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        during = {k["name"]: k["usage"] for k in keys(d)}["b"]
        assert during["in_flight"] == 1
        for _ in lines:
            pass
    after = {k["name"]: k["usage"] for k in keys(d)}["b"]
    assert after["in_flight"] == 0
    # Its prompt counted at admission, its completion at its end: more tokens than during.
    assert after["tokens_per_minute"] > during["tokens_per_minute"]


def test_an_open_apis_anonymous_usage_is_listed_as_open(make_daemon):
    d = make_daemon(admin=True, engine={"max_model_len": 256}, limits={"requests_per_minute": 1})
    with d.client() as anyone:
        ok = complete(anyone)
        assert ok.status_code == 200, ok.text
        assert complete(anyone).status_code == 429  # the open API's one shared bucket
    (opened,) = [k for k in keys(d) if k["name"] == "(open)"]
    assert opened["source"] == "open"
    assert opened["usage"]["requests_per_minute"] == 1
    assert opened["usage"]["tokens_per_minute"] == tokens(ok) and opened["usage"]["share"] == 1.0
    assert opened["usage"]["throttled"] == {"requests_per_minute": 1}
    name = "controlplane:requests_throttled_total"
    assert metric(d, name, api_key="(open)", reason="requests_per_minute") == 1
