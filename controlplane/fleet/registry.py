"""The fleet in SQL: every daemon on a shared database keeps one `instances` row.

A daemon registers at start (state loading), refreshes its row on a heartbeat (state and
headline figures) and marks it stopped on a graceful exit. Readers compute "unreachable": a
daemon that was killed, hung or cut off from the database cannot say so itself, so a live
state (loading, serving, draining) whose heartbeat is older than the configured age reads as
unreachable, since heartbeat_at + that age. A heartbeat from the future (a skewed clock, or
a row written by hand) never reads as fresher than now: its age reads 0, and one more than
the unreachable age ahead reads unreachable, so a forged row cannot stay "serving" forever.
Torch-free: `controlplane fleet ls` imports this.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, insert, select, update

from controlplane.common import check_url
from controlplane.fleet.order import worst_first_key
from controlplane.runtime.state import DaemonState
from controlplane.store.audit import encode_value
from controlplane.store.models import CostRollupRow, InstanceRow

INSTANCES = InstanceRow.__table__
ROLLUPS = CostRollupRow.__table__
# A daemon's own states (controlplane.runtime.state), as the table names them; and the one
# state only a reader of the table can see: no heartbeat for unreachable_after_s.
LOADING, SERVING, DRAINING, STOPPED = (
    s.fleet_name
    for s in (DaemonState.LOADING, DaemonState.READY, DaemonState.DRAINING, DaemonState.STOPPED)
)
UNREACHABLE = "unreachable"
STATES = (LOADING, SERVING, DRAINING, STOPPED)  # what a daemon writes
# A stopped instance stays in the default view this long (it just went away: worth a look),
# then only `include_stopped` shows it.
STOPPED_SHOWN_S = 3600.0
# Heartbeat figures whose None is a reading (an emptied queue must clear the last beat's oldest
# wait): written on every beat, None included; the others keep their last value when a beat
# does not know them (a beat while loading, the stopped beat).
CLEARED = ("oldest_waiting_s", "ttft_p99_ms", "slo_met")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A daemon's headline figures (None where not known yet)."""

    state: str
    model: str | None = None
    quantization: str | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None  # 0-1
    output_tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    config: dict[str, Any] | None = None  # its live-tunable settings (config drift)
    # The incident figures (the worst-first order reads them). Here None is a reading, not
    # "not known": nothing waits, nothing finished in the last minute, no p99 for any target;
    # so every beat writes them, None included (CLEARED).
    oldest_waiting_s: float | None = None
    ttft_p99_ms: float | None = None  # over the last minute
    slo_met: bool | None = None  # /admin/stats slo.met


@dataclass(frozen=True, slots=True)
class Member:
    """One instance as a reader sees it."""

    id: str
    advertise_url: str
    hostname: str
    pid: int
    version: str
    model: str | None
    quantization: str | None
    state: str  # STATES or "unreachable"
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age_s: float
    unreachable_since: datetime | None
    num_running: int | None
    num_waiting: int | None
    kv_usage: float | None
    output_tokens_per_s: float | None
    ttft_p50_s: float | None
    config: dict[str, Any] | None
    # The incident figures of its last heartbeat (None: nothing waits / nothing finished in the
    # last minute / no SLO reading, or an older daemon that does not send them).
    oldest_waiting_s: float | None = None
    ttft_p99_ms: float | None = None
    slo_met: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("started_at", "heartbeat_at", "unreachable_since"):
            if out[key] is not None:
                out[key] = out[key].isoformat()
        return out


def _figures(beat: Heartbeat) -> dict[str, Any]:
    if beat.state not in STATES:
        raise ValueError(f"state: must be one of {', '.join(STATES)}, got {beat.state!r}")
    out = dataclasses.asdict(beat)
    if beat.config is not None:
        out["config"] = encode_value(beat.config)
    return out


def register(
    db: Engine,
    instance_id: str,
    *,
    advertise_url: str,
    hostname: str,
    pid: int,
    version: str,
    beat: Heartbeat,
    now: datetime,
) -> None:
    """Insert or replace this instance's row (a restarted daemon keeps its id and row);
    ValueError for an advertise_url that is no plain http(s) URL (query, fragment, scheme)."""
    check_url(advertise_url)
    row = dict(
        advertise_url=advertise_url,
        hostname=hostname,
        pid=pid,
        version=version,
        started_at=now,
        heartbeat_at=now,
        **_figures(beat),
    )
    with db.begin() as conn:
        done = conn.execute(update(INSTANCES).where(INSTANCES.c.id == instance_id).values(**row))
        if done.rowcount == 0:
            conn.execute(insert(INSTANCES).values(id=instance_id, **row))


def heartbeat(db: Engine, instance_id: str, beat: Heartbeat, *, now: datetime) -> bool:
    """Refresh the row; False if it is gone (pruned by hand): the caller registers again."""
    values = {
        k: v for k, v in _figures(beat).items() if v is not None or k == "state" or k in CLEARED
    }
    with db.begin() as conn:
        done = conn.execute(
            update(INSTANCES)
            .where(INSTANCES.c.id == instance_id)
            .values(heartbeat_at=now, **values)
        )
    return done.rowcount > 0


