"""API keys managed live (issue 55): one `api_keys` row per key created through the admin API
or `controlplane keys`, beside the `[[api_keys]]` of the config file.

Only the sha256 hex digest of a secret is stored (`secret_hash`), never the secret: a secret
is `cp-` + 32 random bytes (secrets.token_urlsafe(32)), so a fast hash is enough (a slow KDF
defends guessable passwords; 256 random bits cannot be guessed) and lets every request be
looked up by one digest. `prefix` (the secret's first 8 characters) identifies a key to an
operator. Limits and budget columns are NULL for "the defaults"; `allowed_models` is a JSON
list, NULL for every model.

Types as in `controlplane.store.models.ApiKeyRow`, written out here: a migration describes
the schema of its time.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=8), nullable=False),
        sa.Column("owner", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("allowed_models", sa.Text(), nullable=True),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("max_tokens_per_request", sa.Integer(), nullable=True),
        sa.Column("budget_usd", sa.Float(), nullable=True),
        sa.Column("budget_period", sa.String(length=8), nullable=True),
        sa.Column("budget_action", sa.String(length=16), nullable=True),
        sa.Column("priority_class", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("name", name=op.f("uq_api_keys_name")),
        sa.UniqueConstraint("secret_hash", name=op.f("uq_api_keys_secret_hash")),
    )
    op.create_index(op.f("ix_api_keys_updated_at"), "api_keys", ["updated_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_api_keys_updated_at"), table_name="api_keys")
    op.drop_table("api_keys")
