"""The hourly cost rollup (utilization samples: accounting/samples.py; retention:
accounting/prune.py).

`run_rollup(engine, instance_id, now=..., gpu_hourly_usd=..., num_gpus=..., peak_flops=...)`
writes `cost_rollups`, one row per (hour_bucket, instance_id, model, api_key_name), from the
instance's own request rows and samples:

* Requests are bucketed by their `hour_bucket` (the UTC hour of arrival). Only final rows count
  (success / error / aborted / interrupted); `requests_succeeded` counts "success",
  `requests_failed` the other three. `api_key_name` is "" for requests without a key. Tokens
  are summed, with cached prompt tokens capped at the prompt as in pricing; a row's computed
  tokens are prompt - cached + completion (cached prompt tokens cost no compute).
* List cost: `list_cost_usd` is the sum of the rows' `cost_usd`, priced at ingest with the
  price in force at each request's arrival, so a price change inside an hour is exact.
  Requests without a price in force have no cost and count as free. The list cost splits
  exactly into a prompt side, sum of ((prompt - cached) x prompt rate + cached x cached rate) /
  1e6, and a completion side, sum of completion x completion rate / 1e6, each recomputed per
  request from the price row it was priced with (`requests.price_id`).
  `list_usd_per_mtok_prompt` = prompt side / prompt tokens x 1e6 (cached tokens at their
  own rate, so this is the effective prompt rate); `list_usd_per_mtok_completion` =
  completion side / completion tokens x 1e6.
* Cache savings: `cache_savings_usd` = sum of cached x (prompt rate - cached rate) / 1e6 over
  the same price rows: what the prefix cache saved at list price.
* GPU time, per (hour, instance): `covered_s` is the sum of `interval_s` of the instance's
  samples in the hour and busy_s the sum of `interval_s x busy_fraction`. The hour's GPU cost is
  `gpu_hourly_usd x num_gpus x covered_s / 3600`: only time the daemon was up and sampling is
  paid for, and an hour without samples has no GPU cost. Its busy part (busy_s / covered_s of
  it) is shared among the hour's (model, key) rows in proportion to their computed tokens; the
  idle part goes to a row of its own with `api_key_name` "(idle)" (no requests, no tokens,
  `model` = the model of the hour's latest sample). Every (hour, instance) with samples has
  exactly one "(idle)" row. If no request arriving in the hour computed any token (busy time
  from requests that arrived in an earlier hour), the busy part goes to the "(idle)" row too,
  so the rows of an (hour, instance) always add up to its GPU cost.
* `gpu_usd_per_mtok_prompt` = `gpu_usd_per_mtok_completion` = the row's `gpu_cost_usd` /
  its computed tokens x 1e6: compute is shared per token, so a prompt token and a completion
  token cost the same under the GPU view (and every request row of an (hour, instance) gets the
  same rate: busy cost / computed tokens of the hour).
* `mean_utilization` = busy_s / covered_s. `mfu` = sum(flops_per_token(model) x computed
  tokens) / (covered_s x peak_flops x num_gpus), with flops_per_token(model) the
  interval-weighted mean over the hour's samples of that model that report it; None when
  peak_flops, num_gpus or covered_s is 0, or when tokens of a model have no flops_per_token.
  Both describe the whole (hour, instance) and are repeated, with `covered_s`, on each of its
  rows: aggregate them once per (hour_bucket, instance_id) (the reports do).
* Any division by zero gives None, never an exception.

Idempotence and restarts: a run recomputes whole hours, from the watermark hour (job
"cost_rollup", per instance; first run: the instance's oldest request or sample) up to the hour
of `now`, and replaces this instance's rows for them (delete + insert + watermark in one
transaction), so running it twice changes nothing. The watermark then advances to the start of
the latest hour that can no longer change: the hour of `now - 1 hour`, but never past the
arrival hour of this instance's oldest still-running request; it never moves back. A restart
resumes from it and never counts anything twice. Rows of other instances are never touched;
reports sum across instances, so daemons sharing one database are each counted once. A row
that reaches the database more than an hour late (after a long database outage) lands in an
hour that is no longer recomputed and is not counted.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    case,
    delete,
    func,
    insert,
    select,
)

from controlplane.errors import FieldError
from controlplane.store.db import dialect_insert
from controlplane.store.models import (
    FINAL_STATUSES,
    IDLE_KEY,
    CostRollupRow,
    GpuSampleRow,
    JobWatermarkRow,
    PriceEntry,
    RequestRow,
    UtilizationSampleRow,
    time_buckets,
)

SAMPLES = UtilizationSampleRow.__table__
GPUS = GpuSampleRow.__table__
ROLLUPS = CostRollupRow.__table__
WATERMARKS = JobWatermarkRow.__table__
REQUESTS = RequestRow.__table__
PRICES = PriceEntry.__table__

ROLLUP_JOB = "cost_rollup"
HOUR = timedelta(hours=1)
_FINAL = sorted(FINAL_STATUSES)


@dataclass(frozen=True, slots=True)
class RollupResult:
    hours_recomputed: int  # whole hours recomputed (first_hour up to the hour of `now`)
    rows_written: int  # cost_rollups rows inserted
    watermark: datetime  # where the next run starts
    first_hour: str | None = None  # hour bucket the run started at; None if nothing to do


def aware(name: str, value: datetime) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise FieldError(name, f"must be a timezone-aware datetime, got {value!r}")
    return value.astimezone(UTC)


def finite(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None when either is unknown or b is 0 (the reports use it too)."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def floor_hour(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def hour_start(bucket: str) -> datetime:
    """The start of an hour bucket ("YYYY-MM-DDTHH") as an aware UTC datetime."""
    return datetime.strptime(bucket, "%Y-%m-%dT%H").replace(tzinfo=UTC)


# -- watermarks ---------------------------------------------------------------------------------


def get_watermark(bind: Engine | Connection, job: str, instance_id: str) -> datetime | None:
    stmt = select(WATERMARKS.c.value).where(
        WATERMARKS.c.job == job, WATERMARKS.c.instance_id == instance_id
    )
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return conn.execute(stmt).scalar()
    return bind.execute(stmt).scalar()


def _set_watermark(conn: Connection, job: str, instance_id: str, value: datetime) -> None:
    ins = dialect_insert(conn.dialect.name)(WATERMARKS).values(
        job=job, instance_id=instance_id, value=value
    )
    conn.execute(
        ins.on_conflict_do_update(index_elements=["job", "instance_id"], set_={"value": value})
    )


# -- the cost rollup ----------------------------------------------------------------------------


@dataclass(slots=True)
class RequestGroup:
    """The final requests of one (hour, model, key), as the rollup counts them."""

    day: str = ""
    succeeded: int = 0
    failed: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    list_cost: float = 0.0
    prompt_side: float = 0.0
    completion_side: float = 0.0
    # Cached prompt tokens x (prompt price - cached prompt price): what the prefix cache saved
    # at list price, by the same price rows as the cost.
    cache_savings: float = 0.0

    @property
    def computed(self) -> int:
        return self.prompt - self.cached + self.completion

    def add(self, r: Any, price: Any) -> None:
        """Count one (status, price) aggregate of final request rows: `r` has `status`, `n`,
        `prompt`, `cached` (capped at the prompt), `completion` and `cost` (sums); `price` is
        the price row they were priced with (None: no price, so no sides and no savings).
        The rollup and the exact-window cost report (from the request rows) both count with
        it, so they agree to the last digit over the same rows."""
        prompt, cached_n, completion = (
            int(r.prompt or 0),
            int(r.cached or 0),
            int(r.completion or 0),
        )
        if r.status == "success":
            self.succeeded += int(r.n)
        else:
            self.failed += int(r.n)
        self.prompt += prompt
        self.cached += cached_n
        self.completion += completion
        self.list_cost += float(r.cost or 0)
        if price is not None:
            self.prompt_side += (
                (prompt - cached_n) * float(price.prompt_per_mtok)
                + cached_n * float(price.cached_prompt_per_mtok)
            ) / 1e6
            self.completion_side += completion * float(price.completion_per_mtok) / 1e6
            self.cache_savings += (
                cached_n
                * (float(price.prompt_per_mtok) - float(price.cached_prompt_per_mtok))
                / 1e6
            )

    def columns(self) -> dict[str, Any]:
        """The cost rollup's columns that come from the requests alone (the stored rollup and
        the report's live view of the current hour both write these)."""
        return {
            "requests_succeeded": self.succeeded,
            "requests_failed": self.failed,
            "prompt_tokens": self.prompt,
            "cached_prompt_tokens": self.cached,
            "completion_tokens": self.completion,
            "list_cost_usd": self.list_cost,
            "cache_savings_usd": self.cache_savings,
            "list_usd_per_mtok_prompt": ratio(self.prompt_side * 1e6, self.prompt),
            "list_usd_per_mtok_completion": ratio(self.completion_side * 1e6, self.completion),
        }


