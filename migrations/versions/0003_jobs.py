"""Scheduled jobs: utilization samples, GPU readings, hourly cost rollups, job watermarks, and
the views daily_cost_by_model_key and hourly_utilization.

The views use the same SQL on SQLite and PostgreSQL: plain aggregates over the string buckets
(substr for the day), no dialect-specific date functions. Means are time-weighted (by
interval_s) over the samples that carry the reading.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _weighted_mean(column: str) -> str:
    return (
        f"SUM(interval_s * {column}) / "
        f"NULLIF(SUM(CASE WHEN {column} IS NOT NULL THEN interval_s END), 0) AS mean_{column}"
    )


DAILY_COST_BY_MODEL_KEY = """
CREATE VIEW daily_cost_by_model_key AS
SELECT
    day_bucket,
    model,
    api_key_name,
    SUM(requests_succeeded) AS requests_succeeded,
    SUM(requests_failed) AS requests_failed,
    SUM(prompt_tokens) AS prompt_tokens,
    SUM(cached_prompt_tokens) AS cached_prompt_tokens,
    SUM(completion_tokens) AS completion_tokens,
    SUM(list_cost_usd) AS list_cost_usd,
    SUM(gpu_cost_usd) AS gpu_cost_usd
FROM cost_rollups
GROUP BY day_bucket, model, api_key_name
"""

HOURLY_UTILIZATION = f"""
CREATE VIEW hourly_utilization AS
SELECT
    hour_bucket,
    substr(hour_bucket, 1, 10) AS day_bucket,
    instance_id,
    COUNT(*) AS samples,
    SUM(interval_s) AS covered_s,
    {_weighted_mean("busy_fraction")},
    {_weighted_mean("kv_usage")},
    {_weighted_mean("batch_fill_seqs")},
    {_weighted_mean("batch_fill_tokens")},
    {_weighted_mean("prefill_tokens_per_s")},
    {_weighted_mean("decode_tokens_per_s")}
FROM utilization_samples
GROUP BY hour_bucket, instance_id
"""


def upgrade() -> None:
    op.create_table(
        "utilization_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("instance_id", sa.String(length=255), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("hour_bucket", sa.String(length=13), nullable=False),
        sa.Column("interval_s", sa.Double(), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("busy_fraction", sa.Double(), nullable=False),
        sa.Column("batch_fill_seqs", sa.Double(), nullable=True),
        sa.Column("batch_fill_tokens", sa.Double(), nullable=True),
        sa.Column("kv_usage", sa.Double(), nullable=True),
        sa.Column("prefill_tokens_per_s", sa.Double(), nullable=True),
        sa.Column("decode_tokens_per_s", sa.Double(), nullable=True),
        sa.Column("queue_length", sa.Integer(), nullable=True),
        sa.Column("num_running", sa.Integer(), nullable=True),
        sa.Column("flops_per_token", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_utilization_samples")),
    )
    op.create_index(
        "ix_utilization_samples_instance_id_time", "utilization_samples", ["instance_id", "time"]
    )
    op.create_index("ix_utilization_samples_hour_bucket", "utilization_samples", ["hour_bucket"])
    op.create_index("ix_utilization_samples_time", "utilization_samples", ["time"])

    op.create_table(
        "gpu_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("sample_id", sa.Integer(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=True),
        sa.Column("utilization_pct", sa.Double(), nullable=True),
        sa.Column("memory_used_bytes", sa.BigInteger(), nullable=True),
        sa.Column("memory_total_bytes", sa.BigInteger(), nullable=True),
        sa.Column("power_w", sa.Double(), nullable=True),
        sa.Column("temperature_c", sa.Double(), nullable=True),
        sa.Column("energy_j", sa.Double(), nullable=True),
        sa.Column("interval_energy_j", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["sample_id"],
            ["utilization_samples.id"],
            name=op.f("fk_gpu_samples_sample_id_utilization_samples"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_samples")),
    )
    op.create_index("ix_gpu_samples_sample_id", "gpu_samples", ["sample_id"])

    op.create_table(
        "cost_rollups",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("hour_bucket", sa.String(length=13), nullable=False),
        sa.Column("day_bucket", sa.String(length=10), nullable=False),
        sa.Column("instance_id", sa.String(length=255), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("api_key_name", sa.String(length=255), nullable=False),
        sa.Column("requests_succeeded", sa.Integer(), nullable=False),
        sa.Column("requests_failed", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("list_cost_usd", sa.Numeric(precision=20, scale=12), nullable=False),
        sa.Column("gpu_cost_usd", sa.Numeric(precision=20, scale=12), nullable=False),
        sa.Column("list_usd_per_mtok_prompt", sa.Double(), nullable=True),
        sa.Column("list_usd_per_mtok_completion", sa.Double(), nullable=True),
        sa.Column("gpu_usd_per_mtok_prompt", sa.Double(), nullable=True),
        sa.Column("gpu_usd_per_mtok_completion", sa.Double(), nullable=True),
        sa.Column("mean_utilization", sa.Double(), nullable=True),
        sa.Column("mfu", sa.Double(), nullable=True),
        sa.Column("covered_s", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cost_rollups")),
        sa.UniqueConstraint(
            "hour_bucket",
            "instance_id",
            "model",
            "api_key_name",
            name=op.f("uq_cost_rollups_hour_bucket_instance_id_model_api_key_name"),
        ),
    )

    op.create_table(
        "job_watermarks",
        sa.Column("job", sa.String(length=64), nullable=False),
        sa.Column("instance_id", sa.String(length=255), nullable=False),
        sa.Column("value", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job", "instance_id", name=op.f("pk_job_watermarks")),
    )

    op.execute(DAILY_COST_BY_MODEL_KEY)
    op.execute(HOURLY_UTILIZATION)


def downgrade() -> None:
    # Views first: they depend on the tables. Dropping a table drops its indexes; gpu_samples
    # before utilization_samples, which it references.
    op.execute("DROP VIEW IF EXISTS hourly_utilization")
    op.execute("DROP VIEW IF EXISTS daily_cost_by_model_key")
    op.drop_table("job_watermarks")
    op.drop_table("cost_rollups")
    op.drop_table("gpu_samples")
    op.drop_table("utilization_samples")
