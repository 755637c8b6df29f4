"""The request store's schema: the one place that knows the tables.

Three tables. `requests` holds one row per inference request, upserted by id when it starts
(status "running") and again when it ends. `prices` is append-only price history: a price
change is a new row with a later `effective_from`, so costs already stored never change.
`config_changes` is the append-only audit log of configuration changes, one row per field.

Portability: times are stored as UTC and read back as timezone-aware UTC on SQLite and
PostgreSQL alike (`UTCDateTime`), and the per-hour / per-day aggregation keys are plain strings
computed in Python at write time, so one GROUP BY works on both databases.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Numeric,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Deterministic constraint names: Alembic needs them to alter or drop constraints later (and in
# SQLite batch mode, which recreates tables); migrations use the same names.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

STATUSES = ("running", "success", "error", "aborted", "interrupted")
FINAL_STATUSES = frozenset(STATUSES) - {"running"}
# Where a configuration change came from (config_changes.source).
CONFIG_SOURCES = ("default", "file", "env", "api", "tui")


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    PostgreSQL stores `timestamptz`; SQLite has no time zones, so the value is stored as naive
    UTC text and UTC is attached again on read. Naive datetimes are refused on write: their
    meaning is ambiguous, and guessing would silently shift times by the local offset.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: store only timezone-aware datetimes")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


# Money: exact decimal storage (no float drift in sums on PostgreSQL), returned as float.
USD_PER_MTOK = Numeric(18, 9, asdecimal=False)
USD = Numeric(20, 12, asdecimal=False)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class PriceEntry(Base):
    """USD per million tokens for `model` (or "*"), in force from `effective_from` on."""

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("model", "effective_from"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(255))
    effective_from: Mapped[datetime] = mapped_column(UTCDateTime())
    prompt_per_mtok: Mapped[float] = mapped_column(USD_PER_MTOK)
    cached_prompt_per_mtok: Mapped[float] = mapped_column(USD_PER_MTOK)
    completion_per_mtok: Mapped[float] = mapped_column(USD_PER_MTOK)

    def __repr__(self) -> str:
        return (
            f"PriceEntry(id={self.id!r}, model={self.model!r}, "
            f"effective_from={self.effective_from!r}, prompt={self.prompt_per_mtok!r}, "
            f"cached_prompt={self.cached_prompt_per_mtok!r}, "
            f"completion={self.completion_per_mtok!r})"
        )


class RequestRow(Base):
    """One inference request; written when it starts and again when it ends."""

    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_arrival_time", "arrival_time"),
        Index("ix_requests_status", "status"),
        Index("ix_requests_api_key_name", "api_key_name"),
        Index("ix_requests_hour_bucket", "hour_bucket"),
    )

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(255))
    model: Mapped[str] = mapped_column(String(255))
    endpoint: Mapped[str] = mapped_column(String(64))
    api_key_name: Mapped[str | None] = mapped_column(String(255))
    api_key_hash: Mapped[str | None] = mapped_column(String(64))  # sha256 hex, never the key
    status: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[str | None] = mapped_column(Text)
    arrival_time: Mapped[datetime] = mapped_column(UTCDateTime())
    first_token_time: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finish_time: Mapped[datetime | None] = mapped_column(UTCDateTime())
    queue_time_s: Mapped[float | None]
    ttft_s: Mapped[float | None]
    mean_itl_s: Mapped[float | None]
    e2e_latency_s: Mapped[float | None]
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # The price in force at arrival_time, chosen when the final record was written.
    price_id: Mapped[int | None] = mapped_column(ForeignKey("prices.id"))
    cost_usd: Mapped[float | None] = mapped_column(USD)
    # UTC aggregation keys, e.g. "2026-11-21T14" and "2026-11-21" (see time_buckets).
    hour_bucket: Mapped[str] = mapped_column(String(13))
    day_bucket: Mapped[str] = mapped_column(String(10))

    def __repr__(self) -> str:
        return f"RequestRow(id={self.id!r}, status={self.status!r}, model={self.model!r})"


class ConfigChangeRow(Base):
    """One changed configuration field: who changed it, from where, and its old and new value.

    Values are JSON text (see `controlplane.store.audit`), so any value type round-trips and
    one column type serves every field.
    """

    __tablename__ = "config_changes"
    __table_args__ = (
        Index("ix_config_changes_time", "time"),
        Index("ix_config_changes_field", "field"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime())
    instance_id: Mapped[str] = mapped_column(String(255))
    source: Mapped[str] = mapped_column(String(16))  # one of CONFIG_SOURCES
    actor: Mapped[str | None] = mapped_column(String(255))  # admin token name; None: file/env
    field: Mapped[str] = mapped_column(String(255))  # dotted, e.g. "engine.max_num_seqs"
    old_value: Mapped[str] = mapped_column(Text)  # JSON
    new_value: Mapped[str] = mapped_column(Text)  # JSON

    def __repr__(self) -> str:
        return (
            f"ConfigChangeRow(id={self.id!r}, field={self.field!r}, source={self.source!r}, "
            f"actor={self.actor!r})"
        )


def time_buckets(at: datetime) -> tuple[str, str]:
    """The UTC (hour_bucket, day_bucket) strings for an aware datetime."""
    utc = at.astimezone(UTC)
    return utc.strftime("%Y-%m-%dT%H"), utc.strftime("%Y-%m-%d")