@dataclass(slots=True)
class _Hour:
    """The samples of one hour (this instance)."""

    covered: float = 0.0
    busy: float = 0.0
    latest: tuple[datetime, str] | None = None  # (time, model) of the latest sample
    flops_num: dict[str, float] = field(default_factory=dict)  # model -> sum(interval x fpt)
    flops_den: dict[str, float] = field(default_factory=dict)  # model -> sum(interval)


def _first_hour(conn: Connection, instance_id: str) -> str | None:
    """The oldest hour bucket with data of this instance (first run)."""
    r = conn.execute(
        select(func.min(REQUESTS.c.hour_bucket)).where(REQUESTS.c.instance_id == instance_id)
    ).scalar()
    s = conn.execute(
        select(func.min(SAMPLES.c.hour_bucket)).where(SAMPLES.c.instance_id == instance_id)
    ).scalar()
    found = [b for b in (r, s) if b is not None]
    return min(found) if found else None


def summed_columns() -> list[Any]:
    """The request rows' sums per (status, price) that `RequestGroup.add` reads: the hourly
    rollup and the exact-window cost report select these beside their own group columns.
    Group by plain columns only: PostgreSQL cannot match an expression with bound parameters
    in SELECT to the "same" one in GROUP BY. And put no status filter in WHERE: with one,
    SQLite reads every final row through the status index instead of the time range; the
    caller skips running rows (`final_rows`)."""
    c = REQUESTS.c
    cached = case(
        (c.cached_prompt_tokens < c.prompt_tokens, c.cached_prompt_tokens), else_=c.prompt_tokens
    )
    return [
        c.status,
        c.price_id,
        func.count().label("n"),
        func.sum(c.prompt_tokens).label("prompt"),
        func.sum(cached).label("cached"),
        func.sum(c.completion_tokens).label("completion"),
        func.sum(c.cost_usd).label("cost"),
    ]


