"""Spend budgets through real daemons (tiny model, real HTTP on loopback, real SQLite and
PostgreSQL; prices of $1 a token, so a request's cost is its usage's token count): a key at its
budget gets 429 insufficient_quota naming the budget, its spend and the reset, the openai SDK
raises RateLimitError without retrying; the soft-threshold and budget events come once each
(SSE, log, metric); deprioritize admits; the spend shows in /admin/keys and `controlplane keys
list`; and on a PostgreSQL fleet a key stopped on one daemon stops on the other within one
limits.budget_refresh_s (plus store.flush_interval_s)."""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import InProcessDaemon, wait_rows
from tests.admin.test_admin_api import MODEL, TOKEN

# $1 a token, prompt, cached and completion alike.
PRICES = [
    {
        "model": "*",
        "effective_from": "2026-01-01T00:00:00Z",
        "prompt_per_mtok": 1e6,
        "cached_prompt_per_mtok": 1e6,
        "completion_per_mtok": 1e6,
    }
]
SOFT = 0.5
REFRESH_S = 0.5
FLUSH_S = 0.05


@pytest.fixture(scope="module")
def served(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        admin=True,
        engine={"max_num_seqs": 4, "max_model_len": 256},
        limits={"budget_soft_threshold": SOFT, "budget_refresh_s": REFRESH_S},
        store={"flush_interval_s": FLUSH_S},
        prices=PRICES,
    )


def complete(d: InProcessDaemon, key: str, path: str = "/v1/completions") -> httpx.Response:
    if path == "/v1/completions":
        body: dict[str, Any] = {"prompt": "hello there", "max_tokens": 2}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(
        d.url + path,
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def cost(r: httpx.Response) -> int:
    """A 200's cost in USD at $1 a token."""
    usage = r.json()["usage"]
    return usage["prompt_tokens"] + usage["completion_tokens"]


def make_key(d: InProcessDaemon, name: str, **budget: Any) -> str:
    with d.client(TOKEN) as c:
        made = c.post("/admin/keys", json={"name": name, **budget})
        assert made.status_code == 201, made.text
        return made.json()["secret"]


def listed(d: InProcessDaemon, name: str) -> dict[str, Any]:
    with d.client(TOKEN) as c:
        keys = c.get("/admin/keys").json()["keys"]
    return next(k for k in keys if k["name"] == name)


def metric(d: InProcessDaemon, name: str, **labels: str) -> float:
    with d.client(TOKEN) as c:
        text = c.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


class BudgetEvents:
    """/admin/events' budget messages, collected by a thread from subscription to `close`."""

    def __init__(self, d: InProcessDaemon) -> None:
        self.got: list[dict[str, Any]] = []
        self._subscribed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, args=(d,), daemon=True)
        self._thread.start()
        assert self._subscribed.wait(20)

    def _listen(self, d: InProcessDaemon) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.stream(
            "GET", d.url + "/admin/events", params={"interval": 0.1}, headers=headers, timeout=30
        ) as r:
            for line in r.iter_lines():
                if self._stop.is_set():
                    return
                if not line.startswith("data:"):
                    continue
                self._subscribed.set()  # a first snapshot: the stream is registered
                data = json.loads(line.split(":", 1)[1])
                if data.get("type") == "budget":
                    self.got.append(data)

    def close(self) -> list[dict[str, Any]]:
        time.sleep(0.3)  # a few snapshots more: anything broadcast has been read
        self._stop.set()
        self._thread.join(10)
        return self.got


