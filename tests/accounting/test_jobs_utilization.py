"""make_sample: one utilization sample as the difference of two engine snapshots (and its
prefix-cache and draft acceptance rates as stored, on SQLite and PostgreSQL)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine, select

from controlplane.accounting.samples import write_sample
from controlplane.accounting.utilization import UtilizationSample, make_sample
from controlplane.engine.types import StepStats
from controlplane.store import UtilizationSampleRow

SAMPLES = UtilizationSampleRow.__table__

LIMITS = dict(
    max_num_seqs=8, max_num_batched_tokens=100, queue_length=3, model="m", flops_per_token=2e6
)


@dataclass(frozen=True)
class Snap:
    step: int = 0
    time: float = 0.0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 200
    busy_s_total: float = 0.0
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    running_total: int = 0
    batched_tokens_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0


def test_busy_fills_rates_from_the_difference() -> None:
    prev = Snap(
        step=10,
        busy_s_total=4.0,
        prefill_tokens_total=1000,
        decode_tokens_total=500,
        running_total=40,
        batched_tokens_total=1500,
    )
    # 20 steps in 10 s: 6 s busy; 800 prefill + 200 decode tokens; 100 running-steps total.
    cur = Snap(
        step=30,
        num_running=5,
        kv_blocks_used=50,
        busy_s_total=10.0,
        prefill_tokens_total=1800,
        decode_tokens_total=700,
        running_total=140,
        batched_tokens_total=2500,
    )
    s = make_sample(prev, cur, start=100.0, end=110.0, **LIMITS)
    assert isinstance(s, UtilizationSample)
    assert s.time == datetime.fromtimestamp(110.0, UTC) and s.interval_s == 10.0
    assert s.busy_fraction == pytest.approx(0.6)
    assert s.batch_fill_seqs == pytest.approx(100 / (20 * 8))  # mean running 5 of 8
    assert s.batch_fill_tokens == pytest.approx(1000 / (20 * 100))  # mean 50 tokens of 100
    assert s.prefill_tokens_per_s == pytest.approx(80.0) and s.decode_tokens_per_s == pytest.approx(
        20.0
    )
    assert (s.kv_usage, s.num_running, s.queue_length, s.model, s.flops_per_token) == (
        0.25,
        5,
        3,
        "m",
        2e6,
    )


def test_consecutive_samples_add_up_exactly() -> None:
    a = Snap(step=0)
    b = Snap(step=7, busy_s_total=1.5, prefill_tokens_total=70)
    c = Snap(step=9, busy_s_total=2.0, prefill_tokens_total=90)
    s1 = make_sample(a, b, start=0.0, end=5.0, **LIMITS)
    s2 = make_sample(b, c, start=5.0, end=10.0, **LIMITS)
    whole = make_sample(a, c, start=0.0, end=10.0, **LIMITS)
    assert s1.busy_fraction * 5 + s2.busy_fraction * 5 == pytest.approx(whole.busy_fraction * 10)
    assert s1.prefill_tokens_per_s * 5 + s2.prefill_tokens_per_s * 5 == pytest.approx(90)


def test_cache_hit_and_acceptance_rates_are_interval_ratios() -> None:
    prev = Snap(
        step=5,
        prefix_cache_queries_total=1000,
        prefix_cache_hits_total=100,
        spec_decode_num_draft_tokens_total=30,
        spec_decode_num_accepted_tokens_total=10,
    )
    # In the interval: 600 prompt tokens looked up, 450 found; 40 drafts proposed, 30 accepted.
    cur = replace(
        prev,
        step=9,
        prefix_cache_queries_total=1600,
        prefix_cache_hits_total=550,
        spec_decode_num_draft_tokens_total=70,
        spec_decode_num_accepted_tokens_total=40,
    )
    s = make_sample(prev, cur, start=0.0, end=5.0, **LIMITS)
    assert s.prefix_cache_hit_rate == pytest.approx(450 / 600)
    assert s.spec_acceptance_rate == pytest.approx(30 / 40)
    # Nothing looked up or proposed in the interval: None, not 0 (which would read as misses).
    idle = make_sample(cur, replace(cur, step=12), start=5.0, end=10.0, **LIMITS)
    assert idle.prefix_cache_hit_rate is None and idle.spec_acceptance_rate is None


def test_idle_interval_has_no_fills_and_zero_rates() -> None:
    snap = Snap(step=5, num_running=0, kv_blocks_used=0, busy_s_total=3.0)
    s = make_sample(snap, snap, start=0.0, end=5.0, **LIMITS)
    assert s.busy_fraction == 0.0 and s.batch_fill_seqs is None and s.batch_fill_tokens is None
    assert s.prefill_tokens_per_s == 0.0 and s.decode_tokens_per_s == 0.0 and s.kv_usage == 0.0


def test_busy_is_clipped_and_bad_arguments() -> None:
    s = make_sample(Snap(), Snap(step=1, busy_s_total=7.0), start=0.0, end=5.0, **LIMITS)
    assert s.busy_fraction == 1.0  # a step attributed to this sample began before it
    assert (
        make_sample(Snap(), replace(Snap(), kv_blocks_total=0), start=0, end=1, **LIMITS).kv_usage
        is None
    )
    with pytest.raises(ValueError, match="empty interval"):
        make_sample(Snap(), Snap(), start=5.0, end=5.0, **LIMITS)
    with pytest.raises(ValueError, match="at least 1"):
        make_sample(Snap(), Snap(), start=0.0, end=1.0, **{**LIMITS, "max_num_seqs": 0})


def test_real_engine_snapshots(tiny_model_dir) -> None:
    from controlplane.engine import Engine, SamplingParams

    engine = Engine(model=str(tiny_model_dir), max_num_seqs=4)
    before = engine.stats()
    engine.add_request(
        list(range(1, 30)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.stats()
    s = make_sample(
        before, after, start=before.time, end=after.time, **{**LIMITS, "max_num_seqs": 4}
    )
    assert after.prefill_tokens_total - before.prefill_tokens_total == 29
    assert after.decode_tokens_total - before.decode_tokens_total == 4
    assert 0 < s.busy_fraction <= 1 and s.batch_fill_seqs is not None


def step_stats(**counters: int) -> StepStats:
    """A real engine snapshot (the engine's own type) with the given cumulative counters."""
    base = dict(
        step=0,
        time=0.0,
        num_running=0,
        num_waiting=0,
        num_swapped=0,
        kv_blocks_used=0,
        kv_blocks_total=64,
        num_prefill_tokens=0,
        num_decode_tokens=0,
        num_sampled_tokens=0,
        step_duration=0.0,
        num_preemptions=0,
        num_finished=0,
    )
    return StepStats(**{**base, **counters})  # type: ignore[arg-type]


def test_rates_of_step_stats_are_stored_and_null_without_queries(db_engine: Engine) -> None:
    t0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC).timestamp()
    a = step_stats(
        step=10,
        prefix_cache_queries_total=800,
        prefix_cache_hits_total=200,
        spec_decode_num_draft_tokens_total=90,
        spec_decode_num_accepted_tokens_total=33,
    )
    # Interval 1: 640 prompt tokens looked up, 240 found; 48 drafted, 18 accepted.
    b = replace(
        a,
        step=20,
        prefix_cache_queries_total=1440,
        prefix_cache_hits_total=440,
        spec_decode_num_draft_tokens_total=138,
        spec_decode_num_accepted_tokens_total=51,
    )
    # Interval 2: steps ran (decodes) but nothing was looked up or drafted.
    c = replace(b, step=30, decode_tokens_total=50)
    # Interval 3: a restarted engine (counters from 0): unknown, never negative or above 1.
    d = step_stats(step=3, prefix_cache_queries_total=1500, prefix_cache_hits_total=10)
    samples = [
        make_sample(prev, cur, start=t0 + 5 * i, end=t0 + 5 * (i + 1), **LIMITS)
        for i, (prev, cur) in enumerate(((a, b), (b, c), (c, d)))
    ]
    assert (samples[0].prefix_cache_hit_rate, samples[0].spec_acceptance_rate) == (
        240 / 640,
        18 / 48,
    )
    assert samples[2].spec_acceptance_rate is None and samples[2].prefix_cache_hit_rate is None

    for s in samples:
        write_sample(db_engine, "inst-a", s, ())
    with db_engine.connect() as conn:
        stored = conn.execute(
            select(SAMPLES.c.prefix_cache_hit_rate, SAMPLES.c.spec_acceptance_rate).order_by(
                SAMPLES.c.time
            )
        ).all()
    # 240 / 640 = 0.375 and 18 / 48 = 0.375 exactly (binary fractions): stored as computed.
    assert [tuple(r) for r in stored] == [(0.375, 0.375), (None, None), (None, None)]
