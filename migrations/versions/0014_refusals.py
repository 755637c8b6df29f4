"""Refused requests, counted (issue 55, "Visible"): `refusals`, one row per UTC hour, instance,
API key and reason with the number of requests refused, so that the reports can count what has
no request row (a rate limit's or a budget's 429, a suspended key's 403, a full queue).

The primary key is the aggregation key: each daemon adds its counts with an upsert on it
(store.recorder), never one row per refused request. `api_key_name` is "" for an open API's
requests (NOT NULL: a NULL in a key never conflicts, so the upsert could not add to it).

Types as in `controlplane.store.models.RefusalRow`, written out here: a migration describes
the schema of its time.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "refusals",
        sa.Column("hour_bucket", sa.String(length=13), nullable=False),
        sa.Column("instance_id", sa.String(length=255), nullable=False),
        sa.Column("api_key_name", sa.String(length=255), nullable=False),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("day_bucket", sa.String(length=10), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint(
            "hour_bucket", "instance_id", "api_key_name", "reason", name=op.f("pk_refusals")
        ),
    )


def downgrade() -> None:
    op.drop_table("refusals")
