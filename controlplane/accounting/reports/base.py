"""What every report shares: the tables, the group and metric names each report offers, the Report
it returns, and the time window it covers (whole UTC hours)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from controlplane.accounting.rollup import HOUR, floor_hour
from controlplane.errors import FieldError
from controlplane.store.models import (
    FINAL_STATUSES,
    CostRollupRow,
    GpuSampleRow,
    JobWatermarkRow,
    RefusalRow,
    RequestRow,
    UtilizationSampleRow,
    time_buckets,
)

ROLLUPS = CostRollupRow.__table__
REQUESTS = RequestRow.__table__
REFUSALS = RefusalRow.__table__
WATERMARKS = JobWatermarkRow.__table__
_FINAL = sorted(FINAL_STATUSES)
SAMPLES = UtilizationSampleRow.__table__
GPUS = GpuSampleRow.__table__

TIME_GROUPS = ("day", "hour")
COST_GROUPS = ("day", "hour", "model", "api_key", "end_user")
REQUEST_GROUPS = ("day", "hour", "model", "api_key", "user")
UTILIZATION_GROUPS = ("day", "hour", "instance")

COST_METRICS = (
    "requests_succeeded",
    "requests_failed",
    "requests",
    "prompt_tokens",
    "cached_prompt_tokens",
    "cached_share",
    "completion_tokens",
    "token_share",
    "list_cost_usd",
    "cache_savings_usd",
    "list_usd_per_mtok_prompt",
    "list_usd_per_mtok_completion",
    "gpu_cost_usd",
    "gpu_usd_per_mtok",
    "mean_utilization",
    "mfu",
    "provisional",
)
REQUEST_METRICS = (
    "requests_succeeded",
    "requests_failed",
    "prompt_tokens",
    "cached_prompt_tokens",
    "cached_share",
    "completion_tokens",
    "list_cost_usd",
    "mean_ttft_s",
    "mean_e2e_latency_s",
)
# A requests report by api_key (alone or with day|hour) adds the requests refused in the
# window's hours (the `refusals` counts; controlplane.tenants.usage.REASONS): in all, and
# reason -> count.
THROTTLED_METRICS = ("throttled", "throttled_by_reason")
# By api_key alone, also each table key's budget in its current period (None: no budget).
BUDGET_METRICS = ("budget_usd", "budget_period", "budget_spend_usd", "budget_use")
# Sample readings averaged over time (weighted by interval_s, over samples that carry them).
_SAMPLE_MEANS = (
    "busy_fraction",
    "kv_usage",
    "batch_fill_seqs",
    "batch_fill_tokens",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "queue_length",
    "num_running",
    "prefix_cache_hit_rate",
    "spec_acceptance_rate",
)
_GPU_MEANS = ("utilization_pct", "power_w")
UTILIZATION_METRICS = (
    "samples",
    "covered_s",
    *(f"mean_{name}" for name in _SAMPLE_MEANS),
    *(f"mean_gpu_{name}" for name in _GPU_MEANS),
    "max_gpu_temperature_c",
    "gpu_energy_j",
)


@dataclass(frozen=True, slots=True)
class Report:
    """A report, JSON-friendly throughout (`to_dict` is what the API returns)."""

    kind: str  # "cost" | "utilization"
    group_by: list[str]  # the group columns, in column order
    columns: list[str]  # group columns, then metrics
    rows: list[dict[str, Any]]
    totals: dict[str, Any]  # the metrics over the whole window
    since: str  # ISO 8601 UTC, the effective window (whole hours, or exact: see `source`)
    until: str
    empty: bool = field(default=False)
    # Cost reports only (None elsewhere, and then left out of to_dict): where the figures come
    # from, "rollups" (whole UTC hours) or "requests" (the request rows, the exact window), and
    # whose requests they count, "fleet" (every instance on the database) or "instance" (then
    # `instance_id` names it).
    source: str | None = None
    scope: str | None = None
    instance_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "kind": self.kind,
            "group_by": list(self.group_by),
            "columns": list(self.columns),
            "rows": [dict(r) for r in self.rows],
            "totals": dict(self.totals),
            "since": self.since,
            "until": self.until,
            "empty": self.empty,
        }
        if self.source is not None:
            out |= {"source": self.source, "scope": self.scope, "instance_id": self.instance_id}
        return out


# -- parameters ---------------------------------------------------------------------------------


def window(since: datetime, until: datetime) -> tuple[datetime, datetime, str, str]:
    """(effective since, effective until, first hour bucket, last hour bucket)."""
    for name, value in (("since", since), ("until", until)):
        if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
            raise FieldError(name, f"must be a timezone-aware datetime, got {value!r}")
        try:
            value.astimezone(UTC)
        except OverflowError:  # year 1 with a positive offset, 9999 with a negative one
            raise FieldError(name, f"{value.isoformat()} is out of range") from None
    since, until = since.astimezone(UTC), until.astimezone(UTC)
    if not since < until:
        raise FieldError(
            "since", f"must be before until ({since.isoformat()} >= {until.isoformat()})"
        )
    start = floor_hour(since)
    end = floor_hour(until)
    if end < until:
        end += HOUR
    return start, end, time_buckets(start)[0], time_buckets(end - HOUR)[0]
