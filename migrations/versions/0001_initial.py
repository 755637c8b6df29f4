"""Initial schema: requests and prices.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("prompt_per_mtok", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("cached_prompt_per_mtok", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("completion_per_mtok", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
        sa.UniqueConstraint("model", "effective_from", name=op.f("uq_prices_model_effective_from")),
    )
    op.create_table(
        "requests",
        sa.Column("id", sa.String(length=255), nullable=False),
        sa.Column("instance_id", sa.String(length=255), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("api_key_name", sa.String(length=255), nullable=True),
        sa.Column("api_key_hash", sa.String(length=64), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("arrival_time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("first_token_time", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finish_time", sa.DateTime(timezone=True), nullable=True),
        sa.Column("queue_time_s", sa.Double(), nullable=True),
        sa.Column("ttft_s", sa.Double(), nullable=True),
        sa.Column("mean_itl_s", sa.Double(), nullable=True),
        sa.Column("e2e_latency_s", sa.Double(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "cached_prompt_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False
        ),
        sa.Column("completion_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("preemptions", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("price_id", sa.Integer(), nullable=True),
        sa.Column("cost_usd", sa.Numeric(precision=20, scale=12), nullable=True),
        sa.Column("hour_bucket", sa.String(length=13), nullable=False),
        sa.Column("day_bucket", sa.String(length=10), nullable=False),
        sa.ForeignKeyConstraint(
            ["price_id"], ["prices.id"], name=op.f("fk_requests_price_id_prices")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
    )
    op.create_index("ix_requests_arrival_time", "requests", ["arrival_time"])
    op.create_index("ix_requests_status", "requests", ["status"])
    op.create_index("ix_requests_api_key_name", "requests", ["api_key_name"])
    op.create_index("ix_requests_hour_bucket", "requests", ["hour_bucket"])


def downgrade() -> None:
    # Dropping a table drops its indexes; requests first, it references prices.
    op.drop_table("requests")
    op.drop_table("prices")
