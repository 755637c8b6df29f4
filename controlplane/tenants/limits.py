"""Rate limits per API key: requests per minute, tokens per minute, requests in flight and the
most tokens one request may ask for ([limits] in the config, defaults for every key).

The algorithm is a token bucket per key and dimension (GCRA's continuous form): a bucket holds
at most the per-minute limit and refills at limit / 60 per second; a request takes 1 from the
requests bucket and its reserved tokens from the tokens bucket, or is refused with the seconds
until the bucket holds enough (`Retry-After`). Why a bucket and not a sliding window: it is what
OpenAI's headers describe (`x-ratelimit-reset-*` is the time until the bucket is full again, a
few milliseconds after one request at a high limit), its state is two numbers a key (one Redis
hash, one round trip for a check), and a reservation is corrected exactly when the request ends
(the unused part is put back). The tolerance it implies: over any span of T seconds a key gets
at most limit + limit * T / 60 requests (a full bucket, then the refill); in a burst that is
the limit itself.

Tokens are counted as OpenAI and vLLM count them: at admission the prompt tokens plus the most
completion tokens the request may produce (max_tokens times its choices) are reserved; when the
request ends the reservation is corrected to prompt + the completion tokens it produced.

Backends: `MemoryLimiter` (one daemon) and `RedisLimiter` (controlplane.tenants.redis_limits: a
fleet shares one limit through one Lua script per check, atomic in Redis).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# The per-key columns the keys' SQL table carries (nullable: the [limits] default), in the order
# of LimitsSettings' fields of the same names.
LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "max_tokens_per_request",
)

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """One key's limits; 0: unlimited."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0
    max_tokens_per_request: int = 0

    @property
    def limited(self) -> bool:
        return any(getattr(self, f) for f in LIMIT_FIELDS)

    @property
    def counted(self) -> bool:
        """Whether the backend keeps state for this key (max_tokens_per_request alone needs
        none)."""
        return bool(self.requests_per_minute or self.tokens_per_minute or self.max_concurrent)


# A key's own limits (its SQL row's columns, None where it has none): None for a key without
# a row. Today every key takes the defaults.
Overrides = Callable[[str | None], Mapping[str, int | None] | None]


def no_overrides(_: str | None) -> Mapping[str, int | None] | None:
    return None


def limits_for(
    key_name: str | None, defaults: Any, overrides: Overrides = no_overrides
) -> KeyLimits:
    """The limits of the key named `key_name` (None: an open API): each of its own values
    (`overrides(key_name)`, a row's nullable columns) where set, else the [limits] default
    (`defaults`: a LimitsSettings)."""
    own = overrides(key_name) or {}
    return KeyLimits(
        *(
            own[f] if own.get(f) is not None else getattr(defaults, f)  # type: ignore[misc]
            for f in LIMIT_FIELDS
        )
    )


@dataclass(slots=True)
class Lease:
    """An admitted request's hold on its key's counters, given back by `release`."""

    key: str
    limits: KeyLimits
    reserved_tokens: int
    prompt_tokens: int
    backed: bool = True  # False: admitted without the backend (Redis down, failing open)
    released: bool = False


@dataclass(frozen=True, slots=True)
class State:
    """A key's buckets as a check left them: what the headers say."""

    limits: KeyLimits
    requests_left: float = 0.0
    tokens_left: float = 0.0
    in_flight: int = 0


@dataclass(slots=True)
class Decision:
    allowed: bool
    state: State | None = None
    lease: Lease | None = None
    limit: str = ""  # which limit refused: requests_per_minute, tokens_per_minute, ...
    message: str = ""
    retry_after_s: float = 0.0
    status: int = 429
    code: str = "rate_limit_exceeded"
    extra_headers: dict[str, str] = field(default_factory=dict)


class Limiter(Protocol):
    async def acquire(
        self, key: str, limits: KeyLimits, tokens: int, prompt_tokens: int
    ) -> Decision: ...

    async def release(self, lease: Lease, used_tokens: int) -> None: ...

    async def peek(self, key: str, limits: KeyLimits) -> State | None: ...

    async def close(self) -> None: ...


def _refill(level: float, last: float, now: float, capacity: int) -> float:
    """A bucket of `capacity` per minute at `now`, from `level` at `last`."""
    if capacity <= 0:
        return 0.0
    return min(float(capacity), level + max(0.0, now - last) * capacity / WINDOW_S)


def wait_for(level: float, need: float, capacity: int) -> float:
    """Seconds until a bucket at `level` (refilling at capacity / 60 per second) holds `need`."""
    if level >= need or capacity <= 0:
        return 0.0
    return (need - level) * WINDOW_S / capacity


