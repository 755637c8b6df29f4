"""`controlplane loadgen`: drive a daemon's OpenAI-compatible API at a Poisson arrival rate and
report throughput and latency. Torch-free on purpose: it must start instantly.

    controlplane loadgen --url http://127.0.0.1:8000 --rate 4 --requests 200 --stream
    controlplane loadgen --url URL --rate inf --duration 60 --concurrency-limit 8 --json out.json

Workload
--------
Every request is a ``POST /v1/completions`` sent with the official ``openai`` client
(``AsyncOpenAI(base_url=URL + "/v1", api_key=K or "none", max_retries=0)``). Request ``i`` gets a
prompt of ``A..B`` random token ids (``prompt: list[int]``, ids uniform in ``--token-id-range``,
default ``[100, 30000)``), ``max_tokens`` uniform in ``C..D`` and ``extra_body={"ignore_eos":
True}``, so its output length is exactly what was asked. The workload is drawn from a
``random.Random`` seeded with ``--seed``; the arrival times come from a second stream of the same
seed, so changing ``--rate`` does not change the prompts. ``--model`` defaults to the first id of
``GET /v1/models``.

Arrivals: the first request is sent at t=0, then the gaps are exponential with mean ``1/rate``
(a Poisson process). ``--rate inf`` (or ``0``) sends everything at once. ``--concurrency-limit M``
caps the requests in flight: an arrival waits for a free slot (its latency counts from when it is
actually sent). ``--requests N`` sends N requests; ``--duration S`` sends the arrivals that fall
in the first S seconds (with ``--rate inf`` it needs ``--concurrency-limit``, which makes it a
closed loop of M clients). Either way the run then waits for the requests in flight.

Client mix (for drills): ``--stream-fraction F`` streams a random share F of the requests
(overriding ``--stream``); ``--disconnect-fraction F`` makes a random share F of the clients hang
up after a delay uniform in ``[0, --disconnect-within]`` seconds (default 2): the request is
cancelled and its connection closed, as a client that goes away would. Both are drawn from a
stream of their own (``seed:clients``), so they never change the prompts.

Figures
-------
* requests ok / failed; failures by kind: the HTTP status (``"429"``) for an error response, the
  transport exception's class (``"ConnectError"``, ``"ReadTimeout"``) for a connection problem,
  else the exception's class. ``cancelled`` counts requests cut off by Ctrl-C, ``disconnected``
  the clients that hung up on purpose before their response ended (not failures).
* wall time: from the first send to the last completion.
* request throughput: ok requests / wall time; output throughput: completion tokens of the ok
  requests (from ``usage``) / wall time.
* ``short_outputs``: ok requests whose completion_tokens differ from their ``max_tokens``.
* latencies in ms, each as p50 / p90 / p99 / mean / count; percentiles use **linear
  interpolation** between the closest ranks (numpy's default method), see :func:`percentile`:

  - ``e2e``: from sending the request to the end of the response.
  - with ``--stream`` only (``null`` without it): ``ttft``, from sending to the first content
    chunk (a chunk with a choice that carries text or is not the finish-only chunk); ``itl``,
    every gap between consecutive content chunks of every request; ``tpot``, per request,
    ``(e2e - ttft) / (completion_tokens - 1)``, the mean time per output token after the first.

JSON (``--json PATH``, also :meth:`LoadSummary.to_dict`)
--------------------------------------------------------
``url``, ``model``, ``stream`` (bool), ``rate`` (req/s, or the string ``"inf"``),
``requests_sent``, ``requests_ok``, ``requests_failed``, ``requests_cancelled``,
``requests_disconnected``, ``errors``
({kind: count}), ``error_samples`` ({kind: first message}), ``wall_s``, ``request_throughput``
(req/s), ``output_throughput`` (tokens/s), ``total_prompt_tokens``, ``total_completion_tokens``,
``short_outputs``, ``missing_usage`` (ok requests that returned no usage; their token counts fall
back to the prompt length and the content chunks), ``interrupted`` (bool), and ``ttft_ms``,
``tpot_ms``, ``itl_ms``, ``e2e_ms``: each ``{"p50", "p90", "p99", "mean", "count"}`` or ``null``
when there is no sample.

Exit status: 0 when the run happened (even with failed requests; Ctrl-C stops sending, cancels
the requests in flight and still prints the partial summary), 1 when it could not start (no model
found), 2 for bad arguments, 130 when interrupted before the first request or by a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from controlplane.common import percentile

DEFAULT_TOKEN_ID_RANGE = (100, 30000)

__all__ = [
    "Interrupted",
    "LatencyStats",
    "LoadConfig",
    "LoadError",
    "LoadSummary",
    "RequestResult",
    "RequestSpec",
    "add_loadgen_parser",
    "arrival_offsets",
    "config_from_args",
    "error_kind",
    "parse_range",
    "parse_rate",
    "percentile",
    "request_specs",
    "run_load",
    "summarize",
]


class LoadError(RuntimeError):
    """The run could not start (e.g. no model could be discovered)."""


class Interrupted(LoadError):
    """`stop` was set before the first request was sent."""


# --------------------------------------------------------------------------------------------- #
# Configuration and results
# --------------------------------------------------------------------------------------------- #


@dataclass(frozen=True)
class LoadConfig:
    url: str  # the daemon's base URL, without /v1
    rate: float = math.inf  # requests/s; inf (or 0 on the command line) = all at once
    num_requests: int | None = 100  # exactly one of num_requests / duration_s is set
    duration_s: float | None = None
    prompt_len: tuple[int, int] = (32, 256)  # inclusive token range
    output_len: tuple[int, int] = (16, 128)  # inclusive max_tokens range
    stream: bool = False
    api_key: str | None = None
    model: str | None = None  # None: first id of GET /v1/models
    seed: int = 0
    concurrency_limit: int | None = None
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE  # prompt ids in [lo, hi)
    timeout_s: float = 600.0  # per request
    # Client mix (drills): the share of requests that stream (None: all if `stream`, else none)
    # and the share whose client hangs up after a delay uniform in [0, disconnect_within_s].
    stream_fraction: float | None = None
    disconnect_fraction: float = 0.0
    disconnect_within_s: float = 2.0

    def validate(self) -> LoadConfig:
        """Raise ValueError naming the command-line flag of the first bad field."""
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url: expected http://host:port, got {self.url!r}")
        if math.isnan(self.rate) or self.rate <= 0:
            raise ValueError(f"--rate: expected a number > 0 or inf, got {self.rate!r}")
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("--requests / --duration: give exactly one")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--requests: expected N >= 1, got {self.num_requests}")
        if self.duration_s is not None:
            if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
                raise ValueError(f"--duration: expected seconds > 0, got {self.duration_s!r}")
            if math.isinf(self.rate) and self.concurrency_limit is None:
                raise ValueError(
                    "--duration: with --rate inf it needs --concurrency-limit (a closed loop)"
                )
        _check_range("--prompt-len", self.prompt_len, 1)
        _check_range("--output-len", self.output_len, 1)
        lo, hi = self.token_id_range
        if not 0 <= lo < hi:
            raise ValueError(f"--token-id-range: expected LO-HI with 0 <= LO < HI, got {lo}-{hi}")
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ValueError(f"--concurrency-limit: expected M >= 1, got {self.concurrency_limit}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout: expected seconds > 0, got {self.timeout_s!r}")
        for flag, frac in (
            ("--stream-fraction", self.stream_fraction),
            ("--disconnect-fraction", self.disconnect_fraction),
        ):
            if frac is not None and not 0.0 <= frac <= 1.0:
                raise ValueError(f"{flag}: expected a fraction in [0, 1], got {frac!r}")
        if not (self.disconnect_within_s > 0 and math.isfinite(self.disconnect_within_s)):
            raise ValueError(
                f"--disconnect-within: expected seconds > 0, got {self.disconnect_within_s!r}"
            )
        return self


def _check_range(flag: str, rng: tuple[int, int], minimum: int) -> None:
    a, b = rng
    if not minimum <= a <= b:
        raise ValueError(f"{flag}: expected A-B with {minimum} <= A <= B, got {a}-{b}")


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: list[int]
    max_tokens: int
    stream: bool = False
    disconnect_after_s: float | None = None  # the client hangs up after this many seconds


@dataclass
class RequestResult:
    """One finished request (ok or failed). Times in seconds."""

    index: int
    ok: bool
    max_tokens: int
    error: str | None = None  # failure kind: "429", "ConnectError", ...
    error_message: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_missing: bool = False
    e2e_s: float | None = None
    ttft_s: float | None = None  # stream only
    itl_s: list[float] = field(default_factory=list)  # stream only: gaps between content chunks
    disconnected: bool = False  # hung up on purpose (--disconnect-fraction), before the end


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds."""

    p50: float
    p90: float
    p99: float
    mean: float
    count: int

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> LatencyStats | None:
        if not values:
            return None
        ms = [v * 1000.0 for v in values]
        p50, p90, p99 = (percentile(ms, q) or 0.0 for q in (50, 90, 99))  # ms is not empty
        return cls(
            p50=p50,
            p90=p90,
            p99=p99,
            mean=sum(ms) / len(ms),
            count=len(ms),
        )


