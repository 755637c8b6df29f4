"""Structured outputs on request rows: what constrained the output, and its compile time.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("structured", sa.String(16), nullable=True))
    op.add_column("requests", sa.Column("grammar_compile_ms", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("requests", "grammar_compile_ms")
    op.drop_column("requests", "structured")
