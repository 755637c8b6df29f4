"""The cost report: the hourly rollups, plus what they have not counted yet from the request rows
(marked provisional)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
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
from controlplane.accounting.rollup import (
    ROLLUP_JOB,
    RequestGroup,
    final_rows,
    floor_hour,
    ratio,
    request_groups,
    summed_columns,
)
from controlplane.common import parse_group_by
from controlplane.errors import FieldError
from controlplane.store.models import (
    time_buckets,
)

# -- the window and where it is read from --------------------------------------------------------

# The shortest window a cost report answers (API and CLI), and the longest one it computes
# exactly from the request rows. Longer windows read the hourly rollups, whole UTC hours.
MIN_WINDOW = timedelta(minutes=1)
MAX_EXACT_WINDOW = timedelta(hours=24)
COST_SOURCES = ("auto", "requests", "rollups")
# Figures only the hourly rollups have (per (hour, instance) GPU time): None from the rows.
HOURLY_ONLY = ("gpu_cost_usd", "gpu_usd_per_mtok", "mean_utilization", "mfu")


def fmt_span(span: timedelta) -> str:
    """A window's length, e.g. "45s", "10m", "1h30m", "24h", "25h", "7d" (days from 48 h)."""
    total = int(span.total_seconds())
    if total < 60:
        return f"{span.total_seconds():g}s"
    days, rest = divmod(total, 86400) if total >= 2 * 86400 else (0, total)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (seconds, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n)


def cost_window(
    since: datetime, until: datetime, groups: Sequence[str], source: str = "auto"
) -> tuple[str, datetime, datetime]:
    """(source, effective since, effective until) of a cost report over [since, until).

    `source` "auto" (what the API and the CLI use) picks the request rows, over exactly
    [since, until), for a window of at most MAX_EXACT_WINDOW (24 h) whose bounds are not both
    on whole UTC hours, or that groups by end_user (the rollups do not keep users); every other
    window reads the hourly rollups, widened to the whole UTC hours it overlaps (exact
    already when its bounds are whole hours). "requests" / "rollups" force one source. A
    window shorter than MIN_WINDOW (1 minute; "auto" and "requests"), longer than 24 h from
    the rows, or grouped by end_user from the rollups is a FieldError naming `since` (or
    `group_by`), never widened.
    """
    if source not in COST_SOURCES:
        raise FieldError("source", f"must be one of {', '.join(COST_SOURCES)}, got {source!r}")
    start, end, _, _ = window(since, until)  # validates both bounds (aware, since < until)
    since, until = since.astimezone(UTC), until.astimezone(UTC)
    span = until - since
    if source != "rollups" and span < MIN_WINDOW:
        raise FieldError(
            "since", f"the window must be at least {fmt_span(MIN_WINDOW)}, got {fmt_span(span)}"
        )
    whole = floor_hour(since) == since and floor_hour(until) == until
    if source == "auto":
        exact = not whole and span <= MAX_EXACT_WINDOW
        source = "requests" if exact or "end_user" in groups else "rollups"
    if source == "requests":
        if span > MAX_EXACT_WINDOW:
            why = "grouping by end_user reads" if "end_user" in groups else "an exact window reads"
            raise FieldError(
                "since",
                f"{why} the request rows: at most {fmt_span(MAX_EXACT_WINDOW)}, got "
                f"{fmt_span(span)} (`controlplane report requests --group-by user` reaches "
                "further)",
            )
        return "requests", since, until
    if "end_user" in groups:
        raise FieldError(
            "group_by", "end_user is not kept in the hourly rollups: use the request rows"
        )
    return "rollups", start, end


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
            "requests": self.succeeded + self.failed,
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


def _not_rolled_up(
    conn: Connection, first: str, last: str, instance_id: str | None = None
) -> dict[str, set[str]]:
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
    counting = (
        select(r.instance_id, r.hour_bucket, final.label("n"))
        .where(r.hour_bucket >= low, r.hour_bucket <= last)
        .group_by(r.instance_id, r.hour_bucket)
    )
    rolling = (
        select(
            c.instance_id,
            c.hour_bucket,
            func.sum(c.requests_succeeded + c.requests_failed).label("n"),
        )
        .where(c.hour_bucket >= low, c.hour_bucket <= last)
        .group_by(c.instance_id, c.hour_bucket)
    )
    if instance_id is not None:
        counting = counting.where(r.instance_id == instance_id)
        rolling = rolling.where(c.instance_id == instance_id)
    counted = conn.execute(counting).all()
    rolled = {(row.instance_id, row.hour_bucket): int(row.n or 0) for row in conn.execute(rolling)}
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


# Group columns of the request rows (None keys: "" as in the rollups).
_ROW_KEYS = {
    "day": "day_bucket",
    "hour": "hour_bucket",
    "model": "model",
    "api_key": "api_key_name",
    "end_user": "end_user",
}


