"""The utilization report: the engine samples and GPU readings, time-weighted, grouped."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, case, func, select

from controlplane.accounting.reports.base import (
    _GPU_MEANS,
    _SAMPLE_MEANS,
    GPUS,
    SAMPLES,
    UTILIZATION_GROUPS,
    UTILIZATION_METRICS,
    Report,
    window,
)
from controlplane.accounting.rollup import ratio
from controlplane.common import parse_group_by

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
            out[f"mean_{name}"] = ratio(acc[f"{name}_num"], acc[f"{name}_den"])
        for name in _GPU_MEANS:
            out[f"mean_gpu_{name}"] = ratio(acc[f"gpu_{name}_num"], acc[f"gpu_{name}_den"])
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
