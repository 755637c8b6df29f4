"""Request rows: the end user (OpenAI's `user` field) and the X-Request-Id.

Both nullable: rows written before this migration have neither. `x_request_id` is indexed
(looking a request up by the id a client logged) and not unique: clients may reuse an id, and a
request with several prompts has one row per prompt under the same id. Lengths as in
`controlplane.store.records` (MAX_END_USER_CHARS, MAX_X_REQUEST_ID_CHARS), written out here:
a migration describes the schema of its time.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-12
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN (nullable, no default): cheap on both databases, no table rewrite.
    op.add_column("requests", sa.Column("end_user", sa.String(length=256), nullable=True))
    op.add_column("requests", sa.Column("x_request_id", sa.String(length=128), nullable=True))
    op.create_index("ix_requests_x_request_id", "requests", ["x_request_id"])


def downgrade() -> None:
    op.drop_index("ix_requests_x_request_id", table_name="requests")
    # Batch mode: SQLite recreates the table (older SQLite cannot drop columns); PostgreSQL
    # gets plain ALTER TABLE ... DROP COLUMN.
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("x_request_id")
        batch.drop_column("end_user")
