"""Retention: old utilization samples (with their GPU readings) and final request rows are
deleted, never what the cost rollup has not counted yet, never the rollups themselves."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Engine,
    and_,
    delete,
    not_,
    or_,
    select,
)

from controlplane.accounting.rollup import (
    _FINAL,
    GPUS,
    REQUESTS,
    ROLLUP_JOB,
    SAMPLES,
    WATERMARKS,
    aware,
)
from controlplane.errors import FieldError

# -- pruning ------------------------------------------------------------------------------------


def prune(
    engine: Engine,
    *,
    now: datetime,
    sample_retention_days: float,
    request_retention_days: float,
) -> dict[str, int]:
    """Delete utilization samples (with their GPU readings) and final request rows older than
    their retention; rows of an instance at or after its rollup watermark are kept (not yet
    rolled up). Cost rollups are never pruned. Returns rows deleted per table."""
    now = aware("now", now)
    for name, value in (
        ("sample_retention_days", sample_retention_days),
        ("request_retention_days", request_retention_days),
    ):
        if not value >= 0:
            raise FieldError(name, f"must be >= 0, got {value!r}")
    sample_cutoff = now - timedelta(days=sample_retention_days)
    request_cutoff = now - timedelta(days=request_retention_days)
    with engine.begin() as conn:
        marks = dict(
            conn.execute(
                select(WATERMARKS.c.instance_id, WATERMARKS.c.value).where(
                    WATERMARKS.c.job == ROLLUP_JOB
                )
            ).all()
        )

        def older(table: Any, time_col: Any, cutoff: datetime) -> Any:
            clauses = [
                and_(table.c.instance_id == inst, time_col < min(cutoff, mark))
                for inst, mark in marks.items()
            ]
            if marks:
                clauses.append(and_(not_(table.c.instance_id.in_(list(marks))), time_col < cutoff))
            else:
                clauses.append(time_col < cutoff)
            return or_(*clauses)

        old_samples = older(SAMPLES, SAMPLES.c.time, sample_cutoff)
        gpus = conn.execute(
            delete(GPUS).where(GPUS.c.sample_id.in_(select(SAMPLES.c.id).where(old_samples)))
        ).rowcount
        samples = conn.execute(delete(SAMPLES).where(old_samples)).rowcount
        requests = conn.execute(
            delete(REQUESTS).where(
                REQUESTS.c.status.in_(_FINAL),
                older(REQUESTS, REQUESTS.c.arrival_time, request_cutoff),
            )
        ).rowcount
    return {"utilization_samples": samples, "gpu_samples": gpus, "requests": requests}
