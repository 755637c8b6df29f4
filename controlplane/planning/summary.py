"""The figures a replay is judged by, for what was recorded and for each replayed config, side
by side: TTFT and ITL p50 / p99, queue wait, throughput, preemptions, peak KV use, SLO
attainment and the cost per million computed tokens.

Definitions (the same for both columns):
- ITL is each request's mean inter-token latency (the row's `mean_itl_s`; a row keeps no
  per-token gaps), so its p99 is the 99th percentile over requests, not over tokens.
- Throughput: completion tokens / (first arrival to last finish).
- SLO attainment: the share of requests whose TTFT and mean ITL are both within the targets
  (the autopilot's `ttft_p99_ms` / `itl_p99_ms` unless given); None without a target.
- Cost per million computed tokens: the instance's cost over the span (`gpu_hourly_usd` x GPUs,
  at least one, x span) / the tokens it computed (prompt tokens not served from the prefix
  cache, plus completion tokens) x 1e6: the rollup's GPU view (accounting/rollup.py), so
  idle time costs too. A replay at --speed s is scaled back: its span x s.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from controlplane.common import percentile
from controlplane.planning.replay import ReplayRun
from controlplane.planning.window import Window


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float = 0.0  # 0: no target
    itl_ms: float = 0.0

    @property
    def any(self) -> bool:
        return self.ttft_ms > 0 or self.itl_ms > 0

    def met(self, ttft_s: float | None, itl_s: float | None) -> bool:
        return self.met_ms(
            None if ttft_s is None else ttft_s * 1000, None if itl_s is None else itl_s * 1000
        )

    def met_ms(self, ttft_ms: float | None, itl_ms: float | None) -> bool:
        """Within the targets: a TTFT is required where there is a TTFT target; a missing ITL
        (one token) meets any."""
        ok_ttft = self.ttft_ms <= 0 or (ttft_ms is not None and ttft_ms <= self.ttft_ms)
        ok_itl = self.itl_ms <= 0 or itl_ms is None or itl_ms <= self.itl_ms
        return ok_ttft and ok_itl


@dataclass(frozen=True, slots=True)
class Figures:
    label: str
    requests: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    queue_p50_ms: float | None
    queue_p99_ms: float | None
    throughput_tok_s: float | None
    preemptions: int
    peak_kv_usage: float | None  # None: not recorded
    prefix_hit_rate: float | None  # cached / prompt tokens
    spec_acceptance: float | None  # accepted / proposed draft tokens; None without drafts
    slo_attainment: float | None
    cost_per_mtok_usd: float | None
    errors: dict[str, int] = field(default_factory=dict)  # why -> requests (replays only)
    # p99 of every inter-token gap (the autopilot's and the dashboard's ITL p99), where the
    # run knows its gaps (the simulator); itl_p99_ms is the p99 of the requests' mean gaps.
    itl_gap_p99_ms: float | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _ms(values: list[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(p * 1000, 3)


def _cost(hourly_usd: float, span_s: float, computed: int) -> float | None:
    if computed <= 0 or span_s <= 0:
        return None
    return hourly_usd * span_s / 3600 / computed * 1e6


def _figures(
    label: str,
    *,
    failed: int,
    prompt: int,
    cached: int,
    completion: int,
    ttft: list[float],
    itl: list[float],
    queue: list[float],
    span_s: float,
    cost_span_s: float | None,
    met: list[bool] | None,
    requests: int,
    hourly_usd: float,
    preemptions: int,
    peak_kv_usage: float | None,
    spec_acceptance: float | None,
    errors: dict[str, int] | None = None,
) -> Figures:
    """The figures both columns share, from their latencies (seconds) and token counts;
    `cost_span_s` None: no cost (all arrivals at once); `met` None: no SLO target."""
    return Figures(
        label=label,
        requests=requests,
        failed=failed,
        prompt_tokens=prompt,
        completion_tokens=completion,
        ttft_p50_ms=_ms(ttft, 50),
        ttft_p99_ms=_ms(ttft, 99),
        itl_p50_ms=_ms(itl, 50),
        itl_p99_ms=_ms(itl, 99),
        queue_p50_ms=_ms(queue, 50),
        queue_p99_ms=_ms(queue, 99),
        throughput_tok_s=completion / span_s if span_s > 0 else None,
        prefix_hit_rate=cached / prompt if prompt else None,
        slo_attainment=sum(met) / requests if met is not None and requests else None,
        cost_per_mtok_usd=None
        if cost_span_s is None
        else _cost(hourly_usd, cost_span_s, prompt - cached + completion),
        preemptions=preemptions,
        peak_kv_usage=peak_kv_usage,
        spec_acceptance=spec_acceptance,
        errors=errors or {},
    )


def recorded_figures(window: Window, slo: Slo, hourly_usd: float) -> Figures:
    rows = window.rows
    end = max(r.arrival + (r.e2e_latency_s or 0.0) for r in rows)
    span = end - rows[0].arrival
    drafts = sum(r.draft_tokens for r in rows)
    return _figures(
        "recorded",
        requests=len(rows),
        failed=sum(r.status != "success" for r in rows),
        prompt=sum(r.prompt_tokens for r in rows),
        cached=sum(min(r.cached_prompt_tokens, r.prompt_tokens) for r in rows),
        completion=sum(r.completion_tokens for r in rows),
        ttft=[r.ttft_s for r in rows if r.ttft_s is not None],
        itl=[r.mean_itl_s for r in rows if r.mean_itl_s is not None],
        queue=[r.queue_time_s for r in rows if r.queue_time_s is not None],
        span_s=span,
        cost_span_s=span,
        met=[slo.met(r.ttft_s, r.mean_itl_s) for r in rows] if slo.any else None,
        hourly_usd=hourly_usd,
        preemptions=sum(r.preemptions for r in rows),
        peak_kv_usage=None,
        spec_acceptance=sum(r.accepted_draft_tokens for r in rows) / drafts if drafts else None,
    )


def replay_figures(run: ReplayRun, slo: Slo, hourly_usd: float) -> Figures:
    metrics = [s.metrics for s in run.served if s.metrics is not None]
    figures = _figures(
        run.label,
        requests=len(run.served),
        failed=sum(not s.ok for s in run.served),
        prompt=sum(m.num_prompt_tokens for m in metrics),
        cached=sum(m.num_cached_tokens for m in metrics),
        completion=sum(s.completion_tokens for s in run.served),
        ttft=[m.ttft for m in metrics if m.ttft is not None],
        itl=[m.mean_itl for m in metrics if m.mean_itl is not None],
        queue=[m.queue_time for m in metrics if m.queue_time is not None],
        span_s=run.wall_s,
        # At --speed s the replay took 1/s of the recorded span: its cost is the recorded one's.
        cost_span_s=None if math.isinf(run.speed) else run.wall_s * run.speed,
        met=[slo.met(m.ttft, m.mean_itl) for m in metrics] if slo.any else None,
        hourly_usd=hourly_usd,
        preemptions=run.preemptions,
        peak_kv_usage=run.peak_kv_usage,
        spec_acceptance=run.accepted_draft_tokens / run.draft_tokens if run.draft_tokens else None,
        errors=dict(Counter(s.error or "no output" for s in run.served if not s.ok)),
    )
    if not run.gaps:
        return figures
    return dataclasses.replace(figures, itl_gap_p99_ms=_ms(run.gaps, 99))


# (title, field, format) of each line of the side-by-side table.
_LINES: list[tuple[str, str, str]] = [
    ("requests", "requests", "{:,}"),
    ("failed", "failed", "{:,}"),
    ("prompt tokens", "prompt_tokens", "{:,}"),
    ("completion tokens", "completion_tokens", "{:,}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:,.1f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:,.1f}"),
    ("ITL p50 ms", "itl_p50_ms", "{:,.2f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:,.2f}"),
    ("queue p50 ms", "queue_p50_ms", "{:,.1f}"),
    ("queue p99 ms", "queue_p99_ms", "{:,.1f}"),
    ("throughput tok/s", "throughput_tok_s", "{:,.1f}"),
    ("preemptions", "preemptions", "{:,}"),
    ("peak KV use", "peak_kv_usage", "{:.0%}"),
    ("prefix hit rate", "prefix_hit_rate", "{:.0%}"),
    ("spec acceptance", "spec_acceptance", "{:.0%}"),
    ("SLO attainment", "slo_attainment", "{:.1%}"),
    ("$ / M tokens", "cost_per_mtok_usd", "{:,.4f}"),
]


def table(columns: list[Figures]) -> str:
    """The figures side by side, one column each (– where a figure does not exist)."""
    width = max(12, *(len(c.label) for c in columns))
    head = f"{'':<18}" + "".join(f"{c.label:>{width + 2}}" for c in columns)
    lines = [head]
    for title, name, fmt in _LINES:
        cells = []
        for c in columns:
            value = getattr(c, name)
            cells.append(f"{'–' if value is None else fmt.format(value):>{width + 2}}")
        lines.append(f"{title:<18}" + "".join(cells))
    return "\n".join(lines)
