"""The pure half of a load run: the arrival schedule, the workload drawn from the seed, the error
kinds, and the aggregation of results into a LoadSummary."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence

from controlplane.client.loadgen.config import (
    LatencyStats,
    LoadConfig,
    LoadSummary,
    RequestResult,
    RequestSpec,
    _sorted_errors,
)

# --------------------------------------------------------------------------------------------- #
# Pure helpers: percentiles, schedule, workload, aggregation
# --------------------------------------------------------------------------------------------- #


def arrival_offsets(
    rate: float,
    seed: int,
    *,
    count: int | None = None,
    duration_s: float | None = None,
) -> Iterable[float]:
    """Send times (seconds from the start) of a Poisson process of `rate` req/s: 0 first, then
    exponential gaps of mean 1/rate from a Random seeded by `seed`. All zeros for rate inf.
    Stops after `count` offsets, or before the first offset >= `duration_s`, or never."""
    rng = random.Random(f"{seed}:arrivals")
    t = 0.0
    n = 0
    while (count is None or n < count) and (duration_s is None or t < duration_s):
        yield t
        n += 1
        if not math.isinf(rate):
            t += rng.expovariate(rate)


def request_specs(config: LoadConfig) -> Iterable[RequestSpec]:
    """The (endless) seeded workload: prompt ids and max_tokens of request 0, 1, 2, ..., and
    how each client behaves (from a stream of its own, so the client mix never changes the
    prompts)."""
    rng = random.Random(f"{config.seed}:workload")
    clients = random.Random(f"{config.seed}:clients")
    stream_fraction = config.stream_fraction
    if stream_fraction is None:
        stream_fraction = 1.0 if config.stream else 0.0
    lo, hi = config.token_id_range
    i = 0
    while True:
        n = rng.randint(*config.prompt_len)
        prompt = [rng.randrange(lo, hi) for _ in range(n)]
        stream = clients.random() < stream_fraction
        hang_up = clients.random() < config.disconnect_fraction
        delay = clients.uniform(0.0, config.disconnect_within_s)
        yield RequestSpec(
            index=i,
            prompt=prompt,
            max_tokens=rng.randint(*config.output_len),
            stream=stream,
            disconnect_after_s=delay if hang_up else None,
        )
        i += 1


def error_kind(exc: BaseException) -> str:
    """The failure kind: "429" for an HTTP error response; the transport error's class for a connection
    problem ("ConnectError", "ReadTimeout"); else the exception's class name."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        return str(exc.status_code)
    if isinstance(exc, openai.APIConnectionError) and exc.__cause__ is not None:
        return type(exc.__cause__).__name__
    return type(exc).__name__


def summarize(
    results: Sequence[RequestResult],
    *,
    wall_s: float,
    url: str = "",
    model: str = "",
    stream: bool = False,
    rate: float = math.inf,
    requests_sent: int | None = None,
    interrupted: bool = False,
) -> LoadSummary:
    """Aggregate finished requests. `requests_sent` defaults to len(results); the difference
    counts as cancelled."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok and not r.disconnected]
    errors = Counter(r.error or "unknown" for r in failed)
    samples: dict[str, str] = {}
    for r in failed:
        samples.setdefault(r.error or "unknown", (r.error_message or "")[:200])
    sent = len(results) if requests_sent is None else requests_sent
    completion = sum(r.completion_tokens for r in ok)
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)
        for r in ok
        if r.ttft_s is not None and r.e2e_s is not None and r.completion_tokens > 1
    ]
    return LoadSummary(
        url=url,
        model=model,
        stream=stream,
        rate=rate,
        requests_sent=sent,
        requests_ok=len(ok),
        requests_failed=len(failed),
        requests_cancelled=max(0, sent - len(results)),
        errors=dict(_sorted_errors(dict(errors))),
        error_samples=dict(_sorted_errors(samples)),
        wall_s=wall_s,
        request_throughput=len(ok) / wall_s if wall_s > 0 else 0.0,
        output_throughput=completion / wall_s if wall_s > 0 else 0.0,
        total_prompt_tokens=sum(r.prompt_tokens for r in ok),
        total_completion_tokens=completion,
        short_outputs=sum(1 for r in ok if r.completion_tokens != r.max_tokens),
        missing_usage=sum(1 for r in ok if r.usage_missing),
        interrupted=interrupted,
        ttft_ms=LatencyStats.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=LatencyStats.of_seconds(tpot),
        itl_ms=LatencyStats.of_seconds([g for r in ok for g in r.itl_s]),
        e2e_ms=LatencyStats.of_seconds([r.e2e_s for r in ok if r.e2e_s is not None]),
        requests_disconnected=sum(1 for r in results if r.disconnected),
    )
