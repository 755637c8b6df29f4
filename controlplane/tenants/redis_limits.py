"""The Redis backend of the rate limits: every daemon of a fleet checks one key's buckets in one
Redis hash, through one Lua script (atomic in Redis: two daemons cannot both take the last
request), on Redis's clock (daemons' clocks may differ). The arithmetic is MemoryLimiter's
(controlplane.tenants.limits), written once more in Lua.

Redis down (refused, timed out): `failure = "open"` admits the request uncounted, `"closed"`
refuses it with a 503 naming the cause; either way the outage is logged once (and its end once)
and every failed call is counted (`failures`). While Redis is down, a check does not wait for it
more than once a `RETRY_S`: the calls in between take the failure path at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from controlplane.tenants.limits import (
    Decision,
    KeyLimits,
    Lease,
    State,
    refused,
    too_large,
    wait_for,
)

log = logging.getLogger("controlplane.limits")

PREFIX = "controlplane:ratelimit:"
# How long a key's hash outlives its last check: a full bucket needs no state, but the count of
# requests in flight does (a daemon that dies with requests in flight leaves them counted this
# long).
TTL_MS = 600_000
RETRY_S = 1.0
TIMEOUT_S = 0.5
MAX_CONNECTIONS = 64  # a daemon's connections to Redis; more checks at once wait for one

# KEYS[1]: the key's hash. ARGV: mode (acquire, release, peek), rpm, tpm, max_concurrent,
# tokens (acquire: the reservation; release: what to put back, negative for an overrun), ttl_ms.
# Returns {status, requests_left, tokens_left, in_flight}: status 0 admitted (or done),
# 1 max_concurrent, 2 requests_per_minute, 3 tokens_per_minute.
SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local mode = ARGV[1]
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local v = redis.call('HMGET', KEYS[1], 'r', 't', 'at', 'n')
local r = tonumber(v[1]) or rpm
local tk = tonumber(v[2]) or tpm
local at = tonumber(v[3]) or now
local n = tonumber(v[4]) or 0
local dt = now - at
if dt < 0 then dt = 0 end
if rpm > 0 then r = math.min(rpm, r + dt * rpm / 60) else r = 0 end
if tpm > 0 then tk = math.min(tpm, tk + dt * tpm / 60) else tk = 0 end
local status = 0
if mode == 'acquire' then
  if conc > 0 and n >= conc then status = 1
  elseif rpm > 0 and r < 1 then status = 2
  elseif tpm > 0 and tk < tokens then status = 3
  else
    if rpm > 0 then r = r - 1 end
    if tpm > 0 then tk = tk - tokens end
    n = n + 1
  end
elseif mode == 'release' then
  n = n - 1
  if n < 0 then n = 0 end
  if tpm > 0 then tk = math.min(tpm, tk + tokens) end
end
if mode ~= 'peek' then
  redis.call('HSET', KEYS[1], 'r', tostring(r), 't', tostring(tk), 'at', tostring(now), 'n', n)
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {status, tostring(r), tostring(tk), n}
"""

_REFUSED = {1: "max_concurrent", 2: "requests_per_minute", 3: "tokens_per_minute"}


class RedisLimiter:
    def __init__(self, url: str, failure: str = "open", *, timeout_s: float = TIMEOUT_S) -> None:
        self.url, self.failure = url, failure
        # A burst of checks waits for one of MAX_CONNECTIONS (at most timeout_s, as for an
        # answer): redis-py's default pool raises at once past its 100, which read as Redis down.
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # A dropped connection is tried once more, at once, on a fresh one: the pool's idle
            # connections to a Redis that restarted fail on their first use (one more "outage"
            # logged after it answered again, seen in the kill-and-restart test). A timeout is
            # never retried: a check waits at most timeout_s.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self.client = Redis.from_pool(pool)  # closed with the client
        self.script = self.client.register_script(SCRIPT)
        self.failures = 0  # calls that found Redis unreachable
        self.outages = 0  # times it went down (each logged once)
        self.failed_open = 0  # requests admitted uncounted (failure = open)
        self.down_since: float | None = None
        self._retry_at = 0.0

    async def _call(self, mode: str, key: str, limits: KeyLimits, tokens: int) -> list[Any] | None:
        """The script's answer, or None with Redis unreachable (counted, logged once)."""
        if self.down_since is not None and time.monotonic() < self._retry_at:
            self.failures += 1
            return None
        args = [
            mode,
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.max_concurrent,
            tokens,
            TTL_MS,
        ]
        try:
            out = await self.script(keys=[PREFIX + key], args=args)
        except (RedisError, OSError) as exc:
            self.failures += 1
            self._retry_at = time.monotonic() + RETRY_S
            if self.down_since is None:
                self.down_since = time.time()
                self.outages += 1
                log.warning(
                    "rate limits: Redis at %s is unreachable (%s); requests are %s until it "
                    "answers (limits.redis_failure = %s)",
                    _safe(self.url),
                    exc,
                    "admitted uncounted" if self.failure == "open" else "refused with 503",
                    self.failure,
                )
            return None
        if self.down_since is not None:
            log.warning(
                "rate limits: Redis at %s answers again after %.1f s",
                _safe(self.url),
                time.time() - self.down_since,
            )
            self.down_since = None
        return out

    @staticmethod
    def _state(limits: KeyLimits, out: list[Any]) -> State:
        return State(limits, float(out[1]), float(out[2]), int(out[3]))

    async def acquire(
        self, key: str, limits: KeyLimits, tokens: int, prompt_tokens: int
    ) -> Decision:
        big = too_large(limits, tokens)
        if big is not None:
            return big
        out = await self._call("acquire", key, limits, tokens)
        if out is None:
            if self.failure == "open":
                self.failed_open += 1
                return Decision(True, None, Lease(key, limits, tokens, prompt_tokens, backed=False))
            return Decision(
                False,
                None,
                limit="redis",
                message=(
                    "the rate limiter's Redis is unreachable and limits.redis_failure is closed: "
                    "requests with rate limits are refused until it answers; retry later"
                ),
                retry_after_s=RETRY_S,
                status=503,
                code="rate_limiter_unavailable",
            )
        state = self._state(limits, out)
        status = int(out[0])
        if status == 0:
            return Decision(True, state, Lease(key, limits, tokens, prompt_tokens))
        which = _REFUSED[status]
        if which == "max_concurrent":
            return refused(limits, state, which, 1, 1.0)
        if which == "requests_per_minute":
            wait = wait_for(state.requests_left, 1, limits.requests_per_minute)
            return refused(limits, state, which, 1, wait)
        wait = wait_for(state.tokens_left, tokens, limits.tokens_per_minute)
        return refused(limits, state, which, tokens, wait)

    async def release(self, lease: Lease, used_tokens: int) -> None:
        if lease.released or not lease.backed:
            lease.released = True
            return
        lease.released = True
        await self._call("release", lease.key, lease.limits, lease.reserved_tokens - used_tokens)

    async def peek(self, key: str, limits: KeyLimits) -> State | None:
        if not limits.counted:
            return None
        out = await self._call("peek", key, limits, 0)
        return None if out is None else self._state(limits, out)

    async def close(self) -> None:
        await self.client.aclose()


def _safe(url: str) -> str:
    """The URL without its password."""
    head, sep, tail = url.rpartition("@")
    if not sep:
        return url
    scheme, _, _ = head.partition("://")
    return f"{scheme}://***@{tail}"
