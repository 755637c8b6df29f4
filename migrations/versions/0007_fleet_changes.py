"""Fleet-wide changes: a change id on every audit row (one id per change, the same on every
instance a fleet change reached) and each instance's live settings (config drift).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("config_changes", sa.Column("change_id", sa.String(length=64), nullable=True))
    op.create_index("ix_config_changes_change_id", "config_changes", ["change_id"])
    op.add_column("instances", sa.Column("config", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("instances", "config")
    op.drop_index("ix_config_changes_change_id", table_name="config_changes")
    op.drop_column("config_changes", "change_id")
