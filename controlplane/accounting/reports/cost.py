"""The cost report: the hourly rollups, plus what they have not counted yet from the request rows
(marked provisional)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, case, func, select

from controlplane.accounting.reports.base import (
    _FINAL,
    COST_GROUPS,
    COST_METRICS,
    REQUESTS,
    ROLLUPS,
    WATERMARKS,
    Report,
    window,
)
from controlplane.accounting.rollup import ROLLUP_JOB, ratio, request_groups
from controlplane.common import parse_group_by
from controlplane.store.models import (
    time_buckets,
)

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
            "cached_share": ratio(self.cached, self.prompt),
            "completion_tokens": self.completion,
            "list_cost_usd": round(math.fsum(self.list_cost), 12),
            "cache_savings_usd": round(math.fsum(self.savings), 12),
            "list_usd_per_mtok_prompt": ratio(math.fsum(self.prompt_side), self.prompt),
            "list_usd_per_mtok_completion": ratio(math.fsum(self.completion_side), self.completion),
            "gpu_cost_usd": gpu_cost,
            "gpu_usd_per_mtok": ratio(gpu_cost * 1e6, computed),
            "mean_utilization": ratio(util_num, util_den),
            "mfu": ratio(mfu_num, mfu_den),
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
                    **g.columns(),
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