def members(
    db: Engine, *, now: datetime, unreachable_after_s: float, include_stopped: bool = False
) -> list[Member]:
    """The instances, worst first (what an operator paged at 3 a.m. wants at the top; see
    `controlplane.fleet.order.worst_first_key`): unreachable, then missing their SLO, then by
    waiting requests and the oldest waiting age, then draining, loading, serving, then the
    fullest KV cache, stopped last; ties by id. Stopped for over STOPPED_SHOWN_S: only with
    include_stopped."""
    with db.connect() as conn:
        rows = conn.execute(select(INSTANCES)).mappings().all()
    out = [member(dict(r), now=now, unreachable_after_s=unreachable_after_s) for r in rows]
    if not include_stopped:
        out = [m for m in out if m.state != STOPPED or m.heartbeat_age_s <= STOPPED_SHOWN_S]
    return sorted(out, key=worst_first_key)


def member(row: dict[str, Any], *, now: datetime, unreachable_after_s: float) -> Member:
    """A row as readers see it: its state, or unreachable when a live state's heartbeat is
    older than `unreachable_after_s`, or more than that far in the future (clamped: the age
    reads 0, never negative)."""
    beat_at = row["heartbeat_at"].astimezone(UTC)
    age = (now - beat_at).total_seconds()
    state, since = row["state"], None
    if state != STOPPED and age > unreachable_after_s:
        state, since = UNREACHABLE, beat_at + timedelta(seconds=unreachable_after_s)
    elif state != STOPPED and -age > unreachable_after_s:
        state, since = UNREACHABLE, now  # a clock that far ahead proves nothing about now
    age = max(age, 0.0)
    fields = {f.name for f in dataclasses.fields(Member)}
    base = {k: v for k, v in row.items() if k in fields}
    return Member(
        **{
            **base,
            "state": state,
            "heartbeat_at": beat_at,
            "started_at": row["started_at"].astimezone(UTC),
            "heartbeat_age_s": age,
            "unreachable_since": since,
            "config": json.loads(row["config"]) if row.get("config") else None,
        }
    )


def config_drift(found: Sequence[Member]) -> dict[str, dict[str, Any]]:
    """Per live-tunable setting on which the live instances (not stopped) disagree: the
    majority's value and each instance that differs with its own value (an instance that does
    not report a setting, an older version, is left out of that setting). A tie goes to the
    value the lowest instance id has, so every reader names the same odd ones out."""
    live = sorted((m for m in found if m.state != STOPPED and m.config), key=lambda m: m.id)
    drift: dict[str, dict[str, Any]] = {}
    for key in sorted({k for m in live for k in m.config or {}}):
        # An instance without the key (an older version) has no say on it.
        values = {m.id: m.config[key] for m in live if m.config and key in m.config}
        counts = Counter(encode_value(v) for v in values.values())
        if len(counts) < 2:
            continue
        top = max(counts.values())
        majority = next(v for v in values.values() if counts[encode_value(v)] == top)
        drift[key] = {
            "majority": majority,
            "instances": {i: v for i, v in values.items() if v != majority},
        }
    return drift


@dataclass(frozen=True, slots=True)
class Totals:
    """The fleet's headline figures: throughput from the live heartbeats, request rate and
    cost per hour from the cost rollups of the live instances' last two hour buckets (the
    rollup job refreshes the current hour every jobs.rollup_interval_s), per second of time
    each instance was up and sampling."""

    instances: int  # not stopped
    serving: int
    unreachable: int
    output_tokens_per_s: float
    requests_per_s: float | None  # None: no rollups yet
    gpu_cost_per_hour_usd: float | None
    list_cost_per_hour_usd: float | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def totals(db: Engine, found: Sequence[Member], *, now: datetime) -> Totals:
    live = [m for m in found if m.state != STOPPED]
    tok_s = sum(m.output_tokens_per_s or 0.0 for m in live if m.state in (SERVING, DRAINING))
    rows: Sequence[Any] = []
    if live:
        since = (now.astimezone(UTC) - timedelta(hours=1)).strftime("%Y-%m-%dT%H")
        c = ROLLUPS.c
        stmt = (
            select(
                c.instance_id,
                c.hour_bucket,
                func.sum(c.requests_succeeded + c.requests_failed).label("requests"),
                func.sum(c.gpu_cost_usd).label("gpu"),
                func.sum(c.list_cost_usd).label("list"),
                func.max(c.covered_s).label("covered"),  # repeated on each row of the hour
            )
            .where(c.hour_bucket >= since, c.instance_id.in_([m.id for m in live]))
            .group_by(c.instance_id, c.hour_bucket)
        )
        with db.connect() as conn:
            rows = conn.execute(stmt).all()
    # Each instance's rate over its own covered time; the fleet's is their sum.
    per: dict[str, list[float]] = {}
    for r in rows:
        acc = per.setdefault(r.instance_id, [0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((r.requests, r.gpu, r.list, r.covered)):
            acc[i] += float(v or 0)
    rates = [(n / t, gpu / t * 3600, lst / t * 3600) for n, gpu, lst, t in per.values() if t > 0]
    req_s, gpu_h, list_h = (
        tuple(sum(col) for col in zip(*rates, strict=True)) if rates else (None, None, None)
    )
    return Totals(
        instances=len(live),
        serving=sum(m.state == SERVING for m in live),
        unreachable=sum(m.state == UNREACHABLE for m in live),
        output_tokens_per_s=tok_s,
        requests_per_s=req_s,
        gpu_cost_per_hour_usd=gpu_h,
        list_cost_per_hour_usd=list_h,
    )
