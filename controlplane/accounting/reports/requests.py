"""The requests report: counts, tokens, latencies and cost from the request rows, grouped; by API
key (alone or with day|hour) also the requests refused (the `refusals` counts) and, by API key
alone, each table key's budget use in its current period."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, case, func, inspect, select

from controlplane.accounting.reports.base import (
    _FINAL,
    BUDGET_METRICS,
    REFUSALS,
    REQUEST_GROUPS,
    REQUEST_METRICS,
    REQUESTS,
    THROTTLED_METRICS,
    Report,
    window,
)
from controlplane.accounting.rollup import ratio
from controlplane.common import parse_group_by
from controlplane.tenants.budgets import budget_use

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


# -- refusals and budgets (grouped by API key) -------------------------------------------------

# The refusals' group columns: they are kept per hour and key only (no model, no user).
_REFUSAL_KEYS = {
    "day": REFUSALS.c.day_bucket,
    "hour": REFUSALS.c.hour_bucket,
    "api_key": REFUSALS.c.api_key_name,
}


def counts_refusals(groups: Sequence[str]) -> bool:
    """Whether a requests report grouped by `groups` has the throttled columns: by api_key,
    alone or with day|hour (refusals are not kept by model or user)."""
    return "api_key" in groups and set(groups) <= set(_REFUSAL_KEYS)


def shows_budgets(groups: Sequence[str]) -> bool:
    """Whether it has the budget columns: by api_key alone (a key's current period, one row
    a key)."""
    return list(groups) == ["api_key"]


def request_columns(groups: Sequence[str]) -> list[str]:
    """A requests report's columns when grouped by `groups`."""
    return [
        *groups,
        *REQUEST_METRICS,
        *(THROTTLED_METRICS if counts_refusals(groups) else ()),
        *(BUDGET_METRICS if shows_budgets(groups) else ()),
    ]


def _refusals(
    conn: Connection, groups: Sequence[str], first: str, last: str
) -> dict[tuple[Any, ...], dict[str, int]] | None:
    """group key -> reason -> requests refused in the hours [first, last], every instance's;
    None on a database without the table (not migrated to 0014: not counted, not zero)."""
    if not inspect(conn).has_table(REFUSALS.name):
        return None
    f = REFUSALS.c
    keys = [_REFUSAL_KEYS[g].label(g) for g in groups]
    stmt = (
        select(*keys, f.reason, func.sum(f.requests).label("n"))
        .where(f.hour_bucket >= first, f.hour_bucket <= last)
        .group_by(*keys, f.reason)
    )
    out: dict[tuple[Any, ...], dict[str, int]] = {}
    for row in conn.execute(stmt):
        reasons = out.setdefault(tuple(row._mapping[g] for g in groups), {})
        reasons[row.reason] = reasons.get(row.reason, 0) + int(row.n or 0)
    return out


def _throttled(reasons: Mapping[str, int] | None) -> dict[str, Any]:
    if reasons is None:
        return dict.fromkeys(THROTTLED_METRICS)
    return {
        "throttled": sum(reasons.values()),
        "throttled_by_reason": dict(sorted(reasons.items())),
    }


def _budget(conn: Connection, names: Sequence[str], now: datetime) -> dict[str, dict[str, Any]]:
    """key -> its budget columns, for the table keys with a budget (tenants.budgets.budget_use:
    the spend query the daemons' budgets use)."""
    out = {}
    for name, u in budget_use(conn, now, names).items():
        out[name] = {
            "budget_usd": u.budget.usd,
            "budget_period": u.budget.period,
            "budget_spend_usd": round(u.spend_usd, 12),
            "budget_use": None if u.use == float("inf") else round(u.use, 6),
        }
    return out


def requests_report(
    engine: Engine,
    *,
    since: datetime,
    until: datetime,
    group_by: Sequence[str] | str,
    now: datetime | None = None,
) -> Report:
    """Usage and list cost by any of day|hour, model, api_key, user (summed across
    instances), from the final request rows whose arrival hour is in the window; by api_key
    (alone or with day|hour) also the requests refused in the window's hours, and by api_key
    alone each table key's budget use in its period holding `now` (default: now); see the
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
    refused: dict[tuple[Any, ...], dict[str, int]] | None = {}
    budgets: dict[str, dict[str, Any]] = {}
    with engine.connect() as conn:
        found = [dict(row._mapping) for row in conn.execute(stmt)]
        if counts_refusals(groups):
            refused = _refusals(conn, groups, first, last)
            # A group refused every request has no request row: a row of its own, zero requests.
            seen = {tuple(row[g] for g in groups) for row in found}
            for key in sorted(set(refused or ()) - seen):
                found.append(
                    {**dict(zip(groups, key, strict=True)), **dict.fromkeys(_REQUEST_SUMS)}
                )
        if shows_budgets(groups) and found:
            budgets = _budget(conn, [row["api_key"] for row in found], now or datetime.now(UTC))
    found.sort(key=lambda row: tuple(row[g] for g in groups))
    totals: dict[str, Any] = dict.fromkeys(_REQUEST_SUMS, 0)
    for row in found:
        for name in _REQUEST_SUMS:
            totals[name] += row[name] or 0
    columns = request_columns(groups)
    rows = []
    for row in found:
        key = tuple(row[g] for g in groups)
        out = {**{g: row[g] for g in groups}, **_request_result(row)}
        if counts_refusals(groups):
            out |= _throttled(None if refused is None else refused.get(key, {}))
        if shows_budgets(groups):
            out |= budgets.get(row["api_key"], dict.fromkeys(BUDGET_METRICS))
        rows.append(out)
    metrics = columns[len(groups) :]
    summed = dict.fromkeys(metrics)
    if found:
        summed |= _request_result(totals)
        if counts_refusals(groups) and refused is not None:
            every: dict[str, int] = {}
            for reasons in refused.values():
                for reason, n in reasons.items():
                    every[reason] = every.get(reason, 0) + n
            summed |= _throttled(every)
    return Report(
        kind="requests",
        group_by=groups,
        columns=columns,
        rows=rows,
        totals=summed,
        since=start.isoformat(),
        until=end.isoformat(),
        empty=not found,
    )
