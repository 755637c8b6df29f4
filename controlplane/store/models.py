"""The request store's schema: the one place that knows the tables.

`requests` holds one row per inference request, upserted by id when it starts (status
"running") and again when it ends (migration 0004 added `end_user` and `x_request_id`). `prices` is append-only price history: a price change is a
new row with a later `effective_from`, so costs already stored never change. `config_changes`
is the append-only audit log of configuration changes, one row per field.

The scheduled jobs (see `controlplane.accounting.rollup`) add `utilization_samples` (one row per
sampler tick and instance) with its `gpu_samples` (one row per GPU and tick), `cost_rollups`
(hourly cost and token figures by instance, model and API key) and `job_watermarks` (how far
each job has got, per instance). Migration 0003 also creates two read-only SQL views over them,
`daily_cost_by_model_key` and `hourly_utilization` (views are not part of this metadata).

Portability: times are stored as UTC and read back as timezone-aware UTC on SQLite and
PostgreSQL alike (`UTCDateTime`), and the per-hour / per-day aggregation keys are plain strings
computed in Python at write time, so one GROUP BY works on both databases.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
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

from controlplane.store.records import MAX_END_USER_CHARS, MAX_X_REQUEST_ID_CHARS

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
# cost_rollups.api_key_name of the line that carries an hour's idle GPU time.
IDLE_KEY = "(idle)"
# Where a configuration change came from (config_changes.source); "fleet": a fleet-wide change
# (`controlplane fleet apply`, PATCH ?scope=fleet), which carries one change id per instance;
# "restart": the daemon at start, naming the live values a restart dropped.
CONFIG_SOURCES = ("default", "file", "env", "api", "tui", "fleet", "autopilot", "restart")


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
        Index("ix_requests_x_request_id", "x_request_id"),
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
    # Speculative decoding: tokens proposed for this request, and of those accepted (0 without
    # speculation; migration 0005).
    draft_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    accepted_draft_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # The price in force at arrival_time, chosen when the final record was written.
    price_id: Mapped[int | None] = mapped_column(ForeignKey("prices.id"))
    cost_usd: Mapped[float | None] = mapped_column(USD)
    # UTC aggregation keys, e.g. "2026-11-21T14" and "2026-11-21" (see time_buckets).
    hour_bucket: Mapped[str] = mapped_column(String(13))
    day_bucket: Mapped[str] = mapped_column(String(10))
    # The request's OpenAI `user` field (an end-user id chosen by the client). Not named "user":
    # that is a reserved word in PostgreSQL, where an unquoted `SELECT user` returns the
    # session's role instead of the column.
    end_user: Mapped[str | None] = mapped_column(String(MAX_END_USER_CHARS))
    # X-Request-Id: the client's (not unique) or the generated one; indexed for look-ups.
    x_request_id: Mapped[str | None] = mapped_column(String(MAX_X_REQUEST_ID_CHARS))
    # Structured outputs (migration 0009): what constrained the output (NULL: free text) and
    # the grammar compile time in ms (0 when the grammar was cached).
    structured: Mapped[str | None] = mapped_column(String(16))
    grammar_compile_ms: Mapped[float | None] = mapped_column(Float)
    # What it asked for (migration 0015): choices sampled from its prompt (completion_tokens
    # sums them) and its max_tokens (None: up to the model's length). Replays read them.
    n: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    max_tokens: Mapped[int | None] = mapped_column(Integer)

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
        Index("ix_config_changes_change_id", "change_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime())
    instance_id: Mapped[str] = mapped_column(String(255))
    source: Mapped[str] = mapped_column(String(16))  # one of CONFIG_SOURCES
    actor: Mapped[str | None] = mapped_column(String(255))  # admin token name; None: file/env
    field: Mapped[str] = mapped_column(String(255))  # dotted, e.g. "engine.max_num_seqs"
    old_value: Mapped[str] = mapped_column(Text)  # JSON
    new_value: Mapped[str] = mapped_column(Text)  # JSON
    # One id per change (all the fields of one PATCH); a fleet change has the same id on every
    # instance. None on rows written before migration 0007.
    change_id: Mapped[str | None] = mapped_column(String(64))
    # Why, where the source says (the autopilot: "itl_p99 142 ms > 80 ms target: ..."); None
    # otherwise and on rows written before migration 0008.
    reason: Mapped[str | None] = mapped_column(Text)

    def __repr__(self) -> str:
        return (
            f"ConfigChangeRow(id={self.id!r}, field={self.field!r}, source={self.source!r}, "
            f"actor={self.actor!r})"
        )


class UtilizationSampleRow(Base):
    """One utilization sample of one instance: what the engine did over `interval_s` seconds
    ending at `time`. The sample belongs wholly to the hour of `time` (`hour_bucket`)."""

    __tablename__ = "utilization_samples"
    __table_args__ = (
        Index("ix_utilization_samples_instance_id_time", "instance_id", "time"),
        Index("ix_utilization_samples_hour_bucket", "hour_bucket"),
        Index("ix_utilization_samples_time", "time"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(255))
    time: Mapped[datetime] = mapped_column(UTCDateTime())  # end of the interval
    hour_bucket: Mapped[str] = mapped_column(String(13))  # time_buckets(time)[0]
    interval_s: Mapped[float]  # wall-clock seconds the sample covers
    model: Mapped[str] = mapped_column(String(255))  # the served model
    # Seconds inside forward passes / interval_s, 0-1.
    busy_fraction: Mapped[float]
    batch_fill_seqs: Mapped[float | None]  # mean running sequences / max_num_seqs, 0-1
    batch_fill_tokens: Mapped[float | None]  # mean batch tokens / max_num_batched_tokens, 0-1
    kv_usage: Mapped[float | None]  # KV cache blocks in use, 0-1
    prefill_tokens_per_s: Mapped[float | None]
    decode_tokens_per_s: Mapped[float | None]
    queue_length: Mapped[int | None] = mapped_column(Integer)  # waiting requests at `time`
    num_running: Mapped[int | None] = mapped_column(Integer)  # running requests at `time`
    flops_per_token: Mapped[float | None]  # model FLOPs per computed token (for MFU)
    # Over the interval (migration 0005): prompt tokens found cached / looked up, and accepted
    # / proposed draft tokens; None when nothing was looked up / proposed.
    prefix_cache_hit_rate: Mapped[float | None]
    spec_acceptance_rate: Mapped[float | None]

    def __repr__(self) -> str:
        return (
            f"UtilizationSampleRow(id={self.id!r}, instance_id={self.instance_id!r}, "
            f"time={self.time!r}, busy_fraction={self.busy_fraction!r})"
        )


class GpuSampleRow(Base):
    """One GPU's readings for a utilization sample; any reading may be missing (None) when the
    GPU or driver does not report it."""

    __tablename__ = "gpu_samples"
    __table_args__ = (Index("ix_gpu_samples_sample_id", "sample_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sample_id: Mapped[int] = mapped_column(ForeignKey("utilization_samples.id", ondelete="CASCADE"))
    gpu_index: Mapped[int] = mapped_column(Integer)
    name: Mapped[str | None] = mapped_column(String(255))
    utilization_pct: Mapped[float | None]  # 0-100
    memory_used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    memory_total_bytes: Mapped[int | None] = mapped_column(BigInteger)
    power_w: Mapped[float | None]
    temperature_c: Mapped[float | None]
    # The GPU's energy counter as read (NVML: J since the driver loaded), and the energy used
    # since this instance's previous sample of the same GPU: None for the first sample, after a
    # gap (the previous sample is not contiguous) or a counter reset.
    energy_j: Mapped[float | None]
    interval_energy_j: Mapped[float | None]

    def __repr__(self) -> str:
        return f"GpuSampleRow(id={self.id!r}, sample_id={self.sample_id!r}, gpu={self.gpu_index!r})"


class CostRollupRow(Base):
    """Hourly cost and token figures of one instance, by model and API key.

    Written only by `controlplane.accounting.rollup.run_rollup`, which documents every figure.
    `api_key_name` is "" for requests without a key and IDLE_KEY ("(idle)") for the line that
    carries the hour's idle GPU time. `covered_s`, `mean_utilization` and `mfu` describe the
    whole (hour, instance) and are repeated on each of its rows: count them once per
    (hour_bucket, instance_id) when aggregating.
    """

    __tablename__ = "cost_rollups"
    __table_args__ = (UniqueConstraint("hour_bucket", "instance_id", "model", "api_key_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    hour_bucket: Mapped[str] = mapped_column(String(13))
    day_bucket: Mapped[str] = mapped_column(String(10))
    instance_id: Mapped[str] = mapped_column(String(255))
    model: Mapped[str] = mapped_column(String(255))
    api_key_name: Mapped[str] = mapped_column(String(255))
    requests_succeeded: Mapped[int] = mapped_column(Integer)
    requests_failed: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    list_cost_usd: Mapped[float] = mapped_column(USD)
    gpu_cost_usd: Mapped[float] = mapped_column(USD)
    # What the cached prompt tokens would have cost at the full prompt price, less what they
    # cost at the cached price (migration 0005).
    cache_savings_usd: Mapped[float] = mapped_column(USD, server_default=text("0"))
    # Derived rates (USD per million tokens); None where there are no such tokens.
    list_usd_per_mtok_prompt: Mapped[float | None]
    list_usd_per_mtok_completion: Mapped[float | None]
    gpu_usd_per_mtok_prompt: Mapped[float | None]
    gpu_usd_per_mtok_completion: Mapped[float | None]
    mean_utilization: Mapped[float | None]
    mfu: Mapped[float | None]
    covered_s: Mapped[float]
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())

    def __repr__(self) -> str:
        return (
            f"CostRollupRow(hour_bucket={self.hour_bucket!r}, instance_id={self.instance_id!r}, "
            f"model={self.model!r}, api_key_name={self.api_key_name!r})"
        )


class InstanceRow(Base):
    """One daemon sharing this database (a fleet member), refreshed by its heartbeat.

    `state` is what the daemon last said (loading, serving, draining, stopped); readers turn a
    live state whose heartbeat is too old into "unreachable" (`controlplane.fleet.registry`),
    since a killed daemon cannot say so itself. The figures are its last heartbeat's.
    """

    __tablename__ = "instances"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)  # the daemon's instance_id
    advertise_url: Mapped[str] = mapped_column(String(512))  # its admin API
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    version: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(255))  # None while loading
    quantization: Mapped[str | None] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime())
    num_running: Mapped[int | None] = mapped_column(Integer)
    num_waiting: Mapped[int | None] = mapped_column(Integer)
    kv_usage: Mapped[float | None]  # 0-1
    output_tokens_per_s: Mapped[float | None]
    ttft_p50_s: Mapped[float | None]
    # The incident figures of /admin/stats (the worst-first order reads them; 0011): the age
    # of the oldest request not running (None: nothing waits), the last minute's TTFT p99 in
    # ms (None: nothing finished), and whether the minute's p99s met the SLO targets (None:
    # no p99 for any target).
    oldest_waiting_s: Mapped[float | None] = mapped_column(Float)
    ttft_p99_ms: Mapped[float | None] = mapped_column(Float)
    slo_met: Mapped[bool | None] = mapped_column(Boolean)
    # Its live-tunable settings as JSON ({"engine.max_num_seqs": 32, ...}): config drift.
    config: Mapped[str | None] = mapped_column(Text)

    def __repr__(self) -> str:
        return f"InstanceRow(id={self.id!r}, state={self.state!r}, url={self.advertise_url!r})"


class JobWatermarkRow(Base):
    """How far a scheduled job has got for one instance (e.g. "cost_rollup")."""

    __tablename__ = "job_watermarks"

    job: Mapped[str] = mapped_column(String(64), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[datetime] = mapped_column(UTCDateTime())

    def __repr__(self) -> str:
        return (
            f"JobWatermarkRow(job={self.job!r}, instance_id={self.instance_id!r}, "
            f"value={self.value!r})"
        )


def time_buckets(at: datetime) -> tuple[str, str]:
    """The UTC (hour_bucket, day_bucket) strings for an aware datetime."""
    utc = at.astimezone(UTC)
    return utc.strftime("%Y-%m-%dT%H"), utc.strftime("%Y-%m-%d")


class ApiKeyRow(Base):
    """One API key managed live (migration 0013; controlplane.tenants.keys): never its secret,
    only the secret's sha256 hex digest and its first 8 characters (`prefix`, to tell keys
    apart). NULL limits and budget: the defaults; NULL `allowed_models`: every model."""

    __tablename__ = "api_keys"
    __table_args__ = (Index("ix_api_keys_updated_at", "updated_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(8))
    owner: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    allowed_models: Mapped[str | None] = mapped_column(Text)  # JSON list
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    max_tokens_per_request: Mapped[int | None] = mapped_column(Integer)
    budget_usd: Mapped[float | None] = mapped_column(Float)
    budget_period: Mapped[str | None] = mapped_column(String(8))  # day | month
    budget_action: Mapped[str | None] = mapped_column(String(16))  # reject | deprioritize
    priority_class: Mapped[int] = mapped_column(Integer, default=0)

    def __repr__(self) -> str:
        return f"ApiKeyRow(name={self.name!r}, prefix={self.prefix!r})"


class RefusalRow(Base):
    """Requests refused before anything ran (a rate limit's or a budget's 429, a suspended
    key's 403, a full queue, a limiter down: controlplane.tenants.usage.REASONS), counted per
    UTC hour, instance, API key and reason (migration 0014). A refused request has no
    `requests` row: this is where the reports count it.

    One row per (hour, instance, key, reason), never one per refusal: each daemon counts its
    refusals in memory and adds them to its rows with the request rows' writer
    (store.recorder, every store.flush_interval_s), an upsert that adds `requests` to the row.
    `instance_id` is the daemon's own (the fleet's instances.id), so several daemons on one
    database never write the same row. `api_key_name` is "" for an open API's requests (as in
    `cost_rollups`).
    """

    __tablename__ = "refusals"

    hour_bucket: Mapped[str] = mapped_column(String(13), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    api_key_name: Mapped[str] = mapped_column(String(255), primary_key=True)
    reason: Mapped[str] = mapped_column(String(32), primary_key=True)
    day_bucket: Mapped[str] = mapped_column(String(10))
    requests: Mapped[int] = mapped_column(BigInteger)  # refused in the hour
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())  # the last flush that added

    def __repr__(self) -> str:
        return (
            f"RefusalRow(hour_bucket={self.hour_bucket!r}, instance_id={self.instance_id!r}, "
            f"api_key_name={self.api_key_name!r}, reason={self.reason!r}, "
            f"requests={self.requests!r})"
        )