def refused(limits: KeyLimits, state: State, which: str, need: int, wait: float) -> Decision:
    """The 429 for `which` (a field of KeyLimits) refusing a request that needs `need`."""
    value = getattr(limits, which)
    words = {
        "requests_per_minute": "requests per minute",
        "tokens_per_minute": "tokens per minute",
        "max_concurrent": "concurrent requests",
        "max_tokens_per_request": "tokens per request",
    }[which]
    if which == "tokens_per_minute":
        left = max(0, math.floor(state.tokens_left))
        detail = f"requested {need}, {left} left"
    elif which == "requests_per_minute":
        detail = "none left"
    elif which == "max_concurrent":
        detail = f"{state.in_flight} in flight"
    else:
        detail = f"requested {need}"
    message = (
        f"Rate limit reached for this API key on {words} ({value}): {detail}; "
        f"retry after {max(1, math.ceil(wait))}s (limits.{which})"
    )
    return Decision(False, state, limit=which, message=message, retry_after_s=wait)


def too_large(limits: KeyLimits, tokens: int) -> Decision | None:
    """A request no bucket can ever admit: more tokens than max_tokens_per_request, or than the
    whole tokens-per-minute bucket (OpenAI's "Request too large"). None: it fits."""
    for which in ("max_tokens_per_request", "tokens_per_minute"):
        value = getattr(limits, which)
        if value and tokens > value:
            words = (
                "tokens per request" if which == "max_tokens_per_request" else "tokens per minute"
            )
            return Decision(
                False,
                None,
                limit=which,
                message=(
                    f"Request too large for this API key on {words} ({value}): requested "
                    f"{tokens} (prompt + max_tokens); lower max_tokens or the prompt "
                    f"(limits.{which})"
                ),
            )
    return None


@dataclass(slots=True)
class _Key:
    requests: float
    tokens: float
    at: float
    in_flight: int = 0


class MemoryLimiter:
    """In-process counters: one daemon's limits. Every call runs on the event loop (no awaits
    inside), so a check and its update are one step."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.keys: dict[str, _Key] = {}

    def _key(self, key: str, limits: KeyLimits, now: float) -> _Key:
        k = self.keys.get(key)
        if k is None:
            k = self.keys[key] = _Key(
                float(limits.requests_per_minute), float(limits.tokens_per_minute), now
            )
        else:  # refilled to now (a limit lowered live caps what is left at once)
            k.requests = _refill(k.requests, k.at, now, limits.requests_per_minute)
            k.tokens = _refill(k.tokens, k.at, now, limits.tokens_per_minute)
            k.at = now
        return k

    def _state(self, k: _Key, limits: KeyLimits) -> State:
        return State(limits, k.requests, k.tokens, k.in_flight)

    async def acquire(
        self, key: str, limits: KeyLimits, tokens: int, prompt_tokens: int
    ) -> Decision:
        return self.acquire_now(key, limits, tokens, prompt_tokens)

    def acquire_now(self, key: str, limits: KeyLimits, tokens: int, prompt_tokens: int) -> Decision:
        big = too_large(limits, tokens)
        if big is not None:
            return big
        k = self._key(key, limits, self.clock())
        state = self._state(k, limits)
        if limits.max_concurrent and k.in_flight >= limits.max_concurrent:
            return refused(limits, state, "max_concurrent", 1, 1.0)
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        if rpm and k.requests < 1:
            return refused(limits, state, "requests_per_minute", 1, wait_for(k.requests, 1, rpm))
        if tpm and k.tokens < tokens:
            wait = wait_for(k.tokens, tokens, tpm)
            return refused(limits, state, "tokens_per_minute", tokens, wait)
        if rpm:
            k.requests -= 1
        if tpm:
            k.tokens -= tokens
        k.in_flight += 1
        lease = Lease(key, limits, tokens, prompt_tokens)
        return Decision(True, self._state(k, limits), lease)

    async def release(self, lease: Lease, used_tokens: int) -> None:
        self.release_now(lease, used_tokens)

    def release_now(self, lease: Lease, used_tokens: int) -> None:
        """The request ended having used `used_tokens` (prompt + completion): its reservation
        is corrected (the unused part put back, an overrun taken) and its slot freed."""
        if lease.released or not lease.backed:
            lease.released = True
            return
        lease.released = True
        k = self._key(lease.key, lease.limits, self.clock())
        k.in_flight = max(0, k.in_flight - 1)
        tpm = lease.limits.tokens_per_minute
        if tpm:
            k.tokens = min(float(tpm), k.tokens + lease.reserved_tokens - used_tokens)

    async def peek(self, key: str, limits: KeyLimits) -> State | None:
        if not limits.counted:
            return None
        k = self.keys.get(key)
        if k is None:
            return State(limits, limits.requests_per_minute, limits.tokens_per_minute, 0)
        return self._state(self._key(key, limits, self.clock()), limits)

    async def close(self) -> None:
        return None


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it (Go's duration format): 17ms, 1s, 8.64s, 6m0s, 1h2m3s."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    seconds = round(seconds, 3)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes:
        return f"{int(minutes)}m{text}"
    return text


def headers(state: State) -> dict[str, str]:
    """OpenAI's rate-limit headers for a key's state: the requests ones with a requests-per-
    minute limit, the tokens ones with a tokens-per-minute limit."""
    out: dict[str, str] = {}
    lim = state.limits
    for name, capacity, left in (
        ("requests", lim.requests_per_minute, state.requests_left),
        ("tokens", lim.tokens_per_minute, state.tokens_left),
    ):
        if capacity:
            out[f"x-ratelimit-limit-{name}"] = str(capacity)
            out[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(left)))
            out[f"x-ratelimit-reset-{name}"] = duration(wait_for(left, capacity, capacity))
    return out


def decision_headers(decision: Decision) -> dict[str, str]:
    """A refusal's headers: Retry-After (whole seconds, at least 1) and retry-after-ms (the
    openai SDK reads it first), plus the rate-limit headers of the key's state."""
    out = headers(decision.state) if decision.state is not None else {}
    if not decision.allowed and decision.retry_after_s > 0:
        out["Retry-After"] = str(max(1, math.ceil(decision.retry_after_s)))
        out["retry-after-ms"] = str(max(1, math.ceil(decision.retry_after_s * 1000)))
    out.update(decision.extra_headers)
    return out


