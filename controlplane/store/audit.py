"""The configuration audit log: one `config_changes` row per changed field.

Old and new values are stored as JSON text, so a value of any JSON type (and the usual Python
extras: datetimes, Decimals, paths, dataclasses such as `Price`) goes in, and the decoded JSON
comes back out of `history`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from pathlib import PurePath
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select

from controlplane.store.models import CONFIG_SOURCES, ConfigChangeRow

CONFIG_CHANGES = ConfigChangeRow.__table__
MAX_LIMIT = 1000


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """One changed field, as handed to `write_changes`."""

    time: datetime  # aware UTC
    source: str  # one of CONFIG_SOURCES
    actor: str | None  # the admin token's name; None for file / env
    field: str  # dotted, e.g. "engine.max_num_seqs"
    old_value: Any  # JSON-serialisable
    new_value: Any
    change_id: str | None = None  # the same on every field of one change (and fleet-wide)
    reason: str | None = None  # why (the autopilot says)


def _jsonable(value: Any) -> Any:
    """`value` as plain JSON types (dict / list / str / int / float / bool / None)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        # Strict JSON has no NaN / Infinity (and the admin API refuses to send them).
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Decimal):
        return float(value) if value.is_finite() else str(value)
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            return value.isoformat()  # naive: kept as given, no guessing of the offset
        return value.astimezone(UTC).isoformat()
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def encode_value(value: Any) -> str:
    """The JSON text stored for a value."""
    return json.dumps(_jsonable(value), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _check(change: ConfigChange) -> None:
    if change.source not in CONFIG_SOURCES:
        raise ValueError(
            f"source: {change.source!r} is not one of {', '.join(CONFIG_SOURCES)} "
            f"(field {change.field!r})"
        )
    if not change.field:
        raise ValueError("field: must not be empty")
    t = change.time
    if not isinstance(t, datetime) or t.tzinfo is None or t.utcoffset() is None:
        raise ValueError(f"time: {t!r} is not a timezone-aware datetime (field {change.field!r})")


def write_changes(
    bind: Engine | Connection, instance_id: str, changes: Sequence[ConfigChange]
) -> None:
    """Append `changes` to the audit log, all in one transaction (none on any error); with a
    Connection, in the caller's transaction.

    Raises ValueError for an unknown source, an empty field or a naive time, and TypeError for
    a value that cannot be encoded as JSON; nothing is written then.
    """
    rows = []
    for change in changes:
        _check(change)
        try:
            old, new = encode_value(change.old_value), encode_value(change.new_value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{change.field}: {exc}") from exc
        rows.append(
            dict(
                time=change.time.astimezone(UTC),
                instance_id=instance_id,
                source=change.source,
                actor=change.actor,
                field=change.field,
                old_value=old,
                new_value=new,
                change_id=change.change_id,
                reason=change.reason,
            )
        )
    if not rows:
        return
    if isinstance(bind, Connection):
        bind.execute(insert(CONFIG_CHANGES), rows)
        return
    with bind.begin() as conn:
        conn.execute(insert(CONFIG_CHANGES), rows)


def _check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit: must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")


def history(
    engine: Engine,
    *,
    limit: int = 100,
    before_id: int | None = None,
    field: str | None = None,
    instance_id: str | None = None,
    change_id: str | None = None,
) -> list[dict[str, Any]]:
    """Audit rows, newest first (by id, i.e. in the order they were written).

    Page on with `before_id` = the last row's id. Each dict has id, time (ISO 8601 UTC
    string), instance_id, source, actor, field, old_value and new_value (decoded JSON), and
    change_id (the same on every row of one change; fleet-wide, on every instance) and reason.
    """
    _check_limit(limit)
    if before_id is not None and (isinstance(before_id, bool) or not isinstance(before_id, int)):
        raise ValueError(f"before_id: must be an integer, got {before_id!r}")
    c = CONFIG_CHANGES.c
    stmt = select(CONFIG_CHANGES).order_by(c.id.desc()).limit(limit)
    if before_id is not None:
        stmt = stmt.where(c.id < before_id)
    if field is not None:
        stmt = stmt.where(c.field == field)
    if instance_id is not None:
        stmt = stmt.where(c.instance_id == instance_id)
    if change_id is not None:
        stmt = stmt.where(c.change_id == change_id)
    with engine.connect() as conn:
        rows = conn.execute(stmt).mappings().all()
    return [
        {
            "id": r["id"],
            "time": r["time"].astimezone(UTC).isoformat(),
            "instance_id": r["instance_id"],
            "source": r["source"],
            "actor": r["actor"],
            "field": r["field"],
            "old_value": json.loads(r["old_value"]),
            "new_value": json.loads(r["new_value"]),
            "change_id": r["change_id"],
            "reason": r["reason"],
        }
        for r in rows
    ]


def latest_values(
    engine: Engine, *, instance_id: str, since: datetime | None = None
) -> dict[str, dict[str, Any]]:
    """Per field, the newest audit row of `instance_id` (written at or after `since`):
    `{field: {"source", "new_value", "time"}}` (the restart check: which live values were last
    in force, and from where)."""
    c = CONFIG_CHANGES.c
    newest = select(func.max(c.id)).where(c.instance_id == instance_id)
    if since is not None:
        newest = newest.where(c.time >= since)
    stmt = select(c.field, c.source, c.new_value, c.time).where(
        c.id.in_(newest.group_by(c.field).scalar_subquery())
    )
    with engine.connect() as conn:
        rows = conn.execute(stmt).mappings().all()
    return {
        r["field"]: {
            "source": r["source"],
            "new_value": json.loads(r["new_value"]),
            "time": r["time"].astimezone(UTC),
        }
        for r in rows
    }
