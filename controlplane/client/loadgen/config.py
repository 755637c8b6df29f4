"""The load generator's configuration (LoadConfig, checked as it is built), one request's spec and
result, and the run's summary (LoadSummary, with its JSON and text forms)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from controlplane.common import percentile

DEFAULT_TOKEN_ID_RANGE = (100, 30000)


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