class RateLimits:
    """The daemon's rate limits: each key's limits (`limits_for`) and the backend that counts
    them, built from the live [limits] section (`settings()`: a LimitsSettings) and rebuilt
    when its backend, redis_url or redis_failure changes. `overrides`: a key's own limits (the
    keys table's per-key columns; today none). `redis(url, failure)`: the Redis backend's
    constructor (controlplane.tenants.redis_limits.RedisLimiter, passed in: that module imports
    this one)."""

    def __init__(
        self,
        settings: Callable[[], Any],
        overrides: Overrides = no_overrides,
        redis: Callable[[str, str], Limiter] | None = None,
    ) -> None:
        self.settings = settings
        self.overrides = overrides
        self.redis = redis
        self._backend: Limiter | None = None
        self._built_for: tuple[str, str, str] | None = None
        self._old: list[Limiter] = []

    def limits(self, key_name: str | None) -> KeyLimits:
        return limits_for(key_name, self.settings(), self.overrides)

    def backend(self) -> Limiter:
        s = self.settings()
        spec = (s.backend, s.redis_url, s.redis_failure)
        if self._backend is None or spec != self._built_for:
            if self._backend is not None:
                self._old.append(self._backend)  # closed by close(): leases may still use it
            if s.backend == "redis":
                if self.redis is None:
                    raise RuntimeError("limits.backend = redis, but no Redis backend was given")
                self._backend = self.redis(s.redis_url, s.redis_failure)
            else:
                self._backend = MemoryLimiter()
            self._built_for = spec
        return self._backend

    async def admit(
        self, key_name: str | None, tokens: int, prompt_tokens: int
    ) -> tuple[Decision | None, Limiter | None]:
        """The check of one request reserving `tokens`: (None, None) for a key without limits;
        else the decision and the backend that made it (its lease goes back there)."""
        limits = self.limits(key_name)
        if not limits.limited:
            return None, None
        backend = self.backend()
        return await backend.acquire(_name(key_name), limits, tokens, prompt_tokens), backend

    async def peek(self, key_name: str | None) -> dict[str, str]:
        """The rate-limit headers of a key right now, nothing taken ({} without limits)."""
        limits = self.limits(key_name)
        if not limits.counted:
            return {}
        state = await self.backend().peek(_name(key_name), limits)
        return {} if state is None else headers(state)

    async def close(self) -> None:
        for b in [*self._old, *([self._backend] if self._backend else [])]:
            await b.close()
        self._old, self._backend, self._built_for = [], None, None


def _name(key_name: str | None) -> str:
    """The counters' name of a key; an open API's requests share one, "(open)"."""
    return "(open)" if key_name is None else key_name
