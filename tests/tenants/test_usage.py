"""Per-key live usage (controlplane.tenants.usage) on a clock the test moves: the sliding minute,
the share of tokens, refusals by reason, in flight, and /admin/keys' orders; the Prometheus
series it feeds (requests_throttled_total's bounded key label, queue time by class)."""

from __future__ import annotations

import pytest

from controlplane.engine.types import RequestMetrics
from controlplane.telemetry.metrics import MAX_BUDGET_KEY_LABELS, OTHER_KEY, Metrics
from controlplane.tenants.usage import OPEN, SORTS, KeyUsage, sort_key
from tests.admin.test_admin_metrics import MODEL, P, scrape, value


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_sliding_minute_of_requests_tokens_and_refusals():
    clock = Clock()
    u = KeyUsage(clock)
    u.admitted("a", prompt_tokens=100)
    u.admitted("b", prompt_tokens=50)
    clock.now += 30
    u.finished("a", completion_tokens=20)
    u.refused("a", "requests_per_minute")
    u.refused("a", "requests_per_minute")
    u.refused(None, "queue_full")
    v = u.views()
    assert v["a"].requests_per_minute == 1 and v["a"].tokens_per_minute == 120
    assert v["b"].tokens_per_minute == 50
    assert v["a"].share == pytest.approx(120 / 170) and v["b"].share == pytest.approx(50 / 170)
    assert v["a"].in_flight == 0 and v["b"].in_flight == 1
    assert v["a"].throttled == {"requests_per_minute": 2} and v["a"].throttled_last_minute == 2
    assert v[OPEN].throttled == {"queue_full": 1}  # an open API's requests, under "(open)"
    # 31 s later the first second has left the minute: a's prompt and b's are gone.
    clock.now += 31
    v = u.views()
    assert v["a"].requests_per_minute == 0 and v["a"].tokens_per_minute == 20
    assert v["b"].tokens_per_minute == 0 and v["a"].share == 1.0
    assert v["a"].throttled_last_minute == 2  # refused at +30 s: still inside
    # Another minute: nothing is left in the window, the counts since the start stay.
    clock.now += 60
    v = u.views(["a", "never-seen"])
    assert v["a"].tokens_per_minute == 0 and v["a"].share is None
    assert v["a"].throttled_last_minute == 0 and v["a"].throttled_total == 2
    assert set(v) == {"a", "never-seen"} and v["never-seen"].view()["in_flight"] == 0
    assert u.views()["b"].in_flight == 1  # still running: in flight however long


def test_a_bucket_reused_a_minute_later_starts_empty():
    clock = Clock()
    u = KeyUsage(clock)
    u.admitted("a", 7)
    clock.now += 60  # the same bucket (second % 60), a minute on
    u.admitted("a", 3)
    assert u.views()["a"].tokens_per_minute == 3
    assert u.views()["a"].requests_per_minute == 1


def test_worst_first_is_most_refused_now_then_highest_share_then_budget_use():
    def entry(name, refused_now=0, share=None, use=None, refused=0):
        return {
            "name": name,
            "usage": {
                "throttled_last_minute": refused_now,
                "share": share,
                "throttled_total": refused,
                "in_flight": 0,
            },
            "budget": {"use": use},
        }

    keys = [
        entry("quiet"),
        entry("big", share=0.9),
        entry("spender", share=0.1, use=0.95),
        entry("throttled", refused_now=3, share=0.0, refused=3),
        entry("once-throttled", refused=50),
    ]
    order = [k["name"] for k in sorted(keys, key=sort_key("worst"))]
    assert order == ["throttled", "big", "spender", "once-throttled", "quiet"]

    def first(sort: str) -> str:
        return min(keys, key=sort_key(sort))["name"]

    assert first("throttled") == "once-throttled" and first("use") == "spender"
    assert first("name") == "big"
    bare = {"name": "zz-config-key"}  # no usage, no budget: after every figure (then by name)
    for sort in SORTS:
        assert sorted([bare, *keys], key=sort_key(sort))[-1] is bare, sort


def test_throttled_counter_shares_the_budget_counters_bounded_key_label():
    m = Metrics(MODEL)
    for i in range(MAX_BUDGET_KEY_LABELS):
        m.budget_request(f"k{i}", "rejected")
    m.request_throttled("k0", "tokens_per_minute")  # a key with a label already keeps it
    m.request_throttled("one-too-many", "max_concurrent")  # beyond the bound: (other)
    m.request_throttled("one-too-many", "max_concurrent")
    s = scrape(m)
    name = P + "requests_throttled_total"
    assert value(s, name, api_key="k0", reason="tokens_per_minute") == 1
    assert value(s, name, api_key=OTHER_KEY, reason="max_concurrent") == 2
    keys = {dict(labels).get("api_key") for (n, labels) in s if n.startswith(P + "budget_")}
    keys |= {dict(labels).get("api_key") for (n, labels) in s if n == name}
    assert len(keys - {None}) == MAX_BUDGET_KEY_LABELS + 1  # the names, plus (other)


def test_queue_time_by_priority_class():
    m = Metrics(MODEL)
    r = RequestMetrics(100.0, 100.5, 101.0, 103.0, num_prompt_tokens=10, num_output_tokens=4)
    m.observe_request("stop", r, priority_class=9)
    m.observe_request("stop", r, priority_class=0)
    m.observe_request("stop", r, priority_class=0)
    waiting = RequestMetrics(200.0, None, None, 201.0, num_prompt_tokens=3, num_output_tokens=0)
    m.observe_request("abort", waiting, priority_class=0)  # never scheduled: no queue time
    m.observe_request("stop", r)  # no class given: not in the by-class histogram
    s = scrape(m)
    name = P + "request_queue_time_by_class_seconds"
    assert value(s, name + "_count", priority_class="0") == 2
    assert value(s, name + "_sum", priority_class="9") == pytest.approx(0.5)
    assert value(s, P + "request_queue_time_seconds_count") == 4
