"""What a request asked for, beside what it used (issue 57, replay): `n` (choices sampled from
its prompt; one row a prompt, so a row's completion_tokens are the sum over its choices) and
`max_tokens` (NULL: the request left it to the model's length). With them and the recorded
token counts, a window of rows is a workload `controlplane replay` can drive again.

Rows written before this migration read n = 1 and max_tokens NULL.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("n", sa.Integer(), server_default=sa.text("1"), nullable=False))
        batch.add_column(sa.Column("max_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("max_tokens")
        batch.drop_column("n")
