"""The BI views catch up with the columns added since 0003: daily_cost_by_model_key sums
cache_savings_usd (0005), hourly_utilization averages queue_length, num_running,
prefix_cache_hit_rate and spec_acceptance_rate (time-weighted, as its other means).

Views cannot gain columns in place on SQLite, so both are dropped and created again; the
downgrade creates them as 0003 did. The SQL stays portable (plain aggregates), as in 0003.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# What 0003 summed / averaged; this revision appends to both.
SUMS_0003 = (
    "requests_succeeded",
    "requests_failed",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "list_cost_usd",
    "gpu_cost_usd",
)
MEANS_0003 = (
    "busy_fraction",
    "kv_usage",
    "batch_fill_seqs",
    "batch_fill_tokens",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
)
SUMS = (*SUMS_0003, "cache_savings_usd")
MEANS = (
    *MEANS_0003,
    "queue_length",
    "num_running",
    "prefix_cache_hit_rate",
    "spec_acceptance_rate",
)


def daily_cost_by_model_key(sums: Sequence[str]) -> str:
    columns = ",\n    ".join(f"SUM({c}) AS {c}" for c in sums)
    return f"""
CREATE VIEW daily_cost_by_model_key AS
SELECT
    day_bucket,
    model,
    api_key_name,
    {columns}
FROM cost_rollups
GROUP BY day_bucket, model, api_key_name
"""


def hourly_utilization(means: Sequence[str]) -> str:
    # Time-weighted over the samples that carry the reading (NULL where none does).
    columns = ",\n    ".join(
        f"SUM(interval_s * {c}) / "
        f"NULLIF(SUM(CASE WHEN {c} IS NOT NULL THEN interval_s END), 0) AS mean_{c}"
        for c in means
    )
    return f"""
CREATE VIEW hourly_utilization AS
SELECT
    hour_bucket,
    substr(hour_bucket, 1, 10) AS day_bucket,
    instance_id,
    COUNT(*) AS samples,
    SUM(interval_s) AS covered_s,
    {columns}
FROM utilization_samples
GROUP BY hour_bucket, instance_id
"""


def _replace(sums: Sequence[str], means: Sequence[str]) -> None:
    op.execute("DROP VIEW IF EXISTS hourly_utilization")
    op.execute("DROP VIEW IF EXISTS daily_cost_by_model_key")
    op.execute(daily_cost_by_model_key(sums))
    op.execute(hourly_utilization(means))


def upgrade() -> None:
    _replace(SUMS, MEANS)


def downgrade() -> None:
    _replace(SUMS_0003, MEANS_0003)