@dataclass
class LoadSummary:
    url: str
    model: str
    stream: bool
    rate: float
    requests_sent: int
    requests_ok: int
    requests_failed: int
    requests_cancelled: int
    errors: dict[str, int]
    error_samples: dict[str, str]
    wall_s: float
    request_throughput: float
    output_throughput: float
    total_prompt_tokens: int
    total_completion_tokens: int
    short_outputs: int
    missing_usage: int
    interrupted: bool
    ttft_ms: LatencyStats | None
    tpot_ms: LatencyStats | None
    itl_ms: LatencyStats | None
    e2e_ms: LatencyStats | None
    requests_disconnected: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rate"] = "inf" if math.isinf(self.rate) else self.rate
        return d

    def format(self) -> str:
        """The human-readable summary the CLI prints."""
        rate = "inf" if math.isinf(self.rate) else f"{self.rate:g}"
        errors = ", ".join(f"{k}: {v}" for k, v in _sorted_errors(self.errors)) or "none"
        lines = [
            f"model {self.model} at {self.url}, rate {rate} req/s, "
            f"{'streaming' if self.stream else 'non-streaming'}"
            + (" (interrupted)" if self.interrupted else ""),
            f"requests         ok {self.requests_ok} / failed {self.requests_failed}"
            + (f" / cancelled {self.requests_cancelled}" if self.requests_cancelled else "")
            + (
                f" / disconnected {self.requests_disconnected}"
                if self.requests_disconnected
                else ""
            )
            + f" of {self.requests_sent} sent",
            f"errors           {errors}",
        ]
        for kind, msg in _sorted_errors(self.error_samples):
            lines.append(f"  first {kind}: {msg}")
        lines += [
            f"wall time        {self.wall_s:.2f} s",
            f"throughput       {self.request_throughput:.2f} req/s, "
            f"{self.output_throughput:.1f} output tokens/s",
            f"tokens           {self.total_prompt_tokens} prompt, "
            f"{self.total_completion_tokens} completion",
        ]
        if self.short_outputs:
            lines.append(f"short outputs    {self.short_outputs} (completion != max_tokens)")
        if self.missing_usage:
            lines.append(f"missing usage    {self.missing_usage} responses had no usage")
        lines.append(f"{'latency (ms)':<16} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}")
        for name, stats in (
            ("TTFT", self.ttft_ms),
            ("TPOT", self.tpot_ms),
            ("ITL", self.itl_ms),
            ("e2e", self.e2e_ms),
        ):
            if stats is None:
                lines.append(f"{name:<16} {'n/a':>9} {'n/a':>9} {'n/a':>9} {'n/a':>9}")
            else:
                lines.append(
                    f"{name:<16} {stats.p50:>9.1f} {stats.p90:>9.1f} {stats.p99:>9.1f} "
                    f"{stats.mean:>9.1f}"
                )
        return "\n".join(lines)


