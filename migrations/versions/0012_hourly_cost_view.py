"""The view hourly_cost_by_model_key: cost_rollups summed over instances by hour, model and
key, with the hour as a real UTC instant (the Grafana cost panels read it).

`hour_bucket` is the UTC hour as text ("2026-11-28T10"). Turning it into a time needs a date
function, and those differ by dialect: to_timestamp does not exist on SQLite, and on
PostgreSQL it reads the text in the session's time zone (an hour early in Europe/Berlin). So
the view carries the conversion, written once per dialect with an explicit UTC offset, and
the panels' SQL only reads columns:

- `hour_epoch`: the hour's start in Unix seconds (an integer on both dialects; Grafana's
  PostgreSQL and SQLite data sources both take a numeric `time` column as Unix seconds, and
  no session setting can shift it);
- `hour_start`: the same instant as a timestamp: `timestamptz` on PostgreSQL, RFC 3339 text
  ending in "Z" on SQLite (which has no timestamp type).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# What daily_cost_by_model_key sums (0010), summed here by the hour.
SUMS = (
    "requests_succeeded",
    "requests_failed",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "list_cost_usd",
    "gpu_cost_usd",
    "cache_savings_usd",
)

# The hour's start from its bucket, per dialect; "+00" / no offset on SQLite (whose date
# functions work in UTC only) pins it to UTC whatever the session's TimeZone.
HOUR_START = {
    "postgresql": "CAST(hour_bucket || ':00:00+00' AS timestamptz)",
    "sqlite": "hour_bucket || ':00:00Z'",
}
HOUR_EPOCH = {
    "postgresql": f"CAST(EXTRACT(EPOCH FROM {HOUR_START['postgresql']}) AS BIGINT)",
    "sqlite": "CAST(strftime('%s', hour_bucket || ':00:00') AS INTEGER)",
}


def hourly_cost_by_model_key(dialect: str) -> str:
    if dialect not in HOUR_EPOCH:
        raise NotImplementedError(f"hourly_cost_by_model_key: no SQL for dialect {dialect!r}")
    columns = ",\n    ".join(f"SUM({c}) AS {c}" for c in SUMS)
    return f"""
CREATE VIEW hourly_cost_by_model_key AS
SELECT
    hour_bucket,
    {HOUR_EPOCH[dialect]} AS hour_epoch,
    {HOUR_START[dialect]} AS hour_start,
    day_bucket,
    model,
    api_key_name,
    {columns}
FROM cost_rollups
GROUP BY hour_bucket, day_bucket, model, api_key_name
"""


def upgrade() -> None:
    op.execute(hourly_cost_by_model_key(op.get_bind().dialect.name))


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS hourly_cost_by_model_key")
