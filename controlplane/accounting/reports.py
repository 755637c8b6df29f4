"""Cost, request and utilization reports from SQL: what `controlplane report ...` prints and the
admin API's /admin/costs and /admin/utilization return.

All read only the database (they work while the daemon is down) and always aggregate across
instances. The window is whole UTC hours: every hour that overlaps [since, until), i.e. from the
hour containing `since` up to the hour containing the last instant before `until`; the
`Report`'s since / until are that effective window.

Cost reports read `cost_rollups` (see `controlplane.accounting.rollup` for each figure), and the
request rows the rollup has not counted yet (requests that ended since an instance's last rollup
run, or of an instance that never ran one): their (hour, instance) is recounted from the rows,
with the GPU figures of the last rollup, and every row and total it touches has
`provisional` = true until the next rollup. Per group:
counts, tokens and costs are sums; `list_usd_per_mtok_prompt` / `_completion` are the group's
prompt-side / completion-side list cost per million prompt / completion tokens;
`cached_share` is cached / prompt tokens and `cache_savings_usd` what the prefix cache saved at
list price (cached tokens x (prompt rate - cached rate), by each request's own price row);
`gpu_usd_per_mtok` is the group's GPU cost per million computed tokens (prompt - cached +
completion; the same rate for prompt and completion tokens). A group that includes "(idle)"
rows (grouping without api_key) therefore shows the all-in GPU rate, idle time included; the
"(idle)" group itself (grouping by api_key) has no tokens and no rate. `mean_utilization` and
`mfu` are means over the distinct (hour, instance) pairs the group's rows fall in, weighted by
their covered seconds.

Request reports read the request rows themselves (final rows only, by their arrival hour), so
they can group by what the hourly rollups do not keep: `user` (the requests' OpenAI `user`
field, `requests.end_user`), besides day|hour, model and api_key. Per group: requests
succeeded / failed, tokens, the cached share of prompt tokens, list cost (the sum of the rows'
`cost_usd`, priced at ingest) and mean TTFT and end-to-end latency (over the rows that have
one). No GPU cost: that is shared out per hour by the rollup, which is not kept per user (users
are chosen by clients, unbounded, and rollups are kept forever). Request rows are pruned after
`jobs.request_retention_days`, so a request report reaches back that far at most.

Utilization reports read `utilization_samples` and `gpu_samples`. Means are time-weighted (by
the samples' interval_s) over the samples that carry the reading; GPU means are per GPU;
`gpu_energy_j` is the energy all GPUs used (the sum of `gpu_samples.interval_energy_j`) and
`max_gpu_temperature_c` the hottest reading.

Totals are computed from the same underlying sums as the rows (never by averaging rows).
Parameters are validated here; a bad one raises FieldError (a ValueError) with the
parameter's name in `field` and the reason in `message`, for the CLI and the API (422).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, case, func, select

from controlplane.accounting.rollup import HOUR, ROLLUP_JOB, floor_hour, request_groups
from controlplane.common import parse_group_by
from controlplane.errors import FieldError
from controlplane.store.models import (
    FINAL_STATUSES,
    CostRollupRow,
    GpuSampleRow,
    JobWatermarkRow,
    RequestRow,
    UtilizationSampleRow,
    time_buckets,
)

ROLLUPS = CostRollupRow.__table__
REQUESTS = RequestRow.__table__
WATERMARKS = JobWatermarkRow.__table__
_FINAL = sorted(FINAL_STATUSES)
SAMPLES = UtilizationSampleRow.__table__
GPUS = GpuSampleRow.__table__

TIME_GROUPS = ("day", "hour")
COST_GROUPS = ("day", "hour", "model", "api_key")
REQUEST_GROUPS = ("day", "hour", "model", "api_key", "user")
UTILIZATION_GROUPS = ("day", "hour", "instance")

COST_METRICS = (
    "requests_succeeded",
    "requests_failed",
    "prompt_tokens",
    "cached_prompt_tokens",
    "cached_share",
    "completion_tokens",
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
    since: str  # ISO 8601 UTC, the effective window (whole hours)
    until: str
    empty: bool = field(default=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "group_by": list(self.group_by),
            "columns": list(self.columns),
            "rows": [dict(r) for r in self.rows],
            "totals": dict(self.totals),
            "since": self.since,
            "until": self.until,
            "empty": self.empty,
        }


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


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# -- cost ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class _CostAcc:
    succeeded: int = 0
    failed: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    list_cost: list[float] = field(default_factory=list)
    savings: list[float] = field(default_factory=list)
    gpu_cost: list[float] = field(default_factory=list)
    prompt_side: list[float] = field(default_factory=list)  # USD x 1e6
    completion_side: list[float] = field(default_factory=list)  # USD x 1e6
    hours: dict[tuple[str, str], tuple[float, float | None, float | None]] = field(
        default_factory=dict
    )
    provisional: bool = False

    def add(self, r: Mapping[str, Any]) -> None:
        self.succeeded += r["requests_succeeded"]
        self.failed += r["requests_failed"]
        self.prompt += r["prompt_tokens"]
        self.cached += r["cached_prompt_tokens"]
        self.completion += r["completion_tokens"]
        self.list_cost.append(float(r["list_cost_usd"]))
        self.savings.append(float(r["cache_savings_usd"]))
        self.gpu_cost.append(float(r["gpu_cost_usd"]))
        if r["list_usd_per_mtok_prompt"] is not None:
            self.prompt_side.append(r["list_usd_per_mtok_prompt"] * r["prompt_tokens"])
        if r["list_usd_per_mtok_completion"] is not None:
            self.completion_side.append(r["list_usd_per_mtok_completion"] * r["completion_tokens"])
        self.hours[(r["hour_bucket"], r["instance_id"])] = (
            r["covered_s"],
            r["mean_utilization"],
            r["mfu"],
        )
        self.provisional = self.provisional or r["provisional"]

    def result(self) -> dict[str, Any]:
        computed = self.prompt - self.cached + self.completion
        # Money is stored with 12 decimals: sums are exact at that scale (no float noise).
        gpu_cost = round(math.fsum(self.gpu_cost), 12)
        util_num = util_den = mfu_num = mfu_den = 0.0
        for covered, util, mfu in self.hours.values():
            if covered and util is not None:
                util_num += util * covered
                util_den += covered
            if covered and mfu is not None:
                mfu_num += mfu * covered
                mfu_den += covered
        return {
            "requests_succeeded": self.succeeded,
            "requests_failed": self.failed,
            "prompt_tokens": self.prompt,
            "cached_prompt_tokens": self.cached,
            "cached_share": _div(self.cached, self.prompt),
            "completion_tokens": self.completion,
            "list_cost_usd": round(math.fsum(self.list_cost), 12),
            "cache_savings_usd": round(math.fsum(self.savings), 12),
            "list_usd_per_mtok_prompt": _div(math.fsum(self.prompt_side), self.prompt),
            "list_usd_per_mtok_completion": _div(math.fsum(self.completion_side), self.completion),
            "gpu_cost_usd": gpu_cost,
            "gpu_usd_per_mtok": _div(gpu_cost * 1e6, computed),
            "mean_utilization": _div(util_num, util_den),
            "mfu": _div(mfu_num, mfu_den),
            "provisional": self.provisional,
        }


_COST_KEYS = {
    "day": "day_bucket",
    "hour": "hour_bucket",
    "model": "model",
    "api_key": "api_key_name",
}


def _not_rolled_up(conn: Connection, first: str, last: str) -> dict[str, set[str]]:
    """instance -> the hours in [first, last] whose final request rows outnumber what the
    instance's rollup counted (requests that ended after its last run, or an instance that
    never ran one).

    Hours before an instance's rollup watermark are final and not checked. An instance
    without a watermark is checked from the newest watermark of any instance on (a daemon in
    its first rollup interval), or over the whole window when no rollup ever ran.
    """
    marks = {
        inst: time_buckets(value)[0]
        for inst, value in conn.execute(
            select(WATERMARKS.c.instance_id, WATERMARKS.c.value).where(
                WATERMARKS.c.job == ROLLUP_JOB
            )
        )
    }
    unmarked_from = max(first, max(marks.values())) if marks else first
    starts = {inst: max(first, mark) for inst, mark in marks.items()}
    low = min([unmarked_from, *starts.values()])
    if low > last:
        return {}
    r, c = REQUESTS.c, ROLLUPS.c
    # The status test is counted, not filtered: a filter on it lets SQLite pick the status
    # index and read every row of the table instead of the hour range.
    final = func.sum(case((r.status.in_(_FINAL), 1), else_=0))
    counted = conn.execute(
        select(r.instance_id, r.hour_bucket, final.label("n"))
        .where(r.hour_bucket >= low, r.hour_bucket <= last)
        .group_by(r.instance_id, r.hour_bucket)
    ).all()
    rolled = {
        (row.instance_id, row.hour_bucket): int(row.n or 0)
        for row in conn.execute(
            select(
                c.instance_id,
                c.hour_bucket,
                func.sum(c.requests_succeeded + c.requests_failed).label("n"),
            )
            .where(c.hour_bucket >= low, c.hour_bucket <= last)
            .group_by(c.instance_id, c.hour_bucket)
        )
    }
    pending: dict[str, set[str]] = defaultdict(set)
    for row in counted:
        start = starts.get(row.instance_id, unmarked_from)
        if row.hour_bucket >= start and row.n > rolled.get((row.instance_id, row.hour_bucket), 0):
            pending[row.instance_id].add(row.hour_bucket)
    return pending


def _provisional_rows(
    conn: Connection, stored: list[dict[str, Any]], pending: dict[str, set[str]]
) -> list[dict[str, Any]]:
    """`stored` with the pending (hour, instance) pairs recounted from the request rows: their
    request counts, tokens and list cost are the rows' sums (as the next rollup will count
    them); GPU cost, covered time, utilization and MFU stay as of the last rollup (none
    before the first). Every row of a pending pair is marked provisional."""
    out = [r for r in stored if r["hour_bucket"] not in pending.get(r["instance_id"], ())]
    for inst, hours in sorted(pending.items()):
        old = {
            (r["hour_bucket"], r["model"], r["api_key_name"]): r
            for r in stored
            if r["instance_id"] == inst and r["hour_bucket"] in hours
        }
        hour_figures = {h: r for (h, _m, _k), r in old.items()}
        fresh = request_groups(conn, inst, min(hours), max(hours))
        for (hour, model, key), g in sorted(fresh.items()):
            if hour not in hours:
                continue
            before = old.pop((hour, model, key), None)
            figures = hour_figures.get(hour)
            out.append(
                {
                    "hour_bucket": hour,
                    "day_bucket": g.day,
                    "instance_id": inst,
                    "model": model,
                    "api_key_name": key,
                    "requests_succeeded": g.succeeded,
                    "requests_failed": g.failed,
                    "prompt_tokens": g.prompt,
                    "cached_prompt_tokens": g.cached,
                    "completion_tokens": g.completion,
                    "list_cost_usd": g.list_cost,
                    "cache_savings_usd": g.cache_savings,
                    "list_usd_per_mtok_prompt": _div(g.prompt_side * 1e6, g.prompt),
                    "list_usd_per_mtok_completion": _div(g.completion_side * 1e6, g.completion),
                    "gpu_cost_usd": before["gpu_cost_usd"] if before else 0.0,
                    "covered_s": figures["covered_s"] if figures else 0.0,
                    "mean_utilization": figures["mean_utilization"] if figures else None,
                    "mfu": figures["mfu"] if figures else None,
                    "provisional": True,
                }
            )
        # Rows of the pairs with no fresh counterpart: the "(idle)" line (its GPU cost stands).
        out += [{**r, "provisional": True} for r in old.values()]
    return out


def cost_report(
    engine: Engine, *, since: datetime, until: datetime, group_by: Sequence[str] | str
) -> Report:
    """Cost by any of day|hour, model, api_key (always summed across instances), from
    `cost_rollups`, plus what the rollup has not counted yet, from the request rows (marked
    provisional); see the module docstring for each figure."""
    groups = parse_group_by(group_by, COST_GROUPS)
    start, end, first, last = window(since, until)
    c = ROLLUPS.c
    stmt = select(ROLLUPS).where(c.hour_bucket >= first, c.hour_bucket <= last)
    with engine.connect() as conn:
        rows = [{**r._mapping, "provisional": False} for r in conn.execute(stmt)]
        pending = _not_rolled_up(conn, first, last)
        if pending:
            rows = _provisional_rows(conn, rows, pending)
    accs: dict[tuple[str, ...], _CostAcc] = defaultdict(_CostAcc)
    total = _CostAcc()
    for r in rows:
        accs[tuple(r[_COST_KEYS[g]] for g in groups)].add(r)
        total.add(r)
    out = [
        {**dict(zip(groups, key, strict=True)), **acc.result()} for key, acc in sorted(accs.items())
    ]
    return Report(
        kind="cost",
        group_by=groups,
        columns=[*groups, *COST_METRICS],
        rows=out,
        totals=total.result() if rows else {**dict.fromkeys(COST_METRICS), "provisional": False},
        since=start.isoformat(),
        until=end.isoformat(),
        empty=not rows,
    )


# -- requests -----------------------------------------------------------------------------------

# Group columns of request reports. No key / no user read as "" (as in the cost rollups), so
# NULL and "" are one group.
_REQUEST_KEYS = {
    "day": REQUESTS.c.day_bucket,
    "hour": REQUESTS.c.hour_bucket,
    "model": REQUESTS.c.model,
    "api_key": func.coalesce(REQUESTS.c.api_key_name, ""),
    "user": func.coalesce(REQUESTS.c.end_user, ""),
}
# Sums per group: (metric or helper name, SQL expression over final rows).
_REQUEST_SUMS = (
    "succeeded",
    "final",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "cost",
    "ttft_sum",
    "ttft_n",
    "e2e_sum",
    "e2e_n",
)


def _request_sums() -> list[Any]:
    r = REQUESTS.c
    # Final rows are counted, not filtered: a filter on status lets SQLite pick the status
    # index and read every row of the table instead of the hour range (see _not_rolled_up).
    final = r.status.in_(_FINAL)

    def of_final(value: Any) -> Any:
        return func.sum(case((final, value)))

    exprs = (
        of_final(case((r.status == "success", 1), else_=0)),
        func.sum(case((final, 1), else_=0)),
        of_final(r.prompt_tokens),
        of_final(r.cached_prompt_tokens),
        of_final(r.completion_tokens),
        of_final(r.cost_usd),
        of_final(r.ttft_s),
        of_final(case((r.ttft_s.is_not(None), 1), else_=0)),
        of_final(r.e2e_latency_s),
        of_final(case((r.e2e_latency_s.is_not(None), 1), else_=0)),
    )
    return [e.label(name) for name, e in zip(_REQUEST_SUMS, exprs, strict=True)]


def _request_result(sums: Mapping[str, Any]) -> dict[str, Any]:
    final = int(sums["final"] or 0)
    succeeded = int(sums["succeeded"] or 0)
    return {
        "requests_succeeded": succeeded,
        "requests_failed": final - succeeded,
        "prompt_tokens": int(sums["prompt_tokens"] or 0),
        "cached_prompt_tokens": int(sums["cached_prompt_tokens"] or 0),
        "cached_share": _div(sums["cached_prompt_tokens"], sums["prompt_tokens"]),
        "completion_tokens": int(sums["completion_tokens"] or 0),
        # Money is stored with 12 decimals: no float noise beyond that.
        "list_cost_usd": round(float(sums["cost"] or 0.0), 12),
        "mean_ttft_s": _div(sums["ttft_sum"], sums["ttft_n"]),
        "mean_e2e_latency_s": _div(sums["e2e_sum"], sums["e2e_n"]),
    }


def requests_report(
    engine: Engine, *, since: datetime, until: datetime, group_by: Sequence[str] | str
) -> Report:
    """Usage and list cost by any of day|hour, model, api_key, user (summed across
    instances), from the final request rows whose arrival hour is in the window; see the
    module docstring."""
    groups = parse_group_by(group_by, REQUEST_GROUPS)
    start, end, first, last = window(since, until)
    r = REQUESTS.c
    keys = [_REQUEST_KEYS[g].label(g) for g in groups]
    final = func.sum(case((r.status.in_(_FINAL), 1), else_=0))
    stmt = (
        select(*keys, *_request_sums())
        .where(r.hour_bucket >= first, r.hour_bucket <= last)
        .group_by(*keys)
        .having(final > 0)  # groups of running requests only are not reported yet
    )
    with engine.connect() as conn:
        found = [dict(row._mapping) for row in conn.execute(stmt)]
    found.sort(key=lambda row: tuple(row[g] for g in groups))
    totals: dict[str, Any] = dict.fromkeys(_REQUEST_SUMS, 0)
    for row in found:
        for name in _REQUEST_SUMS:
            totals[name] += row[name] or 0
    return Report(
        kind="requests",
        group_by=groups,
        columns=[*groups, *REQUEST_METRICS],
        rows=[{**{g: row[g] for g in groups}, **_request_result(row)} for row in found],
        totals=_request_result(totals) if found else dict.fromkeys(REQUEST_METRICS),
        since=start.isoformat(),
        until=end.isoformat(),
        empty=not found,
    )


# -- utilization --------------------------------------------------------------------------------


def _weighted(value: Any, weight: Any) -> tuple[Any, Any]:
    """SUM(weight x value) and SUM(weight) over the rows where value is not NULL."""
    present = value.is_not(None)
    return func.sum(case((present, weight * value))), func.sum(case((present, weight)))


def _add(a: float | None, b: Any) -> float | None:
    if b is None:
        return a
    return float(b) if a is None else a + float(b)


def utilization_report(
    engine: Engine, *, since: datetime, until: datetime, group_by: Sequence[str] | str
) -> Report:
    """Utilization by day|hour and optionally instance, from `utilization_samples` and
    `gpu_samples`; see the module docstring for each figure."""
    groups = parse_group_by(group_by, UTILIZATION_GROUPS)
    start, end, first, last = window(since, until)
    s, g = SAMPLES.c, GPUS.c
    in_window = (s.hour_bucket >= first, s.hour_bucket <= last)
    # Per (hour, instance) sums in SQL, grouped by plain columns; days are summed up here.
    sample_cols: list[Any] = [
        func.count().label("samples"),
        func.sum(s.interval_s).label("covered"),
    ]
    for name in _SAMPLE_MEANS:
        num, den = _weighted(s[name], s.interval_s)
        sample_cols += [num.label(f"{name}_num"), den.label(f"{name}_den")]
    sample_stmt = (
        select(s.hour_bucket, s.instance_id, *sample_cols)
        .where(*in_window)
        .group_by(s.hour_bucket, s.instance_id)
    )
    gpu_cols: list[Any] = []
    for name in _GPU_MEANS:
        num, den = _weighted(g[name], s.interval_s)
        gpu_cols += [num.label(f"gpu_{name}_num"), den.label(f"gpu_{name}_den")]
    gpu_stmt = (
        select(
            s.hour_bucket,
            s.instance_id,
            *gpu_cols,
            func.max(g.temperature_c).label("max_temp"),
            func.sum(g.interval_energy_j).label("energy"),
        )
        .select_from(GPUS.join(SAMPLES, GPUS.c.sample_id == SAMPLES.c.id))
        .where(*in_window)
        .group_by(s.hour_bucket, s.instance_id)
    )
    with engine.connect() as conn:
        sample_rows = conn.execute(sample_stmt).all()
        gpu_rows = {(r.hour_bucket, r.instance_id): r for r in conn.execute(gpu_stmt)}

    sum_fields = ["samples", "covered"]
    for name in _SAMPLE_MEANS:
        sum_fields += [f"{name}_num", f"{name}_den"]
    gpu_sum_fields = []
    for name in _GPU_MEANS:
        gpu_sum_fields += [f"gpu_{name}_num", f"gpu_{name}_den"]

    def new_acc() -> dict[str, Any]:
        return dict.fromkeys([*sum_fields, *gpu_sum_fields, "max_temp", "energy"])

    def add(acc: dict[str, Any], r: Any) -> None:
        for f in sum_fields:
            acc[f] = _add(acc[f], getattr(r, f))
        gr = gpu_rows.get((r.hour_bucket, r.instance_id))
        if gr is not None:
            for f in gpu_sum_fields:
                acc[f] = _add(acc[f], getattr(gr, f))
            acc["energy"] = _add(acc["energy"], gr.energy)
            if gr.max_temp is not None:
                t = float(gr.max_temp)
                acc["max_temp"] = t if acc["max_temp"] is None else max(acc["max_temp"], t)

    def result(acc: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "samples": int(acc["samples"] or 0),
            "covered_s": acc["covered"] or 0.0,
        }
        for name in _SAMPLE_MEANS:
            out[f"mean_{name}"] = _div(acc[f"{name}_num"], acc[f"{name}_den"])
        for name in _GPU_MEANS:
            out[f"mean_gpu_{name}"] = _div(acc[f"gpu_{name}_num"], acc[f"gpu_{name}_den"])
        out["max_gpu_temperature_c"] = acc["max_temp"]
        out["gpu_energy_j"] = acc["energy"]
        return out

    def key(r: Any) -> tuple[str, ...]:
        values = {"day": r.hour_bucket[:10], "hour": r.hour_bucket, "instance": r.instance_id}
        return tuple(values[name] for name in groups)

    accs: dict[tuple[str, ...], dict[str, Any]] = defaultdict(new_acc)
    total = new_acc()
    for r in sample_rows:
        add(accs[key(r)], r)
        add(total, r)
    out = [{**dict(zip(groups, k, strict=True)), **result(acc)} for k, acc in sorted(accs.items())]
    return Report(
        kind="utilization",
        group_by=groups,
        columns=[*groups, *UTILIZATION_METRICS],
        rows=out,
        totals=result(total) if sample_rows else dict.fromkeys(UTILIZATION_METRICS),
        since=start.isoformat(),
        until=end.isoformat(),
        empty=not sample_rows,
    )
