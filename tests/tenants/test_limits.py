"""Issue 55, limits: the token-bucket arithmetic of the in-process limiter (on a fake clock),
OpenAI's header formats, the [limits] section's hostile values, and the Redis backend on the
real Redis at 127.0.0.1:6379 (two limiters share one limit; Redis down fails open or closed)."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest

from controlplane.config import LimitsSettings, build_config
from controlplane.errors import FieldError
from controlplane.tenants.limits import (
    KeyLimits,
    MemoryLimiter,
    RateLimits,
    decision_headers,
    duration,
    headers,
    limits_for,
)
from controlplane.tenants.redis_limits import RedisLimiter

REDIS_URL = "redis://127.0.0.1:6379/0"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(coro)


def test_requests_bucket_refills_continuously():
    clock = Clock()
    lim = MemoryLimiter(clock)
    rpm = KeyLimits(requests_per_minute=3)
    for left in (2, 1, 0):
        d = lim.acquire_now("a", rpm, 0, 0)
        assert d.allowed and headers(d.state)["x-ratelimit-remaining-requests"] == str(left)
    d = lim.acquire_now("a", rpm, 0, 0)
    assert not d.allowed and d.limit == "requests_per_minute"
    assert "requests per minute (3)" in d.message
    assert d.retry_after_s == pytest.approx(20.0)  # one request refills in 60 / 3 s
    h = decision_headers(d)
    assert h["Retry-After"] == "20" and h["retry-after-ms"] == "20000"
    assert h["x-ratelimit-reset-requests"] == "1m0s"  # empty: 3 x 20 s to full
    clock.now += 5
    d = lim.acquire_now("a", rpm, 0, 0)
    assert not d.allowed and d.retry_after_s == pytest.approx(15.0)  # the window slides
    clock.now += 15
    assert lim.acquire_now("a", rpm, 0, 0).allowed
    assert not lim.acquire_now("a", rpm, 0, 0).allowed
    # Another key has its own bucket.
    assert lim.acquire_now("b", rpm, 0, 0).allowed


def test_tokens_reserved_then_corrected_to_use():
    clock = Clock()
    lim = MemoryLimiter(clock)
    tpm = KeyLimits(tokens_per_minute=1000)
    d = lim.acquire_now("a", tpm, 600, 100)  # 100 prompt + 500 max_tokens reserved
    assert d.allowed and d.state.tokens_left == 400
    refused = lim.acquire_now("a", tpm, 600, 100)
    assert not refused.allowed and refused.limit == "tokens_per_minute"
    assert refused.retry_after_s == pytest.approx(200 * 60 / 1000)  # 200 short at 1000/min
    assert "tokens per minute (1000)" in refused.message
    lim.release_now(d.lease, 100 + 20)  # it produced 20 completion tokens: 480 come back
    state = run(lim.peek("a", tpm))
    assert state.tokens_left == pytest.approx(880)
    assert headers(state)["x-ratelimit-reset-tokens"] == "7.2s"  # 120 tokens at 1000/min
    lim.release_now(d.lease, 0)  # a lease goes back once
    assert run(lim.peek("a", tpm)).tokens_left == pytest.approx(880)
    clock.now += 600
    assert run(lim.peek("a", tpm)).tokens_left == 1000  # never above the limit


def test_too_large_and_concurrency():
    lim = MemoryLimiter(Clock())
    limits = KeyLimits(max_concurrent=2, max_tokens_per_request=100, tokens_per_minute=1000)
    big = lim.acquire_now("a", limits, 101, 1)
    assert not big.allowed and big.limit == "max_tokens_per_request"
    assert "tokens per request (100)" in big.message
    assert "Retry-After" not in decision_headers(big)  # retrying cannot help
    first, second = (lim.acquire_now("a", limits, 10, 1) for _ in range(2))
    third = lim.acquire_now("a", limits, 10, 1)
    assert first.allowed and second.allowed and not third.allowed
    assert third.limit == "max_concurrent" and "concurrent requests (2)" in third.message
    lim.release_now(first.lease, 10)
    assert lim.acquire_now("a", limits, 10, 1).allowed


def test_reset_durations_as_openai_writes_them():
    assert duration(0.017) == "17ms"
    assert duration(1) == "1s"
    assert duration(8.64) == "8.64s"
    assert duration(360) == "6m0s"
    assert duration(88.8) == "1m28.8s"
    assert duration(3723) == "1h2m3s"
    assert duration(0) == "0s"


def test_limits_for_takes_a_keys_own_values_over_the_defaults():
    defaults = LimitsSettings(requests_per_minute=60, tokens_per_minute=1000)
    assert limits_for("a", defaults) == KeyLimits(60, 1000, 0, 0)
    own = {"requests_per_minute": 5, "tokens_per_minute": None, "max_concurrent": 2}
    got = limits_for("a", defaults, lambda name: own if name == "a" else None)
    assert got == KeyLimits(5, 1000, 2, 0)
    assert (
        limits_for("b", defaults, lambda name: own if name == "a" else None).requests_per_minute
        == 60
    )


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("requests_per_minute", -1, "must be in [0, 100000000]"),
        ("tokens_per_minute", 10**30, "must be in [0,"),
        ("max_concurrent", 10**12, "must be in [0, 1000000]"),
        ("max_tokens_per_request", -5, "must be in [0,"),
        ("requests_per_minute", 1.5, "must be a int"),
        ("backend", "memcached", "must be one of memory, redis"),
        ("redis_failure", "maybe", "must be one of open, closed"),
        ("redis_url", "http://x", "must be a redis://"),
    ],
)
def test_hostile_limits_refused_naming_the_field(key, value, says):
    with pytest.raises(FieldError) as err:
        build_config({"limits": {key: value}}, env={})
    assert err.value.field == f"limits.{key}" and says in err.value.message


def test_limits_from_the_environment():
    cfg = build_config({}, env={"CONTROLPLANE_LIMITS__REQUESTS_PER_MINUTE": "7"})
    assert cfg.limits.requests_per_minute == 7
    with pytest.raises(FieldError) as err:
        build_config({}, env={"CONTROLPLANE_LIMITS__MAX_CONCURRENT": "-2"})
    assert err.value.field == "limits.max_concurrent"


# -- Redis ---------------------------------------------------------------------------------------


def redis_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5):
            return True
    except OSError:
        return False


needs_redis = pytest.mark.skipif(not redis_up(), reason="no Redis on 127.0.0.1:6379")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rate_limits(**settings) -> RateLimits:
    s = LimitsSettings(**settings)
    return RateLimits(lambda: s, redis=RedisLimiter)


@needs_redis
def test_two_redis_limiters_share_one_limit():
    """Two daemons' limiters (two clients) on one Redis: a key limited to N requests a minute
    gets N admitted across both, whoever asks, under concurrent calls."""
    key = f"shared-{uuid.uuid4().hex}"
    n = 10

    async def go():
        a = rate_limits(requests_per_minute=n, backend="redis", redis_url=REDIS_URL)
        b = rate_limits(requests_per_minute=n, backend="redis", redis_url=REDIS_URL)
        try:
            calls = [(a if i % 2 else b).admit(key, 0, 0) for i in range(3 * n)]
            results = await asyncio.gather(*calls)
            admitted = [d for d, _ in results if d.allowed]
            refused = [d for d, _ in results if not d.allowed]
            assert len(admitted) == n
            assert {d.limit for d in refused} == {"requests_per_minute"}
            assert all(0 < d.retry_after_s <= 60 / n + 1 for d in refused)
            # Both see the same counters.
            assert (await a.peek(key))["x-ratelimit-remaining-requests"] == "0"
            assert (await b.peek(key))["x-ratelimit-limit-requests"] == str(n)
        finally:
            await a.close()
            await b.close()

    run(go())


@needs_redis
def test_redis_tokens_corrected_and_concurrency_shared():
    key = f"tok-{uuid.uuid4().hex}"

    async def go():
        a = rate_limits(
            tokens_per_minute=1000, max_concurrent=1, backend="redis", redis_url=REDIS_URL
        )
        b = rate_limits(
            tokens_per_minute=1000, max_concurrent=1, backend="redis", redis_url=REDIS_URL
        )
        try:
            d, backend = await a.admit(key, 600, 100)
            assert d.allowed and round(d.state.tokens_left) == 400
            busy, _ = await b.admit(key, 10, 5)
            assert not busy.allowed and busy.limit == "max_concurrent"
            await backend.release(d.lease, 120)
            left = int((await b.peek(key))["x-ratelimit-remaining-tokens"])
            assert 880 <= left <= 885  # 480 put back (and a few ms of refill)
            again, _ = await b.admit(key, 10, 5)
            assert again.allowed
        finally:
            await a.close()
            await b.close()

    run(go())


@needs_redis
def test_a_burst_of_checks_is_counted_not_taken_for_an_outage(caplog):
    """More concurrent checks than the client's connections (150 at once, as a daemon sees
    when 150 requests arrive together): each waits for a connection and is counted. Found by
    benchmarks/admission_overhead.py: redis-py's asyncio pool (100 connections) raised
    MaxConnectionsError for the rest, which the limiter took for Redis down: those requests
    were admitted uncounted (open: a burst slipped past the limit) or refused with 503
    (closed), an outage was logged, and the checks of the next second skipped Redis."""
    key = f"burst-{uuid.uuid4().hex}"
    n = 150

    async def go():
        lim = RedisLimiter(REDIS_URL, "closed")
        try:
            limits = KeyLimits(requests_per_minute=n - 10)
            decisions = await asyncio.gather(*(lim.acquire(key, limits, 0, 0) for _ in range(n)))
            return decisions, lim.failures, lim.outages
        finally:
            await lim.close()

    with caplog.at_level("WARNING", logger="controlplane.limits"):
        decisions, failures, outages = run(go())
    assert failures == 0 and outages == 0
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
    admitted = [d for d in decisions if d.allowed]
    assert len(admitted) == n - 10 and all(d.lease.backed for d in admitted)
    assert {d.limit for d in decisions if not d.allowed} == {"requests_per_minute"}


@pytest.mark.parametrize("failure", ["open", "closed"])
def test_redis_down_fails_open_or_closed(failure, caplog):
    url = f"redis://127.0.0.1:{closed_port()}/0"

    async def go():
        lim = rate_limits(
            requests_per_minute=1, backend="redis", redis_url=url, redis_failure=failure
        )
        try:
            results = [await lim.admit("k", 0, 0) for _ in range(3)]
            backend = lim.backend()
            assert backend.failures == 3 and backend.outages == 1
            return [d for d, _ in results], backend
        finally:
            await lim.close()

    with caplog.at_level("WARNING", logger="controlplane.limits"):
        decisions, backend = run(go())
    outage_lines = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(outage_lines) == 1  # logged once per outage
    if failure == "open":
        assert all(d.allowed for d in decisions)  # above the limit of 1: uncounted
        assert backend.failed_open == 3
        assert not decisions[0].lease.backed
    else:
        assert not any(d.allowed for d in decisions)
        d = decisions[0]
        assert d.status == 503 and d.code == "rate_limiter_unavailable"
        assert "Redis is unreachable" in d.message and "redis_failure is closed" in d.message
        assert decision_headers(d)["Retry-After"] == "1"
