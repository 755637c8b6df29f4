"""The fleet: one `instances` row per daemon sharing the database, refreshed by its heartbeat.

Types as in `controlplane.store.models.InstanceRow`, written out here: a migration describes
the schema of its time.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "instances",
        sa.Column("id", sa.String(length=255), nullable=False),
        sa.Column("advertise_url", sa.String(length=512), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=True),
        sa.Column("quantization", sa.String(length=32), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("num_running", sa.Integer(), nullable=True),
        sa.Column("num_waiting", sa.Integer(), nullable=True),
        sa.Column("kv_usage", sa.Double(), nullable=True),
        sa.Column("output_tokens_per_s", sa.Double(), nullable=True),
        sa.Column("ttft_p50_s", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("instances")
