"""A reason on audit rows: the autopilot says why it changed a knob.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("config_changes", sa.Column("reason", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("config_changes", "reason")
