"""Per-key live usage (issue 55, "Visible"): what each API key is doing right now, for
`GET /admin/keys`, `controlplane keys list` and the TUI's tenants screen.

Per key, over a sliding minute: requests admitted, tokens (prompt + completion, counted as the
limits count them), the key's share of all keys' tokens, and refusals; since the daemon
started: refusals by reason; right now: requests in flight.

Where it is counted: only in controlplane.openai.serving, at the three points every /v1
generation request passes through once (`InferenceAPI._start`: admitted; its batch's end:
finished; `InferenceAPI.serve`: refused before anything was queued; plus the 403 of a
suspended key, which the route's guard answers before `serve` runs). Nothing else calls in
here, so the figures cannot drift from what admission decided.

When tokens count. A request's prompt tokens count when it is admitted and its completion
tokens when it ends (a stream's at its end): a flood of long prompts shows at once, without a
hook on every generated token. So `tokens_per_minute` is "prompt tokens admitted plus
completion tokens of requests ended, in the last minute", and the share is of those tokens
across every key on this daemon.

Why buckets and not a log of events: a key sending thousands of requests a second would keep
thousands of timestamps; sixty one-second buckets a key are a fixed size and a sliding minute
to within one second, which is what a live view needs. State is per daemon, in memory: a
restart starts from zero (Prometheus keeps the refusal counters' history, and the `refusals`
table the reports', per hour: serving counts each refusal there too, through the ledger).

Every call happens on the daemon's event loop (admission, the flights' end callbacks, the
admin route), so there is no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 60  # the sliding minute, in one-second buckets
# A key's name in the usage of an open API (no key configured): as the limiter names it. Not a
# valid key name (names start with a letter or digit), so it cannot collide with one.
OPEN = "(open)"

# Why a request was refused, the `reason` of controlplane:requests_throttled_total and of each
# key's `throttled` counts. The first four are the rate limits (429, controlplane.tenants.limits;
# a request that could never fit is counted under the limit it exceeds); `insufficient_quota`:
# the key's budget (429, budget_action reject); `queue_full`: the server's waiting queue
# (server.max_queue_len, 429), refused for the server's load, not the key's; `limiter_unavailable`:
# Redis unreachable with limits.redis_failure = closed (503); `suspended`: server.suspended_keys
# (403). A fixed set: the metric's second label cannot grow.
REASONS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "max_tokens_per_request",
    "insufficient_quota",
    "queue_full",
    "limiter_unavailable",
    "suspended",
)
# An APIError's `code` -> the reason, for refusals whose code alone says it (the rate limits'
# code, rate_limit_exceeded, is the same for all four: admission records which limit it was).
REASON_OF_CODE = {
    "insufficient_quota": "insufficient_quota",
    "queue_full": "queue_full",
    "rate_limiter_unavailable": "limiter_unavailable",
    "api_key_suspended": "suspended",
}


@dataclass(slots=True)
class _Bucket:
    second: int = -1  # which second (of the clock) this bucket holds; older: empty
    requests: int = 0
    tokens: int = 0
    throttled: int = 0


@dataclass(slots=True)
class _Key:
    buckets: list[_Bucket] = field(default_factory=lambda: [_Bucket() for _ in range(WINDOW_S)])
    in_flight: int = 0
    throttled: dict[str, int] = field(default_factory=dict)  # reason -> since the start

    def bucket(self, second: int) -> _Bucket:
        b = self.buckets[second % WINDOW_S]
        if b.second != second:  # a minute old (or never used): start it again
            b.second, b.requests, b.tokens, b.throttled = second, 0, 0, 0
        return b

    def minute(self, second: int) -> tuple[int, int, int]:
        """(requests, tokens, refusals) of the minute ending with `second`."""
        live = [b for b in self.buckets if second - WINDOW_S < b.second <= second]
        return (
            sum(b.requests for b in live),
            sum(b.tokens for b in live),
            sum(b.throttled for b in live),
        )


@dataclass(frozen=True, slots=True)
class KeyView:
    """One key's figures as /admin/keys shows them (`usage`)."""

    requests_per_minute: int
    tokens_per_minute: int
    share: float | None  # of every key's tokens in the minute; None: no key used any
    in_flight: int
    throttled_last_minute: int
    throttled: dict[str, int]  # reason -> count since the daemon started

    @property
    def throttled_total(self) -> int:
        return sum(self.throttled.values())

    def view(self) -> dict[str, Any]:
        return {
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "share": None if self.share is None else round(self.share, 4),
            "in_flight": self.in_flight,
            "throttled_last_minute": self.throttled_last_minute,
            "throttled_total": self.throttled_total,
            "throttled": dict(self.throttled),
        }