def final_rows(conn: Connection, stmt: Any) -> tuple[list[Any], dict[int, Any]]:
    """The rows of a `summed_columns` query that are final, and the prices they name."""
    rows = [r for r in conn.execute(stmt) if r.status in FINAL_STATUSES]
    price_ids = {r.price_id for r in rows if r.price_id is not None}
    prices: dict[int, Any] = {}
    if price_ids:
        prices = {p.id: p for p in conn.execute(select(PRICES).where(PRICES.c.id.in_(price_ids)))}
    return rows, prices


def request_groups(
    conn: Connection, instance_id: str, first: str, last: str
) -> dict[tuple[str, str, str], RequestGroup]:
    c = REQUESTS.c
    stmt = (
        select(c.hour_bucket, c.day_bucket, c.model, c.api_key_name, *summed_columns())
        .where(c.instance_id == instance_id, c.hour_bucket >= first, c.hour_bucket <= last)
        .group_by(c.hour_bucket, c.day_bucket, c.model, c.api_key_name, c.status, c.price_id)
    )
    rows, prices = final_rows(conn, stmt)
    groups: dict[tuple[str, str, str], RequestGroup] = defaultdict(RequestGroup)
    for r in rows:
        g = groups[(r.hour_bucket, r.model, r.api_key_name or "")]
        g.day = r.day_bucket
        g.add(r, prices.get(r.price_id) if r.price_id is not None else None)
    return groups