def test_reject_at_the_budget_once_with_its_events(served, caplog):
    d = served
    budget = 40
    events = BudgetEvents(d)
    with caplog.at_level(logging.WARNING, logger="controlplane.budgets"):
        secret = make_key(d, "capped", budget_usd=budget, budget_period="day")
        spent, statuses = 0, []
        for _ in range(40):
            r = complete(d, secret)
            statuses.append(r.status_code)
            if r.status_code != 200:
                break
            before, spent = spent, spent + cost(r)
        # One daemon, one request at a time: nothing in flight, so the first request after the
        # spend reached the budget is refused, and none before it.
        assert statuses[-1] == 429 and set(statuses[:-1]) == {200}, statuses
        assert before < budget <= spent
    found = events.close()
    assert r.headers["x-should-retry"] == "false"
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    midnight += timedelta(days=1)
    wait = (midnight - datetime.now(UTC)).total_seconds()
    assert abs(int(r.headers["retry-after"]) - wait) <= 5
    error = r.json()["error"]
    assert {k: error[k] for k in ("type", "code", "param")} == {
        "type": "insufficient_quota",
        "code": "insufficient_quota",
        "param": None,
    }
    message = error["message"]
    assert "'capped'" in message and f"${budget:.2f} budget for this day" in message
    assert f"spent ${spent:.2f}" in message
    assert midnight.strftime("%Y-%m-%dT%H:%M:%SZ") in message

    # Every generation route, and the openai SDK: RateLimitError, not retried (x-should-retry).
    assert complete(d, secret, "/v1/chat/completions").json()["error"]["code"] == (
        "insufficient_quota"
    )
    responses = httpx.post(
        d.url + "/v1/responses",
        json={"model": MODEL, "input": "hi", "max_output_tokens": 2},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=60,
    )
    assert responses.status_code == 429, responses.text
    rejected = metric(d, "controlplane:budget_requests_total", api_key="capped", action="rejected")
    client = openai.OpenAI(base_url=d.url + "/v1", api_key=secret, max_retries=2)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert err.value.code == "insufficient_quota" and err.value.type == "insufficient_quota"
    after = metric(d, "controlplane:budget_requests_total", api_key="capped", action="rejected")
    assert after == rejected + 1  # one request: the SDK did not retry

    # The soft threshold's event and the budget's, once each, however many requests followed.
    assert [(e["key"], e["event"]) for e in found] == [
        ("capped", "soft_threshold"),
        ("capped", "exhausted"),
    ]
    soft = found[0]
    assert soft["soft_threshold"] == SOFT and SOFT <= soft["use"] < 1
    assert soft["budget_usd"] == budget and soft["budget_period"] == "day"
    assert found[1]["spend_usd"] == spent and found[1]["state"] == "exhausted"
    lines = [r.getMessage() for r in caplog.records if "'capped'" in r.getMessage()]
    assert len(lines) == 2 and "soft threshold (50% of the budget)" in lines[0]
    assert "its further requests are rejected" in lines[1]
    for event in ("soft_threshold", "exhausted"):
        labels = {"api_key": "capped", "event": event}
        assert metric(d, "controlplane:budget_events_total", **labels) == 1

    # /admin/keys: this period's spend against the budget.
    shown = listed(d, "capped")["budget"]
    assert shown["spend_usd"] == spent and shown["state"] == "exhausted"
    assert shown["use"] == pytest.approx(spent / budget)
    assert shown["resets_at"] == midnight.isoformat()
    # The rows in SQL carry the same spend (priced at ingest, as the tracker prices).
    found = wait_rows(
        d.daemon.cfg.store_url,
        lambda rs: sum(float(r["cost_usd"] or 0) for r in rs) >= spent,
        where="api_key_name = 'capped' AND status = 'success'",
    )
    assert sum(float(r["cost_usd"]) for r in found) == pytest.approx(spent)

    # A budget raised live admits the key again at once, on the daemon that changed it.
    with d.client(TOKEN) as c:
        assert c.patch("/admin/keys/capped", json={"budget_usd": spent + 100}).status_code == 200
    assert complete(d, secret).status_code == 200


def test_deprioritize_admits_at_the_budget(served):
    d = served
    secret = make_key(d, "slowed", budget_usd=0, budget_action="deprioritize")
    before = metric(
        d, "controlplane:budget_requests_total", api_key="slowed", action="deprioritized"
    )
    # Its requests run at the lowest priority class (9): counted there by the queue-time
    # histogram, which labels each finished request with the class it was scheduled in.
    queued = "controlplane:request_queue_time_by_class_seconds_count"
    lowest = metric(d, queued, priority_class="9")
    assert [complete(d, secret).status_code for _ in range(3)] == [200] * 3
    after = metric(
        d, "controlplane:budget_requests_total", api_key="slowed", action="deprioritized"
    )
    assert after == before + 3
    assert metric(d, queued, priority_class="9") == lowest + 3
    shown = listed(d, "slowed")["budget"]
    assert shown["state"] == "exhausted" and shown["budget_action"] == "deprioritize"
    assert shown["spend_usd"] > 0 and shown["use"] is None  # spent on a budget of 0


