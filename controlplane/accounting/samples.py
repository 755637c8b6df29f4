"""Utilization samples: what one instance's engine (and each GPU) did over an interval, as the
sampling job writes them, with the GPU energy counter differenced against the previous sample.

`write_sample` stores one `UtilizationSample` (what one instance's engine did over the
`interval_s` seconds ending at `time`) with one `GpuReading` per GPU. A sample belongs wholly to
the UTC hour of its `time`. `GpuReading.energy_j` is the GPU's cumulative energy counter (NVML:
J since the driver loaded) and is stored as read; `gpu_samples.interval_energy_j` is derived at
write time: this reading minus the same GPU's reading in the instance's previous sample, when
that sample is contiguous (at most interval_s + max(1 s, interval_s / 2) older) and the counter
did not go back (driver reload); otherwise None. Energy reports sum `interval_energy_j`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import (
    Connection,
    Engine,
    insert,
    select,
)

from controlplane.accounting.rollup import GPUS, SAMPLES, aware, finite
from controlplane.errors import FieldError
from controlplane.store.models import (
    time_buckets,
)

# -- samples ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UtilizationSample:
    """What one instance's engine did over the `interval_s` seconds ending at `time`."""

    time: datetime  # aware; end of the interval
    interval_s: float
    model: str
    busy_fraction: float  # time inside forward passes / wall time, 0-1
    batch_fill_seqs: float | None = None  # mean running sequences / max_num_seqs, 0-1
    batch_fill_tokens: float | None = None  # mean batch tokens / max_num_batched_tokens, 0-1
    kv_usage: float | None = None  # KV cache in use, 0-1
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    queue_length: int | None = None
    num_running: int | None = None
    flops_per_token: float | None = None  # model FLOPs per computed token
    prefix_cache_hit_rate: float | None = None  # prompt tokens found cached / looked up
    spec_acceptance_rate: float | None = None  # accepted / proposed draft tokens


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU's readings for a sample; None where the GPU or driver does not report one."""

    gpu_index: int
    name: str | None = None
    utilization_pct: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    energy_j: float | None = None  # cumulative counter (NVML: J since the driver loaded)


def write_sample(
    engine: Engine, instance_id: str, sample: UtilizationSample, gpus: Sequence[GpuReading]
) -> int:
    """Store one sample and its GPU readings in one transaction; returns the sample's id.

    Non-finite optional readings are stored as None; busy_fraction is clamped to [0, 1] (timer
    jitter can overshoot a little).
    """
    at = aware("time", sample.time)
    interval = finite(sample.interval_s)
    if interval is None or interval <= 0:
        raise FieldError("interval_s", f"must be a positive number, got {sample.interval_s!r}")
    busy = finite(sample.busy_fraction)
    if busy is None:
        raise FieldError("busy_fraction", f"must be a number, got {sample.busy_fraction!r}")
    row = {
        "instance_id": instance_id,
        "time": at,
        "hour_bucket": time_buckets(at)[0],
        "interval_s": interval,
        "model": sample.model,
        "busy_fraction": min(1.0, max(0.0, busy)),
        "queue_length": sample.queue_length,
        "num_running": sample.num_running,
    }
    for name in (
        "batch_fill_seqs",
        "batch_fill_tokens",
        "kv_usage",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "flops_per_token",
        "prefix_cache_hit_rate",
        "spec_acceptance_rate",
    ):
        row[name] = finite(getattr(sample, name))
    with engine.begin() as conn:
        previous = _previous_energy(conn, instance_id, at, interval) if gpus else {}
        sample_id = conn.execute(insert(SAMPLES).values(**row)).inserted_primary_key[0]
        if gpus:
            gpu_rows = []
            for g in gpus:
                energy = finite(g.energy_j)
                before = previous.get(g.gpu_index)
                delta = None
                if energy is not None and before is not None and energy >= before:
                    delta = energy - before
                gpu_rows.append(
                    {
                        "sample_id": sample_id,
                        "gpu_index": g.gpu_index,
                        "name": g.name,
                        "utilization_pct": finite(g.utilization_pct),
                        "memory_used_bytes": g.memory_used_bytes,
                        "memory_total_bytes": g.memory_total_bytes,
                        "power_w": finite(g.power_w),
                        "temperature_c": finite(g.temperature_c),
                        "energy_j": energy,
                        "interval_energy_j": delta,
                    }
                )
            conn.execute(insert(GPUS), gpu_rows)
    return int(sample_id)


def _previous_energy(
    conn: Connection, instance_id: str, at: datetime, interval: float
) -> dict[int, float]:
    """gpu_index -> energy counter in this instance's latest sample before `at`, if that sample
    is contiguous with the new one (ends no more than interval + max(1 s, interval / 2) before
    `at`); empty otherwise."""
    prev = conn.execute(
        select(SAMPLES.c.id, SAMPLES.c.time)
        .where(SAMPLES.c.instance_id == instance_id, SAMPLES.c.time < at)
        .order_by(SAMPLES.c.time.desc())
        .limit(1)
    ).first()
    if prev is None or at - prev.time > timedelta(seconds=interval + max(1.0, interval / 2)):
        return {}
    return {
        r.gpu_index: float(r.energy_j)
        for r in conn.execute(
            select(GPUS.c.gpu_index, GPUS.c.energy_j).where(
                GPUS.c.sample_id == prev.id, GPUS.c.energy_j.is_not(None)
            )
        )
    }