def _sample_hours(conn: Connection, instance_id: str, first: str, last: str) -> dict[str, _Hour]:
    c = SAMPLES.c
    has_fpt = c.flops_per_token.is_not(None)
    stmt = (
        select(
            c.hour_bucket,
            c.model,
            func.sum(c.interval_s).label("covered"),
            func.sum(c.interval_s * c.busy_fraction).label("busy"),
            func.max(c.time).label("latest"),
            func.sum(case((has_fpt, c.interval_s * c.flops_per_token))).label("fnum"),
            func.sum(case((has_fpt, c.interval_s))).label("fden"),
        )
        .where(c.instance_id == instance_id, c.hour_bucket >= first, c.hour_bucket <= last)
        .group_by(c.hour_bucket, c.model)
    )
    hours: dict[str, _Hour] = defaultdict(_Hour)
    for r in conn.execute(stmt):
        h = hours[r.hour_bucket]
        h.covered += float(r.covered or 0)
        h.busy += float(r.busy or 0)
        if r.latest is not None and (h.latest is None or (r.latest, r.model) > h.latest):
            h.latest = (r.latest, r.model)
        if r.fden:
            h.flops_num[r.model] = float(r.fnum or 0)
            h.flops_den[r.model] = float(r.fden)
    return hours


def _hour_rows(
    hour: str,
    instance_id: str,
    groups: dict[tuple[str, str], RequestGroup],
    samples: _Hour | None,
    *,
    now: datetime,
    gpu_hourly_usd: float,
    num_gpus: int,
    peak_flops: float,
) -> list[dict[str, Any]]:
    covered = samples.covered if samples else 0.0
    busy = min(samples.busy, covered) if samples else 0.0
    hour_cost = gpu_hourly_usd * num_gpus * covered / 3600
    busy_cost = hour_cost * busy / covered if covered else 0.0
    idle_cost = hour_cost - busy_cost
    total_computed = sum(g.computed for g in groups.values())
    if total_computed == 0:
        idle_cost, busy_cost = hour_cost, 0.0
    utilization = ratio(busy, covered)

    mfu: float | None = None
    denominator = covered * peak_flops * num_gpus
    if denominator > 0:
        tokens_by_model: dict[str, int] = defaultdict(int)
        for (model, _key), g in groups.items():
            tokens_by_model[model] += g.computed
        flops = 0.0
        for model, tokens in tokens_by_model.items():
            if tokens == 0:
                continue
            fpt = (
                ratio(samples.flops_num.get(model), samples.flops_den.get(model))
                if samples
                else None
            )
            if fpt is None:
                flops = math.nan
                break
            flops += fpt * tokens
        mfu = None if math.isnan(flops) else flops / denominator

    day = hour[:10]
    common = {
        "hour_bucket": hour,
        "day_bucket": day,
        "instance_id": instance_id,
        "mean_utilization": utilization,
        "mfu": mfu,
        "covered_s": covered,
        "updated_at": now,
    }
    rows = []
    for (model, key), g in sorted(groups.items()):
        gpu_cost = busy_cost * g.computed / total_computed if total_computed else 0.0
        gpu_rate = ratio(gpu_cost * 1e6, g.computed)
        rows.append(
            {
                **common,
                "model": model,
                "api_key_name": key,
                **g.columns(),
                "gpu_cost_usd": gpu_cost,
                "gpu_usd_per_mtok_prompt": gpu_rate,
                "gpu_usd_per_mtok_completion": gpu_rate,
            }
        )
    if covered > 0 and samples is not None and samples.latest is not None:
        rows.append(
            {
                **common,
                "model": samples.latest[1],
                "api_key_name": IDLE_KEY,
                "requests_succeeded": 0,
                "requests_failed": 0,
                "prompt_tokens": 0,
                "cached_prompt_tokens": 0,
                "completion_tokens": 0,
                "list_cost_usd": 0.0,
                "cache_savings_usd": 0.0,
                "gpu_cost_usd": idle_cost,
                "list_usd_per_mtok_prompt": None,
                "list_usd_per_mtok_completion": None,
                "gpu_usd_per_mtok_prompt": None,
                "gpu_usd_per_mtok_completion": None,
            }
        )
    return rows


