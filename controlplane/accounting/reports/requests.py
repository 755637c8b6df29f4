"""The requests report: counts, tokens, latencies and cost from the request rows, grouped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, case, func, select

from controlplane.accounting.reports.base import (
    _FINAL,
    REQUEST_GROUPS,
    REQUEST_METRICS,
    REQUESTS,
    Report,
    window,
)
from controlplane.accounting.rollup import ratio
from controlplane.common import parse_group_by

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
        "cached_share": ratio(sums["cached_prompt_tokens"], sums["prompt_tokens"]),
        "completion_tokens": int(sums["completion_tokens"] or 0),
        # Money is stored with 12 decimals: no float noise beyond that.
        "list_cost_usd": round(float(sums["cost"] or 0.0), 12),
        "mean_ttft_s": ratio(sums["ttft_sum"], sums["ttft_n"]),
        "mean_e2e_latency_s": ratio(sums["e2e_sum"], sums["e2e_n"]),
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
