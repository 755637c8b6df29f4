"""Scheduled jobs' SQL side on SQLite and PostgreSQL: utilization samples, the hourly cost
rollup (hand-computed figures), watermarks and restarts, several instances in one database,
pruning, migration 0003 with its views, and the cost / utilization reports."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, inspect, select, text, update

from controlplane.accounting.gpu import GpuReading
from controlplane.accounting.prune import prune
from controlplane.accounting.reports import cost_report, utilization_report
from controlplane.accounting.rollup import ROLLUP_JOB, get_watermark, run_rollup
from controlplane.accounting.samples import write_sample
from controlplane.accounting.utilization import UtilizationSample
from controlplane.common import parse_group_by, parse_time
from controlplane.config import Price
from controlplane.store import (
    IDLE_KEY,
    CostRollupRow,
    GpuSampleRow,
    RequestRow,
    UtilizationSampleRow,
    check,
    current,
    downgrade,
    head,
    make_engine,
    sync_prices,
    time_buckets,
    upgrade,
)

REQUESTS = RequestRow.__table__
ROLLUPS = CostRollupRow.__table__
SAMPLES = UtilizationSampleRow.__table__
GPUS = GpuSampleRow.__table__

DAY = datetime(2026, 3, 1, tzinfo=UTC)
GPU = dict(gpu_hourly_usd=2.0, num_gpus=2, peak_flops=1e12)  # 4 USD per wall-clock hour
NOW = DAY.replace(hour=14, minute=10)


def at(hour: int, minute: int = 0, day: int = 1) -> datetime:
    return datetime(2026, 3, day, hour, minute, tzinfo=UTC)


# -- seed data ----------------------------------------------------------------------------------

# Two "*" prices; the second takes effect at 12:30, inside the 12:00 hour.
PRICES_CONFIG = (
    Price("*", DAY - timedelta(days=59), 1.0, 0.5, 2.0),  # P1
    Price("*", at(12, 30), 2.0, 1.0, 4.0),  # P2
)


def add_request(
    engine: Engine,
    id: str,
    arrival: datetime,
    *,
    instance: str = "inst-a",
    model: str = "m",
    key: str | None = "alice",
    status: str = "success",
    prompt: int = 0,
    cached: int = 0,
    completion: int = 0,
    price_id: int | None = None,
    cost_usd: float | None = None,
) -> None:
    hour, day = time_buckets(arrival)
    with engine.begin() as conn:
        conn.execute(
            insert(REQUESTS).values(
                id=id,
                instance_id=instance,
                model=model,
                endpoint="chat.completions",
                api_key_name=key,
                status=status,
                arrival_time=arrival,
                prompt_tokens=prompt,
                cached_prompt_tokens=cached,
                completion_tokens=completion,
                price_id=price_id,
                cost_usd=cost_usd,
                hour_bucket=hour,
                day_bucket=day,
            )
        )


def add_sample(
    engine: Engine,
    time: datetime,
    interval_s: float,
    busy: float,
    *,
    instance: str = "inst-a",
    model: str = "m",
    flops_per_token: float | None = 1e9,
    gpus: tuple[GpuReading, ...] = (),
    **readings: Any,
) -> int:
    sample = UtilizationSample(
        time=time,
        interval_s=interval_s,
        model=model,
        busy_fraction=busy,
        flops_per_token=flops_per_token,
        **readings,
    )
    return write_sample(engine, instance, sample, gpus)


def seed(engine: Engine) -> tuple[int, int]:
    """Requests and samples of two instances on 2026-03-01; returns the price ids (P1, P2).

    inst-a
      11:00 hour: one sample (11:30, 1800 s, busy 0.25, model m), no requests.
      12:00 hour: requests (cost = ((prompt - cached) x prompt + cached x cached-rate +
        completion x completion-rate) / 1e6, with the price in force at arrival):
          r1 12:10 alice   success  1000 prompt, 200 cached, 200 compl.  P1: (800 + 100 + 400)
                                                                         / 1e6 = 0.0013
          r2 12:40 alice   success  2000 prompt,   0 cached, 1000 compl. P2: (4000 + 4000)
                                                                         / 1e6 = 0.008
          r3 12:50 no key  error    1200 prompt, 200 cached,    0 compl. P2: (2000 + 200)
                                                                         / 1e6 = 0.0022
          r4 12:20 bob     aborted  2000 prompt,   0 cached, 1000 compl. P1: (2000 + 2000)
                                                                         / 1e6 = 0.004
          r5 12:55 bob     running  (not counted; holds the watermark at 12:00)
        samples (model m, 1e9 FLOPs per token): 12:15 / 12:30 / 12:45 / 12:59, 900 s each,
        busy 0.5 / 0.75 / 0.25 / 0.5.
      13:00 hour: r6 13:10 alice, model m2, success, 100 prompt, 100 compl., P2: (200 + 400) /
        1e6 = 0.0006; samples (model m2, no FLOPs per token) 13:15 / 13:30, 900 s, busy 1 / 0.
    inst-b
      12:00 hour: r7 12:30 alice, model m, success, 1000 prompt, P2 (in force from 12:30
        exactly): 2000 / 1e6 = 0.002; one sample 12:30, 3600 s, busy 0.5.
    """
    sync_prices(engine, PRICES_CONFIG)
    with engine.connect() as conn:
        p1, p2 = conn.execute(text("SELECT id FROM prices ORDER BY effective_from")).scalars()
    add_request(engine, "r1", at(12, 10), prompt=1000, cached=200, completion=200, price_id=p1, cost_usd=0.0013)  # fmt: skip
    add_request(engine, "r2", at(12, 40), prompt=2000, completion=1000, price_id=p2, cost_usd=0.008)  # fmt: skip
    add_request(engine, "r3", at(12, 50), key=None, status="error", prompt=1200, cached=200, price_id=p2, cost_usd=0.0022)  # fmt: skip
    add_request(engine, "r4", at(12, 20), key="bob", status="aborted", prompt=2000, completion=1000, price_id=p1, cost_usd=0.004)  # fmt: skip
    add_request(engine, "r5", at(12, 55), key="bob", status="running", prompt=1000)
    add_request(engine, "r6", at(13, 10), model="m2", prompt=100, completion=100, price_id=p2, cost_usd=0.0006)  # fmt: skip
    add_request(engine, "r7", at(12, 30), instance="inst-b", prompt=1000, price_id=p2, cost_usd=0.002)  # fmt: skip

    add_sample(engine, at(11, 30), 1800, 0.25)
    for minute, busy in ((15, 0.5), (30, 0.75), (45, 0.25), (59, 0.5)):
        add_sample(engine, at(12, minute), 900, busy)
    add_sample(engine, at(13, 15), 900, 1.0, model="m2", flops_per_token=None)
    add_sample(engine, at(13, 30), 900, 0.0, model="m2", flops_per_token=None)
    add_sample(engine, at(12, 30), 3600, 0.5, instance="inst-b")
    return p1, p2


def row(**kw: Any) -> dict[str, Any]:
    base = dict(
        requests_succeeded=0,
        requests_failed=0,
        prompt_tokens=0,
        cached_prompt_tokens=0,
        completion_tokens=0,
        list_cost_usd=0.0,
        cache_savings_usd=0.0,
        list_usd_per_mtok_prompt=None,
        list_usd_per_mtok_completion=None,
        gpu_usd_per_mtok_prompt=None,
        gpu_usd_per_mtok_completion=None,
    )
    return {**base, **kw}


# The hour's figures, repeated on each of its rows.
H11 = dict(covered_s=1800.0, mean_utilization=0.25, mfu=0.0)  # 450 / 1800 busy; no tokens
# busy 0.5x900 + 0.75x900 + 0.25x900 + 0.5x900 = 1800 s of 3600 s. Computed tokens
# (prompt - cached + completion): alice 2800 + 1200 = 4000, no key 1000, bob 3000; 8000 in all.
# MFU = 1e9 FLOPs x 8000 tokens / (3600 s x 1e12 FLOP/s x 2 GPUs) = 1 / 900.
H12 = dict(covered_s=3600.0, mean_utilization=0.5, mfu=1 / 900)
H13 = dict(covered_s=1800.0, mean_utilization=0.5, mfu=None)  # model m2 has no FLOPs/token

# inst-a after the first run at 14:10. GPU cost of an hour = 2 USD x 2 GPUs x covered / 3600;
# its busy share goes to the request rows by computed tokens, the rest to "(idle)".
EXPECTED_A = {
    # 11:00: 2 x 2 x 1800 / 3600 = 2.0 USD; no request computed a token, so all of it is idle.
    ("2026-03-01T11", "m", IDLE_KEY): row(gpu_cost_usd=2.0, **H11),
    # 12:00: 4.0 USD, busy half 2.0 -> alice 2.0 x 4000/8000 = 1.0, no key 0.25, bob 0.75:
    # 250 USD per million computed tokens for everyone (2.0 / 8000 x 1e6).
    ("2026-03-01T12", "m", "alice"): row(
        requests_succeeded=2,
        prompt_tokens=3000,
        cached_prompt_tokens=200,
        completion_tokens=1200,
        list_cost_usd=0.0093,  # 0.0013 + 0.008 (two prices in one hour)
        cache_savings_usd=0.0001,  # r1's 200 cached at P1: 200 x (1.0 - 0.5) / 1e6
        # prompt side: r1 (800 x 1.0 + 200 x 0.5) + r2 2000 x 2.0 = 4900 micro-USD / 3000 tokens
        list_usd_per_mtok_prompt=4900 / 3000,
        # completion side: r1 200 x 2.0 + r2 1000 x 4.0 = 4400 micro-USD / 1200 tokens
        list_usd_per_mtok_completion=4400 / 1200,
        gpu_cost_usd=1.0,
        gpu_usd_per_mtok_prompt=250.0,
        gpu_usd_per_mtok_completion=250.0,
        **H12,
    ),
    ("2026-03-01T12", "m", ""): row(
        requests_failed=1,
        prompt_tokens=1200,
        cached_prompt_tokens=200,
        list_cost_usd=0.0022,
        cache_savings_usd=0.0002,  # r3's 200 cached at P2: 200 x (2.0 - 1.0) / 1e6
        list_usd_per_mtok_prompt=2200 / 1200,  # (1000 x 2.0 + 200 x 1.0) / 1200
        gpu_cost_usd=0.25,
        gpu_usd_per_mtok_prompt=250.0,
        gpu_usd_per_mtok_completion=250.0,
        **H12,
    ),
    ("2026-03-01T12", "m", "bob"): row(
        requests_failed=1,
        prompt_tokens=2000,
        completion_tokens=1000,
        list_cost_usd=0.004,
        list_usd_per_mtok_prompt=1.0,
        list_usd_per_mtok_completion=2.0,
        gpu_cost_usd=0.75,
        gpu_usd_per_mtok_prompt=250.0,
        gpu_usd_per_mtok_completion=250.0,
        **H12,
    ),
    ("2026-03-01T12", "m", IDLE_KEY): row(gpu_cost_usd=2.0, **H12),
    # 13:00: 2 x 2 x 1800 / 3600 = 2.0 USD, busy 900 of 1800 s -> 1.0 to alice's 200 tokens
    # (5000 USD per million), 1.0 idle (named after the hour's latest sample's model, m2).
    ("2026-03-01T13", "m2", "alice"): row(
        requests_succeeded=1,
        prompt_tokens=100,
        completion_tokens=100,
        list_cost_usd=0.0006,
        list_usd_per_mtok_prompt=2.0,
        list_usd_per_mtok_completion=4.0,
        gpu_cost_usd=1.0,
        gpu_usd_per_mtok_prompt=5000.0,
        gpu_usd_per_mtok_completion=5000.0,
        **H13,
    ),
    ("2026-03-01T13", "m2", IDLE_KEY): row(gpu_cost_usd=1.0, **H13),
}
# inst-b, 12:00: 4.0 USD, busy half 2.0 all to alice's 1000 tokens (2000 USD per million).
# MFU = 1e9 x 1000 / (3600 x 1e12 x 2) = 1 / 7200.
H12_B = dict(covered_s=3600.0, mean_utilization=0.5, mfu=1 / 7200)
EXPECTED_B = {
    ("2026-03-01T12", "m", "alice"): row(
        requests_succeeded=1,
        prompt_tokens=1000,
        list_cost_usd=0.002,
        list_usd_per_mtok_prompt=2.0,
        gpu_cost_usd=2.0,
        gpu_usd_per_mtok_prompt=2000.0,
        gpu_usd_per_mtok_completion=2000.0,
        **H12_B,
    ),
    ("2026-03-01T12", "m", IDLE_KEY): row(gpu_cost_usd=2.0, **H12_B),
}


def rollups(engine: Engine, instance: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(select(ROLLUPS).where(ROLLUPS.c.instance_id == instance)).mappings()
        return {
            (r["hour_bucket"], r["model"], r["api_key_name"]): {
                k: v
                for k, v in r.items()
                if k not in ("id", "hour_bucket", "model", "api_key_name")
            }
            for r in rows
        }


def same(actual: Any, expected: Any) -> bool:
    """Exact for ints, strings and None; floats to 12 significant digits (divisions)."""
    if isinstance(expected, float) and not isinstance(actual, bool):
        return isinstance(actual, float | int) and actual == pytest.approx(
            expected, rel=1e-12, abs=1e-15
        )
    return actual == expected and type(actual) is type(expected)


def assert_figures(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    for key, want in expected.items():
        got = actual[key]
        wrong = {f: (got.get(f), v) for f, v in want.items() if not same(got.get(f), v)}
        assert not wrong, f"{key}: (actual, expected) {wrong}"


# -- samples ------------------------------------------------------------------------------------


def test_write_sample_and_energy_intervals(db_engine: Engine) -> None:
    def gpu0(energy: float | None, **kw: Any) -> GpuReading:
        return GpuReading(0, "H100", energy_j=energy, **kw)

    a = add_sample(db_engine, at(12, 15), 900, 0.5, gpus=(gpu0(1000.0, power_w=math.nan),))
    b = add_sample(db_engine, at(12, 30), 900, 1.2, gpus=(gpu0(1900.0), GpuReading(1)))
    c = add_sample(db_engine, at(13, 30), 900, 0.5, gpus=(gpu0(5000.0),))  # after a gap
    d = add_sample(db_engine, at(13, 45), 900, -0.1, gpus=(gpu0(10.0),))  # counter reset
    e = add_sample(db_engine, at(14, 0), 900, 0.5, gpus=(gpu0(70.0),))
    with db_engine.connect() as conn:
        samples = {r.id: r for r in conn.execute(select(SAMPLES))}
        gpus = {(r.sample_id, r.gpu_index): r for r in conn.execute(select(GPUS))}
    assert samples[a].hour_bucket == "2026-03-01T12" and samples[a].time == at(12, 15)
    assert samples[a].time.tzinfo is not None
    assert [samples[i].busy_fraction for i in (a, b, d)] == [0.5, 1.0, 0.0]  # clamped
    assert samples[e].hour_bucket == "2026-03-01T14"
    assert gpus[(a, 0)].power_w is None  # not finite: not a reading
    assert [gpus[(i, 0)].energy_j for i in (a, b, c, d, e)] == [1000, 1900, 5000, 10, 70]
    assert [gpus[(i, 0)].interval_energy_j for i in (a, b, c, d, e)] == [
        None,  # first sample: nothing to subtract
        900.0,
        None,  # previous sample is an hour back: not contiguous
        None,  # the counter went back (driver reload)
        60.0,
    ]
    assert gpus[(b, 1)].name is None and gpus[(b, 1)].utilization_pct is None
    with pytest.raises(ValueError, match="time"):
        add_sample(db_engine, datetime(2026, 3, 1, 12), 900, 0.5)
    with pytest.raises(ValueError, match="interval_s"):
        add_sample(db_engine, at(15), 0, 0.5)


# -- the cost rollup ----------------------------------------------------------------------------


def test_rollup_figures_idempotence_and_resume(db_engine: Engine) -> None:
    seed(db_engine)
    first = run_rollup(db_engine, "inst-a", now=NOW, **GPU)
    # First run: from the instance's oldest data (11:00) up to the hour of now (14:00).
    assert (first.first_hour, first.hours_recomputed, first.rows_written) == (
        "2026-03-01T11",
        4,
        7,
    )
    # now - 1 h is 13:10, but r5 (arrived 12:55) is still running: the watermark stays at 12:00.
    assert first.watermark == at(12) == get_watermark(db_engine, ROLLUP_JOB, "inst-a")
    after_first = rollups(db_engine, "inst-a")
    assert_figures(after_first, EXPECTED_A)
    assert all(r["day_bucket"] == "2026-03-01" for r in after_first.values())
    assert all(r["updated_at"] == NOW for r in after_first.values())
    # Every (hour, instance)'s rows add up to its GPU cost.
    for hour, cost in (("2026-03-01T11", 2.0), ("2026-03-01T12", 4.0), ("2026-03-01T13", 2.0)):
        assert math.fsum(r["gpu_cost_usd"] for k, r in after_first.items() if k[0] == hour) == cost
    assert rollups(db_engine, "inst-b") == {}  # another instance's data is not ours to roll up

    # Running again changes nothing (same now: not even updated_at).
    again = run_rollup(db_engine, "inst-a", now=NOW, **GPU)
    assert (again.first_hour, again.hours_recomputed, again.rows_written) == (
        "2026-03-01T12",
        3,
        6,
    )
    assert rollups(db_engine, "inst-a") == after_first

    # r5 finishes: success, 1000 prompt tokens at P2 = 0.002 USD. A restart (a new call) resumes
    # from the 12:00 watermark, so the 12:00 hour is recomputed with it; 11:00 is not touched.
    with db_engine.begin() as conn:
        p2 = conn.execute(text("SELECT max(id) FROM prices")).scalar()
        conn.execute(
            update(REQUESTS)
            .where(REQUESTS.c.id == "r5")
            .values(status="success", price_id=p2, cost_usd=0.002)
        )
    later = NOW + timedelta(minutes=20)
    resumed = run_rollup(db_engine, "inst-a", now=later, **GPU)
    assert (resumed.first_hour, resumed.hours_recomputed) == ("2026-03-01T12", 3)
    assert resumed.watermark == at(13)  # nothing running now: the hour of now - 1 h
    after = rollups(db_engine, "inst-a")
    assert after[("2026-03-01T11", "m", IDLE_KEY)] == after_first[("2026-03-01T11", "m", IDLE_KEY)]
    # 12:00 computed tokens: alice 4000, no key 1000, bob 3000 + 1000 = 9000 in all; the busy
    # 2.0 USD now splits 4000/9000, 1000/9000, 4000/9000 (2e6 / 9000 USD per million each).
    expected = dict(EXPECTED_A)
    rate = 2e6 / 9000
    for key, gpu_cost in (("alice", 8 / 9), ("", 2 / 9), ("bob", 8 / 9)):
        expected[("2026-03-01T12", "m", key)] = {
            **EXPECTED_A[("2026-03-01T12", "m", key)],
            "gpu_cost_usd": gpu_cost,
            "gpu_usd_per_mtok_prompt": rate,
            "gpu_usd_per_mtok_completion": rate,
            "mfu": 1e9 * 9000 / (3600 * 1e12 * 2),
        }
    expected[("2026-03-01T12", "m", IDLE_KEY)] = {
        **EXPECTED_A[("2026-03-01T12", "m", IDLE_KEY)],
        "mfu": 1e9 * 9000 / (3600 * 1e12 * 2),
    }
    expected[("2026-03-01T12", "m", "bob")] = {
        **expected[("2026-03-01T12", "m", "bob")],
        "requests_succeeded": 1,
        "prompt_tokens": 3000,
        "list_cost_usd": 0.006,  # 0.004 + 0.002
        "list_usd_per_mtok_prompt": 4000 / 3000,  # r4 2000 x 1.0 + r5 1000 x 2.0, micro-USD
    }
    assert_figures(after, expected)
    assert after[("2026-03-01T12", "m", "bob")]["updated_at"] == later

    # From now on only the hours from the watermark (13:00) are recomputed.
    tail = run_rollup(db_engine, "inst-a", now=later, **GPU)
    assert (tail.first_hour, tail.hours_recomputed, tail.watermark) == ("2026-03-01T13", 2, at(13))
    assert rollups(db_engine, "inst-a") == after


def test_rollup_two_instances_one_database(db_engine: Engine) -> None:
    seed(db_engine)
    run_rollup(db_engine, "inst-a", now=NOW, **GPU)
    a = rollups(db_engine, "inst-a")
    b_result = run_rollup(db_engine, "inst-b", now=NOW, **GPU)
    assert b_result.first_hour == "2026-03-01T12" and b_result.watermark == at(13)
    assert_figures(rollups(db_engine, "inst-b"), EXPECTED_B)
    assert rollups(db_engine, "inst-a") == a  # inst-b's run did not touch inst-a's rows
    run_rollup(db_engine, "inst-a", now=NOW, **GPU)
    assert_figures(rollups(db_engine, "inst-b"), EXPECTED_B)  # nor the other way round

    # The report sums the instances, each once: a (model, key) row of both instances is the sum.
    report = cost_report(db_engine, since=DAY, until=DAY + timedelta(days=1), group_by="hour,model,api_key")  # fmt: skip
    by_key = {(r["hour"], r["model"], r["api_key"]): r for r in report.rows}
    alice = by_key[("2026-03-01T12", "m", "alice")]
    assert (alice["requests_succeeded"], alice["prompt_tokens"]) == (3, 4000)
    assert alice["list_cost_usd"] == pytest.approx(0.0093 + 0.002, rel=1e-12)
    assert alice["gpu_cost_usd"] == pytest.approx(1.0 + 2.0, rel=1e-12)
    # GPU $/M over both instances: 3.0 USD / (4000 + 1000) tokens
    assert alice["gpu_usd_per_mtok"] == pytest.approx(3.0e6 / 5000, rel=1e-12)
    # List $/M prompt: (4900 + 2000) micro-USD / 4000 tokens
    assert alice["list_usd_per_mtok_prompt"] == pytest.approx(6900 / 4000, rel=1e-12)
    # utilization and MFU: covered-weighted over the (hour, instance) pairs, each counted once
    assert alice["mean_utilization"] == pytest.approx(0.5, rel=1e-12)
    assert alice["mfu"] == pytest.approx((1 / 900 + 1 / 7200) / 2, rel=1e-12)

    t = report.totals
    # all of inst-a (EXPECTED_A) plus all of inst-b (EXPECTED_B)
    assert t["requests_succeeded"] == 3 + 1 and t["requests_failed"] == 2
    assert t["prompt_tokens"] == 3000 + 1200 + 2000 + 100 + 1000
    assert t["cached_prompt_tokens"] == 400 and t["completion_tokens"] == 1200 + 1000 + 100
    assert t["cached_share"] == pytest.approx(400 / 7300, rel=1e-12)
    assert t["cache_savings_usd"] == pytest.approx(0.0001 + 0.0002, rel=1e-12)
    assert alice["cached_share"] == pytest.approx(200 / 4000, rel=1e-12)
    assert alice["cache_savings_usd"] == pytest.approx(0.0001, rel=1e-12)
    assert t["list_cost_usd"] == pytest.approx(0.0093 + 0.0022 + 0.004 + 0.0006 + 0.002, rel=1e-12)
    assert t["gpu_cost_usd"] == pytest.approx(2.0 + 4.0 + 2.0 + 4.0, rel=1e-12)
    # all-in GPU rate: every GPU dollar, idle included, over all computed tokens
    computed = 8000 + 200 + 1000
    assert t["gpu_usd_per_mtok"] == pytest.approx(12.0e6 / computed, rel=1e-12)
    assert t["list_usd_per_mtok_prompt"] == pytest.approx(
        (4900 + 2200 + 2000 + 200 + 2000) / 7300, rel=1e-12
    )
    assert t["list_usd_per_mtok_completion"] == pytest.approx((4400 + 2000 + 400) / 2300, rel=1e-12)
    # busy seconds / covered seconds over the four (hour, instance) pairs
    busy = 450 + 1800 + 900 + 1800
    assert t["mean_utilization"] == pytest.approx(busy / (1800 + 3600 + 1800 + 3600), rel=1e-12)
    # MFU known for 11:00 (0), 12:00 a (1/900), 12:00 b (1/7200); not 13:00 (no FLOPs/token)
    assert t["mfu"] == pytest.approx((1800 * 0 + 3600 / 900 + 3600 / 7200) / 9000, rel=1e-12)
    assert t == {k: t[k] for k in report.columns if k not in report.group_by}


def test_rollup_edge_cases(db_engine: Engine) -> None:
    # Nothing at all: no rows, the watermark still moves to the hour of now - 1 h.
    r = run_rollup(db_engine, "lonely", now=NOW, **GPU)
    assert (r.hours_recomputed, r.rows_written, r.watermark) == (0, 0, at(13))
    # Requests without samples: no GPU cost (nothing covered), no MFU, no utilization; a
    # request without a price in force has no list cost and counts as free.
    add_request(db_engine, "x1", at(13, 5), instance="nos", prompt=10, completion=10)
    add_request(db_engine, "x2", at(13, 6), instance="nos", status="interrupted")
    # No GPUs, no peak FLOPs: zero cost, MFU unknown; never a division by zero.
    add_sample(db_engine, at(13, 7), 60, 0.5, instance="nos")
    run_rollup(db_engine, "nos", now=NOW, gpu_hourly_usd=2.0, num_gpus=0, peak_flops=0.0)
    got = rollups(db_engine, "nos")
    assert_figures(
        got,
        {
            ("2026-03-01T13", "m", "alice"): row(
                requests_succeeded=1,
                requests_failed=1,
                prompt_tokens=10,
                completion_tokens=10,
                list_usd_per_mtok_prompt=0.0,
                list_usd_per_mtok_completion=0.0,
                gpu_cost_usd=0.0,
                gpu_usd_per_mtok_prompt=0.0,
                gpu_usd_per_mtok_completion=0.0,
                covered_s=60.0,
                mean_utilization=0.5,
                mfu=None,
            ),
            ("2026-03-01T13", "m", IDLE_KEY): row(
                gpu_cost_usd=0.0, covered_s=60.0, mean_utilization=0.5, mfu=None
            ),
        },
    )
    with pytest.raises(ValueError, match="now"):
        run_rollup(db_engine, "nos", now=datetime(2026, 3, 1), **GPU)
    with pytest.raises(ValueError, match="num_gpus"):
        run_rollup(db_engine, "nos", now=NOW, gpu_hourly_usd=1.0, num_gpus=-1, peak_flops=0.0)


# -- pruning ------------------------------------------------------------------------------------


def test_prune_keeps_rollups_and_unrolled_rows(db_engine: Engine) -> None:
    seed(db_engine)
    with db_engine.begin() as conn:
        conn.execute(update(REQUESTS).where(REQUESTS.c.id == "r5").values(status="aborted"))
    add_sample(db_engine, at(12, 40), 900, 0.5, gpus=(GpuReading(0), GpuReading(1)))
    # inst-c never ran a rollup: plain age cut-off; its running request is never pruned.
    add_request(db_engine, "c1", at(10), instance="inst-c")
    add_request(db_engine, "c2", at(10), instance="inst-c", status="running")
    run_rollup(db_engine, "inst-a", now=NOW, **GPU)  # watermark 13:00
    before = rollups(db_engine, "inst-a")

    later = at(0, day=10)
    counts = prune(db_engine, now=later, sample_retention_days=7, request_retention_days=1)
    # inst-a: everything before its 13:00 watermark is older than the retention and rolled up;
    # 11:30 + 4 x 12:xx + 12:40 samples (2 GPU rows), r1-r5. inst-b has no watermark yet
    # (no rollup ran for it), so the plain cut-off applies: its sample and r7 go too. inst-c: c1.
    assert counts == {"utilization_samples": 7, "gpu_samples": 2, "requests": 7}
    with db_engine.connect() as conn:
        left = set(conn.execute(select(REQUESTS.c.id)).scalars())
        sample_hours = sorted(conn.execute(select(SAMPLES.c.hour_bucket)).scalars())
        assert conn.execute(select(func.count()).select_from(GPUS)).scalar() == 0
    assert left == {"r6", "c2"}  # r6 arrived after inst-a's watermark: not rolled up for good
    assert sample_hours == ["2026-03-01T13", "2026-03-01T13"]
    assert rollups(db_engine, "inst-a") == before  # rollups are kept
    # A rollup after pruning recomputes from the watermark only: the pruned hours keep their
    # figures.
    run_rollup(db_engine, "inst-a", now=NOW, **GPU)
    assert rollups(db_engine, "inst-a") == before
    assert prune(db_engine, now=later, sample_retention_days=7, request_retention_days=1) == {
        "utilization_samples": 0,
        "gpu_samples": 0,
        "requests": 0,
    }


# -- migrations and views -----------------------------------------------------------------------


def test_migration_0003_with_views(db_url: str) -> None:
    upgrade(db_url, "0003")
    assert current(db_url) == "0003"
    eng = make_engine(db_url)
    tables = {"utilization_samples", "gpu_samples", "cost_rollups", "job_watermarks"}
    views = {"daily_cost_by_model_key", "hourly_utilization"}
    try:
        assert tables <= set(inspect(eng).get_table_names())
        assert views <= set(inspect(eng).get_view_names())
        downgrade(db_url, "0002")
        assert current(db_url) == "0002"
        insp = inspect(eng)
        assert not tables & set(insp.get_table_names())
        assert not views & set(insp.get_view_names())
        assert {"requests", "prices", "config_changes"} <= set(insp.get_table_names())
    finally:
        eng.dispose()
    upgrade(db_url)
    assert current(db_url) == head()
    check(db_url)  # the views are not in the metadata and are no drift


def test_migration_0010_view_columns(db_url: str) -> None:
    def columns(view: str) -> set[str]:
        return {c["name"] for c in inspect(eng).get_columns(view)}

    upgrade(db_url)
    eng = make_engine(db_url)
    try:
        assert "cache_savings_usd" in columns("daily_cost_by_model_key")
        assert "mean_spec_acceptance_rate" in columns("hourly_utilization")
        downgrade(db_url, "0009")
        assert "cache_savings_usd" not in columns("daily_cost_by_model_key")
        assert "mean_queue_length" not in columns("hourly_utilization")
        assert "gpu_cost_usd" in columns("daily_cost_by_model_key")  # 0003's view is back
    finally:
        eng.dispose()
    upgrade(db_url)
    check(db_url)


def test_views_match_reports(db_engine: Engine) -> None:
    seed(db_engine)
    add_sample(db_engine, at(12, 40), 900, 0.5, instance="inst-b", kv_usage=0.5, batch_fill_seqs=0.25, prefill_tokens_per_s=100.0, decode_tokens_per_s=10.0, queue_length=3, num_running=5, prefix_cache_hit_rate=0.8, spec_acceptance_rate=0.6)  # fmt: skip
    run_rollup(db_engine, "inst-a", now=NOW, **GPU)
    run_rollup(db_engine, "inst-b", now=NOW, **GPU)
    since, until = DAY, DAY + timedelta(days=1)
    with db_engine.connect() as conn:
        daily = conn.execute(text("SELECT * FROM daily_cost_by_model_key")).mappings().all()
        hourly = conn.execute(text("SELECT * FROM hourly_utilization")).mappings().all()

    report = cost_report(db_engine, since=since, until=until, group_by=["day", "model", "api_key"])
    # m/alice (both instances), m/"", m/bob, m/(idle) (3 hours), m2/alice, m2/(idle)
    assert len(daily) == len(report.rows) == 6
    by_key = {(r["day"], r["model"], r["api_key"]): r for r in report.rows}
    summed = (
        "requests_succeeded",
        "requests_failed",
        "prompt_tokens",
        "cached_prompt_tokens",
        "completion_tokens",
        "list_cost_usd",
        "gpu_cost_usd",
        "cache_savings_usd",
    )
    assert math.fsum(float(v["cache_savings_usd"]) for v in daily) > 0  # r1, r3 hit the cache
    for v in daily:
        r = by_key[(v["day_bucket"], v["model"], v["api_key_name"])]
        for name in summed:
            assert float(v[name]) == pytest.approx(r[name], rel=1e-12), name
    for name in summed:
        assert math.fsum(float(v[name]) for v in daily) == pytest.approx(
            report.totals[name], rel=1e-12
        )

    util = utilization_report(db_engine, since=since, until=until, group_by="hour,instance")
    assert len(hourly) == len(util.rows) == 4
    by_hour = {(r["hour"], r["instance"]): r for r in util.rows}
    for v in hourly:
        r = by_hour[(v["hour_bucket"], v["instance_id"])]
        assert v["day_bucket"] == v["hour_bucket"][:10]
        assert (v["samples"], float(v["covered_s"])) == (r["samples"], r["covered_s"])
        for name in (
            "mean_busy_fraction",
            "mean_kv_usage",
            "mean_batch_fill_seqs",
            "mean_batch_fill_tokens",
            "mean_prefill_tokens_per_s",
            "mean_decode_tokens_per_s",
            "mean_queue_length",
            "mean_num_running",
            "mean_prefix_cache_hit_rate",
            "mean_spec_acceptance_rate",
        ):
            if r[name] is None:
                assert v[name] is None, name
            else:
                assert float(v[name]) == pytest.approx(r[name], rel=1e-12), name
    # inst-b at 12:00: busy (0.5 x 3600 + 0.5 x 900) / 4500; kv only on the 900 s sample
    b12 = by_hour[("2026-03-01T12", "inst-b")]
    assert (b12["mean_busy_fraction"], b12["mean_kv_usage"], b12["samples"]) == (0.5, 0.5, 2)
    # Only the 12:40 sample carries the readings 0010 added to the view.
    (v12,) = (
        v for v in hourly if (v["hour_bucket"], v["instance_id"]) == ("2026-03-01T12", "inst-b")
    )
    assert (v12["mean_prefix_cache_hit_rate"], v12["mean_num_running"]) == (0.8, 5)
    assert util.totals["samples"] == sum(v["samples"] for v in hourly) == 9


# -- reports ------------------------------------------------------------------------------------


def test_utilization_report_figures(db_engine: Engine) -> None:
    add_sample(
        db_engine,
        at(12, 15),
        900,
        0.5,
        kv_usage=0.25,
        batch_fill_seqs=0.5,
        batch_fill_tokens=0.25,
        prefill_tokens_per_s=100.0,
        decode_tokens_per_s=50.0,
        queue_length=2,
        num_running=4,
        gpus=(
            GpuReading(0, "H100", 50.0, 10, 80, 100.0, 60.0, 1000.0),
            GpuReading(1, "H100", 100.0, None, None, 300.0, 70.0, None),
        ),
    )
    add_sample(
        db_engine,
        at(12, 30),
        900,
        0.75,
        kv_usage=0.75,
        prefill_tokens_per_s=300.0,
        decode_tokens_per_s=150.0,
        queue_length=0,
        num_running=2,
        gpus=(
            GpuReading(0, "H100", 70.0, 10, 80, 200.0, 65.0, 1900.0),
            GpuReading(1, "H100", None, None, None, None, 80.0, None),
        ),
    )
    add_sample(db_engine, at(13, 30), 3600, 0.5, instance="inst-b")
    rep = utilization_report(db_engine, since=at(12, 20), until=at(13, 1), group_by=["day"])
    # whole hours overlapping [12:20, 13:01): 12:00 to 14:00
    assert (rep.since, rep.until) == (at(12).isoformat(), at(14).isoformat())
    assert rep.columns[0] == "day" and rep.group_by == ["day"] and not rep.empty
    (day,) = rep.rows
    assert day["day"] == "2026-03-01"
    assert day["samples"] == 3 and day["covered_s"] == 5400.0
    # time-weighted: busy (450 + 675 + 1800) / 5400; kv over the 1800 s that report it
    assert day["mean_busy_fraction"] == pytest.approx(2925 / 5400, rel=1e-12)
    assert day["mean_kv_usage"] == 0.5  # (225 + 675) / 1800
    assert day["mean_batch_fill_seqs"] == 0.5 and day["mean_batch_fill_tokens"] == 0.25
    assert day["mean_prefill_tokens_per_s"] == 200.0  # (90000 + 270000) / 1800
    assert day["mean_decode_tokens_per_s"] == 100.0
    assert day["mean_queue_length"] == 1.0 and day["mean_num_running"] == 3.0
    # per GPU, weighted by the sample interval: (50 + 100 + 70) / 3 and (100 + 300 + 200) / 3
    assert day["mean_gpu_utilization_pct"] == pytest.approx(220 / 3, rel=1e-12)
    assert day["mean_gpu_power_w"] == 200.0
    assert day["max_gpu_temperature_c"] == 80.0
    assert day["gpu_energy_j"] == 900.0  # 1900 - 1000 on GPU 0; GPU 1 has no counter
    assert rep.totals == {k: v for k, v in day.items() if k != "day"}

    by_inst = utilization_report(db_engine, since=DAY, until=at(23), group_by="instance")
    assert [r["instance"] for r in by_inst.rows] == ["inst-a", "inst-b"]
    assert by_inst.rows[1]["mean_gpu_power_w"] is None and by_inst.rows[1]["gpu_energy_j"] is None
    none = utilization_report(db_engine, since=at(15), until=at(16), group_by="hour")
    assert none.empty and none.rows == [] and none.totals["samples"] is None


def test_cost_report_grouping_and_window(db_engine: Engine) -> None:
    seed(db_engine)
    run_rollup(db_engine, "inst-a", now=NOW, **GPU)
    run_rollup(db_engine, "inst-b", now=NOW, **GPU)
    by_key = cost_report(db_engine, since=DAY, until=DAY + timedelta(days=1), group_by=["api_key"])
    assert by_key.columns[:2] == ["api_key", "requests_succeeded"]
    assert [r["api_key"] for r in by_key.rows] == ["", IDLE_KEY, "alice", "bob"]
    idle = by_key.rows[1]
    # idle: 2.0 (11:00) + 2.0 (12:00 a) + 1.0 (13:00 a) + 2.0 (12:00 b); no tokens, no rate
    assert idle["gpu_cost_usd"] == 7.0 and idle["gpu_usd_per_mtok"] is None
    by_model = cost_report(db_engine, since=DAY, until=DAY + timedelta(days=1), group_by="model")
    m2 = by_model.rows[1]
    # m2: all-in rate, the idle hour line included: (1.0 + 1.0) USD / 200 tokens
    assert m2["model"] == "m2" and m2["gpu_usd_per_mtok"] == pytest.approx(1e4, rel=1e-12)
    # One hour only (12:00-13:00): 13:00 rows are out.
    hour = cost_report(db_engine, since=at(12, 30), until=at(13), group_by=[])
    assert hour.rows == [hour.totals] and hour.totals["gpu_cost_usd"] == 8.0
    assert (hour.since, hour.until) == (at(12).isoformat(), at(13).isoformat())
    empty = cost_report(db_engine, since=at(20), until=at(21), group_by="day")
    assert empty.empty and empty.rows == [] and set(empty.totals) == set(empty.columns[1:])
    d = empty.to_dict()
    assert d["empty"] is True and d["columns"] == empty.columns

    with pytest.raises(ValueError, match=r"^group_by: unknown column 'instance'"):
        cost_report(db_engine, since=DAY, until=NOW, group_by="instance")
    with pytest.raises(ValueError, match=r"^group_by: day and hour"):
        cost_report(db_engine, since=DAY, until=NOW, group_by="day,hour")
    with pytest.raises(ValueError, match=r"^since: must be before until"):
        cost_report(db_engine, since=NOW, until=DAY, group_by="day")
    with pytest.raises(ValueError, match=r"^since: must be a timezone-aware"):
        cost_report(db_engine, since=datetime(2026, 3, 1), until=NOW, group_by="day")


def test_parse_time_and_group_by() -> None:
    assert parse_time("since", "24h", now=NOW) == NOW - timedelta(hours=24)
    assert parse_time("since", "7d", now=NOW) == NOW - timedelta(days=7)
    assert parse_time("since", "90m", now=NOW) == NOW - timedelta(minutes=90)
    assert parse_time("since", "2026-03-01") == DAY
    assert parse_time("since", "2026-03-01T12:00+01:00") == at(11)
    with pytest.raises(ValueError, match=r"^until: expected a duration"):
        parse_time("until", "yesterday")
    assert parse_group_by("api_key, model,day", ("day", "hour", "model", "api_key")) == [
        "day",
        "model",
        "api_key",
    ]