def _sorted_errors(d: dict[str, Any]) -> list[tuple[str, Any]]:
    # HTTP statuses first, numerically, then exception names.
    return sorted(d.items(), key=lambda kv: (not kv[0].isdigit(), kv[0].zfill(3)))


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


# --------------------------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------------------------- #


async def _client(client: Any, model: str, spec: RequestSpec) -> RequestResult:
    """One request as its client behaves: one that hangs up is cancelled after its delay, which
    closes its connection (the daemon sees a disconnect), unless the response came first."""
    if spec.disconnect_after_s is None:
        return await _one_request(client, model, spec, spec.stream)
    task = asyncio.ensure_future(_one_request(client, model, spec, spec.stream))
    done, _ = await asyncio.wait({task}, timeout=spec.disconnect_after_s)
    if done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return RequestResult(index=spec.index, ok=False, max_tokens=spec.max_tokens, disconnected=True)


async def _one_request(client: Any, model: str, spec: RequestSpec, stream: bool) -> RequestResult:
    res = RequestResult(index=spec.index, ok=False, max_tokens=spec.max_tokens)
    t0 = time.perf_counter()
    try:
        if stream:
            usage = None
            chunks = 0
            last = None
            response = await client.completions.create(
                model=model,
                prompt=spec.prompt,
                max_tokens=spec.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            try:
                async for chunk in response:
                    now = time.perf_counter()
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if not chunk.choices:
                        continue
                    choice = chunk.choices[0]
                    if not choice.text and choice.finish_reason is not None:
                        continue  # a finish-only chunk carries no token
                    chunks += 1
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
            finally:
                await response.close()
        else:
            response = await client.completions.create(
                model=model,
                prompt=spec.prompt,
                max_tokens=spec.max_tokens,
                extra_body={"ignore_eos": True},
            )
            usage = response.usage
            chunks = 0
        res.e2e_s = time.perf_counter() - t0
        if usage is not None:
            res.prompt_tokens = usage.prompt_tokens
            res.completion_tokens = usage.completion_tokens
        else:
            res.usage_missing = True
            res.prompt_tokens = len(spec.prompt)
            res.completion_tokens = chunks
        res.ok = True
    except Exception as exc:
        res.error = error_kind(exc)
        res.error_message = f"{type(exc).__name__}: {exc}"
        if exc.__cause__ is not None:
            res.error_message += f" ({type(exc.__cause__).__name__}: {exc.__cause__})"
        res.ttft_s = None
        res.itl_s = []
    return res


async def discover_model(client: Any) -> str:
    try:
        page = await client.models.list()
    except Exception as exc:
        raise LoadError(
            f"cannot list models ({error_kind(exc)}: {exc}); is the daemon up? or pass --model"
        ) from exc
    ids = [m.id for m in page.data]
    if not ids:
        raise LoadError("GET /v1/models returned no model; pass --model")
    return ids[0]


async def run_load(
    config: LoadConfig,
    *,
    stop: asyncio.Event | None = None,
    progress: bool = False,
) -> LoadSummary:
    """Run the load described by `config` and return its summary.

    `stop`: when set, no more requests are sent, the ones in flight are cancelled (counted as
    cancelled) and the partial summary is returned with `interrupted=True`. `progress`: show a
    tqdm bar on stderr. Raises LoadError if no model can be discovered."""
    import openai

    config.validate()
    client = openai.AsyncOpenAI(
        base_url=config.url.rstrip("/") + "/v1",
        api_key=config.api_key or "none",
        max_retries=0,
        timeout=config.timeout_s,
    )
    try:
        model = config.model or await _unless_stopped(discover_model(client), stop)
        return await _drive(client, model, config, stop, progress)
    finally:
        await client.close()


async def _unless_stopped(coro: Any, stop: asyncio.Event | None) -> Any:
    if stop is None:
        return await coro
    task = asyncio.ensure_future(coro)
    waiter = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Interrupted("interrupted before the first request")
    return task.result()


async def _drive(
    client: Any, model: str, config: LoadConfig, stop: asyncio.Event | None, progress: bool
) -> LoadSummary:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.num_requests, unit="req", file=sys.stderr, dynamic_ncols=True)
    results: list[RequestResult] = []
    failed = 0
    sem = asyncio.Semaphore(config.concurrency_limit) if config.concurrency_limit else None
    inflight: set[asyncio.Task[None]] = set()
    sent = 0

    async def send(spec: RequestSpec) -> None:
        nonlocal failed
        try:
            res = await _client(client, model, spec)
            results.append(res)
            if bar is not None:
                failed += not (res.ok or res.disconnected)
                if failed:
                    bar.set_postfix(failed=failed, refresh=False)
                bar.update(1)
        finally:
            if sem is not None:
                sem.release()

    async def dispatch() -> None:
        nonlocal sent
        specs = iter(request_specs(config))
        offsets = arrival_offsets(
            config.rate, config.seed, count=config.num_requests, duration_s=config.duration_s
        )
        for offset in offsets:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
                # closed loop (--duration with --rate inf): stop at the deadline
                if config.duration_s is not None and time.perf_counter() - start >= (
                    config.duration_s
                ):
                    sem.release()
                    break
            task = asyncio.create_task(send(next(specs)))
            sent += 1
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        while inflight:
            await asyncio.gather(*list(inflight))

    start = time.perf_counter()
    interrupted = False
    dispatcher = asyncio.create_task(dispatch())
    try:
        if stop is None:
            await dispatcher
        else:
            waiter = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({dispatcher, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if dispatcher.done():
                dispatcher.result()  # re-raise a failure of the dispatcher itself
            else:
                interrupted = True
    finally:
        if not dispatcher.done():
            dispatcher.cancel()
        for task in list(inflight):
            task.cancel()
        pending = [dispatcher, *inflight]
        await asyncio.gather(*pending, return_exceptions=True)
        if bar is not None:
            bar.close()
    return summarize(
        results,
        wall_s=max(time.perf_counter() - start, 1e-9),
        url=config.url,
        model=model,
        stream=config.stream,
        rate=config.rate,
        requests_sent=sent,
        interrupted=interrupted,
    )


# --------------------------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------------------------- #


def parse_range(text: str, flag: str, minimum: int = 1) -> tuple[int, int]:
    """'A-B' (or 'A') -> (A, B), with minimum <= A <= B; ValueError naming `flag` otherwise."""
    expected = f"{flag}: expected A-B with {minimum} <= A <= B, got {text!r}"
    parts = text.strip().split("-")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise ValueError(expected)
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(expected) from None
    if not minimum <= a <= b:
        raise ValueError(expected)
    return a, b


def parse_rate(text: str) -> float:
    """'inf' or '0' -> inf; a number > 0 -> itself; ValueError naming --rate otherwise."""
    expected = f"--rate: expected requests/s > 0, or inf or 0 (all at once), got {text!r}"
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(expected) from None
    if math.isnan(rate) or rate < 0:
        raise ValueError(expected)
    return math.inf if rate == 0 else rate


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """Build and validate the LoadConfig; ValueError naming the flag on bad input."""
    if args.duration is not None and args.requests is not None:
        raise ValueError("--duration / --requests: give one, not both")
    num_requests = args.requests
    if args.duration is None and num_requests is None:
        num_requests = 100
    url = args.url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    id_lo, id_hi = parse_range(args.token_id_range, "--token-id-range", minimum=0)
    if id_lo == id_hi:
        raise ValueError(
            f"--token-id-range: expected LO-HI with LO < HI, got {args.token_id_range!r}"
        )
    return LoadConfig(
        url=url,
        rate=parse_rate(args.rate),
        num_requests=num_requests,
        duration_s=args.duration,
        prompt_len=parse_range(args.prompt_len, "--prompt-len"),
        output_len=parse_range(args.output_len, "--output-len"),
        stream=args.stream,
        api_key=args.api_key,
        model=args.model,
        seed=args.seed,
        concurrency_limit=args.concurrency_limit,
        token_id_range=(id_lo, id_hi),
        timeout_s=args.timeout,
        stream_fraction=args.stream_fraction,
        disconnect_fraction=args.disconnect_fraction,
        disconnect_within_s=args.disconnect_within,
    ).validate()


async def _run_with_ctrl_c(config: LoadConfig) -> LoadSummary:
    """First Ctrl-C: stop sending, cancel what is in flight, return the partial summary. A second
    Ctrl-C cancels everything at once (KeyboardInterrupt-like exit, no summary)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def on_sigint() -> None:
        if stop.is_set() and main is not None:
            main.cancel()
        stop.set()

    installed = False
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    try:
        return await run_load(config, stop=stop, progress=True)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


def _cmd_loadgen(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"controlplane loadgen: error: {exc}", file=sys.stderr)
        return 2
    total = (
        f"{config.num_requests} requests"
        if config.num_requests is not None
        else f"{config.duration_s:g} s"
    )
    rate = "inf" if math.isinf(config.rate) else f"{config.rate:g}"
    print(
        f"loadgen: {total} at {rate} req/s to {config.url}, prompt {config.prompt_len[0]}-"
        f"{config.prompt_len[1]}, output {config.output_len[0]}-{config.output_len[1]} tokens"
        + (", streaming" if config.stream else ""),
        file=sys.stderr,
    )
    try:
        summary = asyncio.run(_run_with_ctrl_c(config))
    except (Interrupted, KeyboardInterrupt, asyncio.CancelledError):
        print("controlplane loadgen: interrupted", file=sys.stderr)
        return 130
    except LoadError as exc:
        print(f"controlplane loadgen: error: {exc}", file=sys.stderr)
        return 1
    print(summary.format())
    if args.json:
        Path(args.json).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return 0


def add_loadgen_parser(subparsers: Any) -> None:
    """Register the `loadgen` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "loadgen",
        help="drive a daemon's /v1/completions at a Poisson rate and report latency/throughput",
        description="Drive a daemon's /v1/completions with the openai client at a Poisson "
        "arrival rate and report throughput and TTFT / ITL / e2e latency percentiles. Ctrl-C "
        "stops and prints the partial summary.",
    )
    p.add_argument("--url", required=True, help="daemon base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--rate",
        default="inf",
        help="mean arrival rate in requests/s (Poisson); inf or 0 = all at once (default: inf)",
    )
    amount = p.add_mutually_exclusive_group()
    amount.add_argument(
        "--duration", type=float, metavar="S", help="send the arrivals of the first S seconds"
    )
    amount.add_argument("--requests", type=int, metavar="N", help="send N requests (default: 100)")
    p.add_argument(
        "--prompt-len", default="32-256", metavar="A-B", help="prompt tokens (default: 32-256)"
    )
    p.add_argument(
        "--output-len",
        default="16-128",
        metavar="C-D",
        help="max_tokens, EOS ignored (default: 16-128)",
    )
    p.add_argument("--stream", action="store_true", help="stream, and measure TTFT and ITL")
    p.add_argument("--api-key", metavar="K", help="bearer key (default: none)")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrivals seed (default: 0)")
    p.add_argument(
        "--concurrency-limit", type=int, metavar="M", help="at most M requests in flight"
    )
    p.add_argument(
        "--token-id-range",
        default=f"{DEFAULT_TOKEN_ID_RANGE[0]}-{DEFAULT_TOKEN_ID_RANGE[1]}",
        metavar="LO-HI",
        help="prompt token ids are drawn from [LO, HI) (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="per-request timeout in seconds (default: 600)",
    )
    p.add_argument(
        "--stream-fraction",
        type=float,
        metavar="F",
        help="stream a random share F of the requests (overrides --stream)",
    )
    p.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="a random share F of the clients hang up before the end (default: 0)",
    )
    p.add_argument(
        "--disconnect-within",
        type=float,
        default=2.0,
        metavar="S",
        help="a hanging-up client waits uniform [0, S] seconds first (default: 2)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    p.set_defaults(func=_cmd_loadgen)