def run_rollup(
    engine: Engine,
    instance_id: str,
    *,
    now: datetime,
    gpu_hourly_usd: float,
    num_gpus: int,
    peak_flops: float,
) -> RollupResult:
    """Recompute this instance's hourly cost rollups from its watermark up to `now` (see the
    module docstring for every definition). Idempotent; one transaction."""
    now = aware("now", now)
    for name, value in (("gpu_hourly_usd", gpu_hourly_usd), ("peak_flops", peak_flops)):
        if not math.isfinite(value) or value < 0:
            raise FieldError(name, f"must be a finite number >= 0, got {value!r}")
    if num_gpus < 0:
        raise FieldError("num_gpus", f"must be >= 0, got {num_gpus!r}")
    last = time_buckets(now)[0]
    with engine.begin() as conn:
        old = get_watermark(conn, ROLLUP_JOB, instance_id)
        first = time_buckets(old)[0] if old is not None else _first_hour(conn, instance_id)
        rows: list[dict[str, Any]] = []
        hours = 0
        if first is not None and first <= last:
            hours = int((hour_start(last) - hour_start(first)) / HOUR) + 1
            groups = request_groups(conn, instance_id, first, last)
            samples = _sample_hours(conn, instance_id, first, last)
            by_hour: dict[str, dict[tuple[str, str], RequestGroup]] = defaultdict(dict)
            for (hour, model, key), g in groups.items():
                by_hour[hour][(model, key)] = g
            for hour in sorted(set(by_hour) | set(samples)):
                rows += _hour_rows(
                    hour,
                    instance_id,
                    by_hour.get(hour, {}),
                    samples.get(hour),
                    now=now,
                    gpu_hourly_usd=gpu_hourly_usd,
                    num_gpus=num_gpus,
                    peak_flops=peak_flops,
                )
            conn.execute(
                delete(ROLLUPS).where(
                    ROLLUPS.c.instance_id == instance_id,
                    ROLLUPS.c.hour_bucket >= first,
                    ROLLUPS.c.hour_bucket <= last,
                )
            )
            if rows:
                conn.execute(insert(ROLLUPS), rows)

        watermark = floor_hour(now) - HOUR
        oldest_running = conn.execute(
            select(func.min(REQUESTS.c.arrival_time)).where(
                REQUESTS.c.instance_id == instance_id, REQUESTS.c.status == "running"
            )
        ).scalar()
        if oldest_running is not None:
            watermark = min(watermark, floor_hour(oldest_running))
        if old is not None:
            watermark = max(watermark, old)  # never back: those hours may be pruned already
        if watermark != old:
            _set_watermark(conn, ROLLUP_JOB, instance_id, watermark)
    return RollupResult(
        hours_recomputed=hours,
        rows_written=len(rows),
        watermark=watermark,
        first_hour=first if hours else None,
    )