def test_the_soft_threshold_is_live_and_the_cli_shows_the_spend(served, capsys):
    from controlplane.cli import main

    d = served
    secret = make_key(d, "watched", budget_usd=1000, budget_period="month")
    spent = cost(complete(d, secret))
    with d.client(TOKEN) as c:  # the budget set so that the spend is 60% of it
        assert c.patch("/admin/keys/watched", json={"budget_usd": spent / 0.6}).status_code == 200
        assert listed(d, "watched")["budget"]["state"] == "soft_threshold"  # 60% >= 50%
        r = c.patch("/admin/config", json={"limits": {"budget_soft_threshold": 0.9}})
        assert r.status_code == 200, r.text
        assert listed(d, "watched")["budget"]["state"] == "ok"  # 60% < 90%
        c.patch("/admin/config", json={"limits": {"budget_soft_threshold": SOFT}})
    code = main(["keys", "list", "--url", d.url, "--token", TOKEN])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("watched"))
    assert code == 0 and f"spent=${spent}" in line and "(60%)" in line, line


def test_hostile_budgets_over_http(served):
    with served.client(TOKEN) as c:
        huge = b'{"name": "huge", "budget_usd": 1' + b"0" * 400 + b"}"
        r = c.post("/admin/keys", content=huge, headers={"Content-Type": "application/json"})
        assert r.status_code == 422, r.text  # was a 500: isfinite on an int beyond a float
        assert r.json()["error"]["param"] == "budget_usd"
        assert "from 0 to 1e+09" in r.json()["error"]["message"]
        assert c.post("/admin/keys", json={"name": "neg", "budget_usd": -1}).status_code == 422
        r = c.post("/admin/keys", json={"name": "wk", "budget_period": "week"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "budget_period"
        names = {k["name"] for k in c.get("/admin/keys").json()["keys"]}
        assert not names & {"huge", "neg", "wk"}
        r = c.patch("/admin/config", json={"limits": {"budget_soft_threshold": 0}})
        assert r.status_code == 422 and "limits.budget_soft_threshold" in r.text


def test_a_fleet_stops_the_key_on_both_daemons(make_daemon, pg_url):
    """Two daemons on one PostgreSQL database. The key spends its budget through A, once A has
    read B's first request: A refuses its next request at once (its own spend counts as each
    request ends). B has spent almost
    nothing itself, so only the shared rows can stop it: it must refuse within one
    limits.budget_refresh_s plus store.flush_interval_s of the moment the budget was reached
    (plus a margin for this loaded machine), which bounds what it admits meanwhile: the
    stated worst case, one refresh interval of the key's traffic (docs/tenants.md#budgets)."""
    fleet = [
        make_daemon(
            admin=True,
            server={"instance_id": n, "key_refresh_s": 0.2},
            store={"url": pg_url, "flush_interval_s": FLUSH_S},
            limits={"budget_refresh_s": REFRESH_S},
            engine={"max_num_seqs": 2, "max_model_len": 128},
            prices=PRICES,
        )
        for n in ("a", "b")
    ]
    a, b = fleet
    budget = 200  # some 30 requests: more than B can send in one refresh interval
    secret = make_key(a, "fleet-budget", budget_usd=budget, budget_period="day")
    deadline = time.monotonic() + 10
    # B's key cache has the row once B's API is closed (before it, any bearer is anonymous).
    while complete(b, "cp-wrong").status_code != 401:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = complete(b, secret)
    assert r.status_code == 200, r.text
    spent = b_own = cost(r)
    deadline = time.monotonic() + 10
    while listed(a, "fleet-budget")["budget"]["spend_usd"] < spent:  # A has read B's spend
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for _ in range(100):
        r = complete(a, secret)
        if r.status_code != 200:
            break
        before, spent = spent, spent + cost(r)
        reached_at = time.monotonic()
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
    assert before < budget <= spent  # A refused the first request past the budget

    admitted_after = 0
    while (r := complete(b, secret)).status_code == 200:
        admitted_after += 1
        spent += cost(r)
        b_own += cost(r)
        assert time.monotonic() - reached_at < REFRESH_S + FLUSH_S + 5, "B never stopped"
    lag = time.monotonic() - reached_at
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
    print(f"B stopped {lag:.3f} s after the budget was reached; admitted {admitted_after} more")
    assert lag <= REFRESH_S + FLUSH_S + 2.0  # the bound, plus a margin for this machine
    assert b_own < budget  # B stopped on the fleet's spend, not on its own
    assert complete(a, secret).status_code == 429  # both stay stopped
    assert complete(b, secret).status_code == 429
    # The fleet's rows and each daemon's view agree on the spend, overspend included.
    deadline = time.monotonic() + 10
    for d in fleet:
        while (seen := listed(d, "fleet-budget")["budget"]["spend_usd"]) < spent - 1e-6:
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        assert seen == pytest.approx(spent, abs=1e-6)  # never counted twice