class KeyUsage:
    """Every key's live usage on this daemon. `key` arguments are key names; None (an open
    API's requests) is kept as OPEN."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._keys: dict[str, _Key] = {}

    def _key(self, name: str | None) -> _Key:
        name = OPEN if name is None else name
        k = self._keys.get(name)
        if k is None:
            k = self._keys[name] = _Key()
        return k

    def _second(self) -> int:
        return int(self.clock())

    def admitted(self, key: str | None, prompt_tokens: int) -> None:
        """A request was admitted (queued in the engine) with these prompt tokens."""
        k = self._key(key)
        b = k.bucket(self._second())
        b.requests += 1
        b.tokens += prompt_tokens
        k.in_flight += 1

    def finished(self, key: str | None, completion_tokens: int) -> None:
        """An admitted request ended (any way: done, aborted, failed) having produced these
        completion tokens (every choice)."""
        k = self._key(key)
        k.bucket(self._second()).tokens += completion_tokens
        k.in_flight = max(0, k.in_flight - 1)

    def refused(self, key: str | None, reason: str) -> None:
        """A request of `key` was refused for `reason` (one of REASONS) before anything ran."""
        k = self._key(key)
        k.bucket(self._second()).throttled += 1
        k.throttled[reason] = k.throttled.get(reason, 0) + 1

    def names(self) -> list[str]:
        """Every key seen since the daemon started (OPEN for an open API's requests)."""
        return list(self._keys)

    def views(self, names: Iterable[str] | None = None) -> dict[str, KeyView]:
        """name -> its figures now, for `names` (default: every key seen); a key never seen
        reads all zeros. The share is of every key's tokens, whether asked for or not."""
        now = self._second()
        minutes = {n: k.minute(now) for n, k in self._keys.items()}
        total = sum(tokens for _, tokens, _ in minutes.values())
        out: dict[str, KeyView] = {}
        for name in self.names() if names is None else names:
            k = self._keys.get(name)
            requests, tokens, throttled = minutes.get(name, (0, 0, 0))
            out[name] = KeyView(
                requests_per_minute=requests,
                tokens_per_minute=tokens,
                share=tokens / total if total else None,
                in_flight=0 if k is None else k.in_flight,
                throttled_last_minute=throttled,
                throttled={} if k is None else dict(k.throttled),
            )
        return out


# -- ordering /admin/keys ---------------------------------------------------------------------
# `?sort=` names -> what a key sorts by. Every figure sorts highest first; `name` A to Z.
# "worst" (the default): most refusals in the last minute, then the highest share of the
# engine's tokens, then the most of its budget used, then most refusals since the start, then
# most in flight, then the name: the key to look at first is the one being turned away now,
# then the one taking the engine.
SORTS = (
    "worst",
    "name",
    "requests_per_minute",
    "tokens_per_minute",
    "share",
    "in_flight",
    "throttled",
    "throttled_last_minute",
    "spend",
    "use",
)


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else -1.0


def sort_key(sort: str) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """The key function ordering /admin/keys' entries (each with `usage` and `budget`) by
    `sort` (one of SORTS), worst first."""

    def figures(k: dict[str, Any]) -> dict[str, float]:
        u = k.get("usage") or {}
        b = k.get("budget") or {}
        return {
            "requests_per_minute": _num(u.get("requests_per_minute")),
            "tokens_per_minute": _num(u.get("tokens_per_minute")),
            "share": _num(u.get("share")),
            "in_flight": _num(u.get("in_flight")),
            "throttled": _num(u.get("throttled_total")),
            "throttled_last_minute": _num(u.get("throttled_last_minute")),
            "spend": _num(b.get("spend_usd")),
            "use": _num(b.get("use")),
        }

    def key(k: dict[str, Any]) -> tuple[Any, ...]:
        name = str(k.get("name"))
        if sort == "name":
            return (name,)
        f = figures(k)
        if sort == "worst":
            order = ("throttled_last_minute", "share", "use", "throttled", "in_flight")
            return (*(-f[o] for o in order), name)
        return (-f[sort], name)

    return key
