"""Prefix caching and speculative decoding in SQL: request rows count draft and accepted
tokens, utilization samples carry the prefix-cache hit rate and the draft acceptance rate, and
hourly cost rollups what the cache saved at list price.

Counts are NOT NULL with a server default of 0 (rows written before read 0, which is what they
were: no speculation existed); rates are nullable (None: nothing looked up / proposed in the
sample's interval). Types as in `controlplane.store.models`, written out here: a migration
describes the schema of its time.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    zero = sa.text("0")
    op.add_column(
        "requests", sa.Column("draft_tokens", sa.Integer(), server_default=zero, nullable=False)
    )
    op.add_column(
        "requests",
        sa.Column("accepted_draft_tokens", sa.Integer(), server_default=zero, nullable=False),
    )
    op.add_column(
        "utilization_samples", sa.Column("prefix_cache_hit_rate", sa.Double(), nullable=True)
    )
    op.add_column(
        "utilization_samples", sa.Column("spec_acceptance_rate", sa.Double(), nullable=True)
    )
    op.add_column(
        "cost_rollups",
        sa.Column(
            "cache_savings_usd",
            sa.Numeric(precision=20, scale=12),
            server_default=zero,
            nullable=False,
        ),
    )


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite >= 3.35, PostgreSQL): batch mode would recreate the tables, and
    # SQLite refuses to rename a table over the views 0003 defines on cost_rollups and
    # utilization_samples. None of the dropped columns is used by a view or an index.
    op.drop_column("cost_rollups", "cache_savings_usd")
    op.drop_column("utilization_samples", "spec_acceptance_rate")
    op.drop_column("utilization_samples", "prefix_cache_hit_rate")
    op.drop_column("requests", "accepted_draft_tokens")
    op.drop_column("requests", "draft_tokens")
