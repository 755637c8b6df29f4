"""The fleet's incident figures on every heartbeat: the oldest waiting request's age, the last
minute's TTFT p99 and whether the SLO is met (the "worst first" order reads them). Nullable:
rows of older daemons, and daemons with nothing waiting or nothing finished, have none.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("oldest_waiting_s", sa.Float(), nullable=True))
    op.add_column("instances", sa.Column("ttft_p99_ms", sa.Float(), nullable=True))
    op.add_column("instances", sa.Column("slo_met", sa.Boolean(), nullable=True))


def downgrade() -> None:
    op.drop_column("instances", "slo_met")
    op.drop_column("instances", "ttft_p99_ms")
    op.drop_column("instances", "oldest_waiting_s")
