"""The cost of the rate limits' admission check (issue 55): per request, with the memory and
the Redis backends, against no limits, in microseconds and as a share of a request's time.

What is measured
----------------
* ``check``: what a /v1 request pays for its limits, in one process on one event loop:
  ``RateLimits.admit`` (the key's limits, then the backend's check and update) plus the
  lease's ``release`` when the request ends (the token correction), for one key limited on
  every dimension (limits far above what the run sends, so every check admits). ``none`` is the
  same call for a key without limits (the daemon's path when [limits] is all zeros): the
  baseline of the ratios. ``redis`` talks to the Redis at ``--redis-url`` (one Lua script a
  call, two calls a request).
* ``request``: a short completion (``--max-tokens`` tokens) through a daemon on loopback, on the
  random-weight demo model (small): the median of ``--requests`` requests, the time a check is
  compared with. A real model takes longer per request, so the share printed is an upper bound.

    python -m benchmarks.admission_limits
    python -m benchmarks.admission_limits --number 500 --requests 5   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from controlplane.config import LimitsSettings
from controlplane.tenants.limits import RateLimits
from controlplane.tenants.redis_limits import RedisLimiter

BIG = 1_000_000


async def per_request_us(limits: RateLimits, key: str, number: int, repeats: int) -> float:
    """Best of `repeats` runs: microseconds of one admission and its release."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            decision, backend = await limits.admit(key, 120, 100)
            if decision is not None:
                assert decision.allowed, decision.message
                assert backend is not None and decision.lease is not None
                await backend.release(decision.lease, 110)
        best = min(best, (time.perf_counter() - start) / number * 1e6)
    return best


def request_ms(requests: int, max_tokens: int) -> float:
    """Median milliseconds of a short completion through a daemon on the demo model."""
    import httpx

    from controlplane.engine.demo_model import write_demo_model
    from harness import InProcessDaemon

    folder = Path(tempfile.mkdtemp(prefix="admission-limits-"))
    model = write_demo_model(folder / "model", size="small")
    daemon = InProcessDaemon.configured(folder, model).start()
    try:
        body = {"model": "model", "prompt": "The capital of France is", "max_tokens": max_tokens}
        times = []
        with httpx.Client(base_url=daemon.url, timeout=120) as c:
            c.post("/v1/completions", json=body).raise_for_status()  # warm
            for _ in range(requests):
                start = time.perf_counter()
                c.post("/v1/completions", json=body).raise_for_status()
                times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)
    finally:
        daemon.stop(timeout=600)  # a drain on a loaded host takes its time


async def checks(args: argparse.Namespace) -> dict[str, float]:
    every = {
        "requests_per_minute": BIG,
        "tokens_per_minute": BIG * 1000,
        "max_concurrent": BIG,
        "max_tokens_per_request": BIG,
    }
    settings = {
        "none": LimitsSettings(),
        "memory": LimitsSettings(**every),
        "redis": LimitsSettings(**every, backend="redis", redis_url=args.redis_url),
    }
    out = {}
    for name, s in settings.items():
        limits = RateLimits(lambda s=s: s, redis=RedisLimiter)
        try:
            key = f"bench-{name}-{time.time_ns()}"
            await per_request_us(limits, key, max(10, args.number // 10), 1)  # warm
            out[name] = await per_request_us(limits, key, args.number, args.repeats)
        finally:
            await limits.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=5000, help="checks a run")
    parser.add_argument("--repeats", type=int, default=5, help="runs (the best is kept)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--requests", type=int, default=20, help="requests timed (median)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--no-request", action="store_true", help="skip the daemon's request")
    args = parser.parse_args()
    us = asyncio.run(checks(args))
    req = None if args.no_request else request_ms(args.requests, args.max_tokens)
    base = us["none"]
    print(f"admission check per request (best of {args.repeats} x {args.number}):")
    print(f"{'backend':<8} {'us':>9} {'vs none':>9} {'added us':>9} {'share of request':>17}")
    for name, value in us.items():
        share = "" if req is None else f"{(value - base) / (req * 1000):.4%}"
        print(f"{name:<8} {value:>9.2f} {value / base:>8.1f}x {value - base:>9.2f} {share:>17}")
    if req is not None:
        print(
            f"request: {req:.1f} ms median of {args.requests} ({args.max_tokens} tokens, demo model)"
        )


if __name__ == "__main__":
    main()