def _from_requests(
    conn: Connection,
    since: datetime,
    until: datetime,
    groups: Sequence[str],
    instance_id: str | None,
) -> list[tuple[tuple[str, ...], RequestGroup]]:
    """The final request rows that arrived in [since, until), summed per group with the
    rollup's own arithmetic (`RequestGroup.add`): (group key, sums), sorted by key."""
    c = REQUESTS.c
    cols = [c[_ROW_KEYS[g]] for g in groups]
    stmt = (
        select(*cols, *summed_columns())
        .where(c.arrival_time >= since, c.arrival_time < until)
        .group_by(*cols, c.status, c.price_id)
    )
    if instance_id is not None:
        stmt = stmt.where(c.instance_id == instance_id)
    found, prices = final_rows(conn, stmt)
    sums: dict[tuple[str, ...], RequestGroup] = defaultdict(RequestGroup)
    for r in found:
        key = tuple(r._mapping[_ROW_KEYS[g]] or "" for g in groups)
        sums[key].add(r, prices.get(r.price_id) if r.price_id is not None else None)
    return sorted(sums.items())


def _request_figures(g: RequestGroup) -> dict[str, Any]:
    figures = {
        **g.columns(),
        "requests": g.succeeded + g.failed,
        "cached_share": ratio(g.cached, g.prompt),
        **dict.fromkeys(HOURLY_ONLY),
        "provisional": False,  # final rows only: nothing to revise later
    }
    # Money is stored with 12 decimals: no float noise beyond that.
    for name in ("list_cost_usd", "cache_savings_usd"):
        figures[name] = round(figures[name], 12)
    return figures


def _with_token_share(
    columns: Sequence[str], figures: Mapping[str, Any], total_tokens: int
) -> dict[str, Any]:
    tokens = (figures.get("prompt_tokens") or 0) + (figures.get("completion_tokens") or 0)
    out = {**figures, "token_share": ratio(tokens, total_tokens)}
    return {name: out.get(name) for name in columns}


def cost_report(
    engine: Engine,
    *,
    since: datetime,
    until: datetime,
    group_by: Sequence[str] | str,
    source: str = "rollups",
    instance_id: str | None = None,
) -> Report:
    """Cost by any of day|hour, model, api_key, end_user over [since, until), from the
    hourly rollups (`source` "rollups", the default here: whole UTC hours, plus what the
    rollup has not counted yet, marked provisional) or from the request rows ("requests": the
    exact window, list-price figures only), or whichever `cost_window` picks ("auto": what
    the API and the CLI use). `instance_id`: only that instance's requests (scope
    "instance"); None: every instance on the database (scope "fleet"). The Report says which
    source, scope and exact window it used; see the module docstring for each figure."""
    groups = parse_group_by(group_by, COST_GROUPS)
    source, start, end = cost_window(since, until, groups, source)
    columns = [*groups, *COST_METRICS]
    empty_totals = {**dict.fromkeys(COST_METRICS), "provisional": False}
    out: list[dict[str, Any]] = []
    totals: dict[str, Any] = {}
    if source == "requests":
        with engine.connect() as conn:
            found = _from_requests(conn, start, end, groups, instance_id)
        total = RequestGroup()
        for _key, g in found:
            for f in fields(RequestGroup):
                if f.name != "day":
                    setattr(total, f.name, getattr(total, f.name) + getattr(g, f.name))
        all_tokens = total.prompt + total.completion
        out = [
            _with_token_share(
                columns, {**dict(zip(groups, key, strict=True)), **_request_figures(g)}, all_tokens
            )
            for key, g in found
        ]
        if found:
            totals = _with_token_share(COST_METRICS, _request_figures(total), all_tokens)
    else:
        first, last = time_buckets(start)[0], time_buckets(end - timedelta(hours=1))[0]
        c = ROLLUPS.c
        stmt = select(ROLLUPS).where(c.hour_bucket >= first, c.hour_bucket <= last)
        if instance_id is not None:
            stmt = stmt.where(c.instance_id == instance_id)
        with engine.connect() as conn:
            rows = [{**r._mapping, "provisional": False} for r in conn.execute(stmt)]
            pending = _not_rolled_up(conn, first, last, instance_id)
            if pending:
                rows = _provisional_rows(conn, rows, pending)
        accs: dict[tuple[str, ...], _CostAcc] = defaultdict(_CostAcc)
        acc_total = _CostAcc()
        for r in rows:
            accs[tuple(r[_COST_KEYS[g]] for g in groups)].add(r)
            acc_total.add(r)
        all_tokens = acc_total.prompt + acc_total.completion
        out = [
            _with_token_share(
                columns, {**dict(zip(groups, key, strict=True)), **acc.result()}, all_tokens
            )
            for key, acc in sorted(accs.items())
        ]
        if rows:
            totals = _with_token_share(COST_METRICS, acc_total.result(), all_tokens)
    return Report(
        kind="cost",
        group_by=groups,
        columns=columns,
        rows=out,
        totals=totals or empty_totals,
        since=start.isoformat(),
        until=end.isoformat(),
        empty=not out,
        source=source,
        scope="fleet" if instance_id is None else "instance",
        instance_id=instance_id,
    )
