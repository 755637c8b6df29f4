"""Read-side queries for the admin API: request rows, newest first, with keyset pagination.

Parameters are validated here; a bad one raises ValueError whose message starts with the
parameter's name (`"cursor: malformed"`), which the API answers with a 422.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, and_, or_, select

from controlplane.errors import FieldError
from controlplane.store.models import STATUSES, RequestRow
from controlplane.store.records import MAX_X_REQUEST_ID_CHARS

REQUESTS = RequestRow.__table__
MAX_LIMIT = 1000

# What a request dict carries: not the key hash (not for display) nor the aggregation buckets.
REQUEST_FIELDS = (
    "id",
    "instance_id",
    "model",
    "endpoint",
    "api_key_name",
    "status",
    "finish_reason",
    "error",
    "arrival_time",
    "first_token_time",
    "finish_time",
    "queue_time_s",
    "ttft_s",
    "mean_itl_s",
    "e2e_latency_s",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "preemptions",
    "draft_tokens",
    "accepted_draft_tokens",
    "price_id",
    "cost_usd",
    "end_user",
    "x_request_id",
    "structured",
    "grammar_compile_ms",
    "n",
    "max_tokens",
)
_TIME_FIELDS = frozenset({"arrival_time", "first_token_time", "finish_time"})
# What the API accepts as an X-Request-Id (anything else cannot be in a row).
_X_REQUEST_ID = re.compile(rf"[\x20-\x7e]{{1,{MAX_X_REQUEST_ID_CHARS}}}")
_COLUMNS = [REQUESTS.c[name] for name in REQUEST_FIELDS]


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat()


def encode_cursor(arrival_time: datetime, request_id: str) -> str:
    """The opaque, URL-safe cursor for the position after (arrival_time, id)."""
    raw = json.dumps([_iso(arrival_time), request_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """(arrival_time, id) from a cursor; FieldError("cursor", "malformed") if it is not one."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, request_id = json.loads(raw)
        if not isinstance(at, str) or not isinstance(request_id, str):
            raise ValueError
        arrival = datetime.fromisoformat(at)
        if arrival.tzinfo is None or arrival.utcoffset() is None:
            raise ValueError
        arrival = arrival.astimezone(UTC)  # OverflowError: year 1 at +05:00, 9999 at -05:00
    except (TypeError, ValueError, OverflowError, binascii.Error, UnicodeError):
        # json.JSONDecodeError is a ValueError; unpacking a non-pair raises one too.
        raise FieldError("cursor", "malformed") from None
    return arrival, request_id


def _aware(name: str, value: datetime | None) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise FieldError(name, f"must be a timezone-aware datetime, got {value!r}")
    try:
        return value.astimezone(UTC)
    except OverflowError:  # year 1 with a positive offset, 9999 with a negative one
        raise FieldError(name, f"{value.isoformat()} is out of range") from None


def _as_dict(row: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in REQUEST_FIELDS:
        value = row[name]
        if name in _TIME_FIELDS:
            value = _iso(value)
        elif name == "cost_usd" and value is not None:
            value = float(value)
        out[name] = value
    return out


def list_requests(
    engine: Engine,
    *,
    status: str | None = None,
    api_key_name: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 100,
    cursor: str | None = None,
    instance_id: str | None = None,
    x_request_id: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """One page of request rows, newest first by (arrival_time, id), and the next page's cursor
    (None after the last page).

    `since` is inclusive and `until` exclusive, both on arrival_time. `x_request_id` finds
    the rows of the requests that carried that X-Request-Id (several: clients may reuse one,
    and a request with several prompts has a row per prompt). A cursor continues the listing
    it came from; pass the same filters with it.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise FieldError("limit", f"must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")
    if status is not None and status not in STATUSES:
        raise FieldError("status", f"must be one of {', '.join(STATUSES)}, got {status!r}")
    if x_request_id is not None and not _X_REQUEST_ID.fullmatch(x_request_id):
        raise FieldError(
            "x_request_id",
            f"must be 1 to {MAX_X_REQUEST_ID_CHARS} printable ASCII characters (an X-Request-Id)",
        )
    since, until = _aware("since", since), _aware("until", until)
    if since is not None and until is not None and not since < until:
        raise FieldError("since", "must be before until")
    after = decode_cursor(cursor) if cursor is not None else None

    c = REQUESTS.c
    stmt = select(*_COLUMNS).order_by(c.arrival_time.desc(), c.id.desc()).limit(limit + 1)
    if status is not None:
        stmt = stmt.where(c.status == status)
    if api_key_name is not None:
        stmt = stmt.where(c.api_key_name == api_key_name)
    if instance_id is not None:
        stmt = stmt.where(c.instance_id == instance_id)
    if x_request_id is not None:
        stmt = stmt.where(c.x_request_id == x_request_id)
    if since is not None:
        stmt = stmt.where(c.arrival_time >= since)
    if until is not None:
        stmt = stmt.where(c.arrival_time < until)
    if after is not None:
        at, request_id = after
        stmt = stmt.where(or_(c.arrival_time < at, and_(c.arrival_time == at, c.id < request_id)))
    with engine.connect() as conn:
        rows = conn.execute(stmt).mappings().all()
    more = len(rows) > limit
    rows = rows[:limit]
    next_cursor = encode_cursor(rows[-1]["arrival_time"], rows[-1]["id"]) if more else None
    return [_as_dict(r) for r in rows], next_cursor
