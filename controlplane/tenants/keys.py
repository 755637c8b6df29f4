"""API keys managed live (issue 55): the `api_keys` table (KeyStore), each daemon's copy of it
(KeyCache) and the per-address limit on failed authentications (AuthFailures).

How the three sources of keys relate:

- `[[api_keys]]` in the config file: unchanged, fixed until a restart; checked first.
- the `api_keys` table: created, changed, rotated and revoked live through /admin/keys or
  `controlplane keys`; a name may not be one of the config file's (refused at creation, 409).
- `server.suspended_keys` (live): names of either kind; a suspended key gets 403.

Secrets: `cp-` + secrets.token_urlsafe(32) (32 random bytes), shown once, at creation or
rotation. The table holds only their sha256 hex digest: with 256 random bits there is nothing
to guess, so a slow KDF (for human passwords) would only cost every request time. A request's
bearer is hashed once and looked up by digest; the match is confirmed with
hmac.compare_digest.

The bound: every daemon reloads the table every `server.key_refresh_s` (KeyCache.run_forever),
so a key revoked (or rotated) on one daemon stops working on every daemon of the fleet within
one refresh interval, plus the reload's own time; on the daemon that made the change at once.
An expiry needs no reload: `expires_at` is compared with the clock at each request. A key is
checked at admission only: requests already admitted (streams included) run to their end after
a revoke, rotation or expiry, as after a suspension; POST /admin/keys/{name}/abort cuts them
(docs/tenants.md says why).

The API stays open (no key needed) while the config file has no key and the table has no row;
the first table key closes it, and revoking every key does not open it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import math
import re
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, insert, select, update
from sqlalchemy.exc import IntegrityError

from controlplane.common import parse_time
from controlplane.errors import FieldError
from controlplane.store.audit import ConfigChange, write_changes
from controlplane.store.models import IDLE_KEY, ApiKeyRow
from controlplane.tenants.limits import LIMIT_FIELDS

log = logging.getLogger("controlplane.keys")

API_KEYS = ApiKeyRow.__table__
SECRET_PREFIX = "cp-"
PREFIX_CHARS = 8
MAX_NAME_CHARS = 128  # audit fields are "api_keys.<name>.<field>" in a 255-character column
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$")

# Each limit's allowed range (None in a body: the defaults).
LIMITS: dict[str, tuple[int, int]] = {
    "requests_per_minute": (1, 10_000_000),
    "tokens_per_minute": (1, 10_000_000_000),
    "max_concurrent": (1, 1_000_000),
    "max_tokens_per_request": (1, 100_000_000),
    "priority_class": (0, 9),
}
MAX_BUDGET_USD = 1e9
BUDGET_PERIODS = ("day", "month")
BUDGET_ACTIONS = ("reject", "deprioritize")
MAX_MODELS = 64
# What PATCH may change (the name, secret and revocation have their own verbs).
UPDATABLE = (
    "owner",
    "expires_at",
    "allowed_models",
    *(k for k in LIMITS if k != "priority_class"),
    "budget_usd",
    "budget_period",
    "budget_action",
    "priority_class",
)


class KeyConflictError(Exception):
    """A name taken (by a table key or a config file key): 409."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class KeyNotFoundError(LookupError):
    pass


def hash_secret(secret: str | bytes) -> str:
    """The sha256 hex digest a key is stored and looked up by (as store.records.hash_api_key)."""
    raw = secret.encode("utf-8") if isinstance(secret, str) else secret
    return hashlib.sha256(raw).hexdigest()


def bearer_secret(authorization: str | None) -> bytes | None:
    """The secret of an `Authorization: Bearer <secret>` header (as http.auth.match_bearer
    reads it: only ASCII whitespace is padding), or None."""
    if not authorization or authorization[:7].lower() != "bearer ":
        return None
    return authorization[7:].strip(" \t\r\n\x0b\x0c").encode()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


# -- validation --------------------------------------------------------------------------------
def check_name(name: Any) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
        raise FieldError("name", f"must be a string of 1 to {MAX_NAME_CHARS} characters")
    if name == IDLE_KEY or not _NAME.match(name):
        raise FieldError(
            "name",
            "letters, digits and . _ : @ - only, starting with a letter or digit",
        )
    return name


def _int(field: str, value: Any) -> int | None:
    if value is None:
        return None
    lo, hi = LIMITS[field]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FieldError(field, f"must be an integer from {lo} to {hi} (or null), got {value!r}")
    return value


def check_fields(body: Mapping[str, Any], allowed: Iterable[str]) -> dict[str, Any]:
    """The body's fields as stored values (times aware UTC, models a JSON list); FieldError
    naming the first wrong field and what it allows."""
    allowed = tuple(allowed)
    out: dict[str, Any] = {}
    for field, value in body.items():
        if field not in allowed:
            raise FieldError(field, f"unknown field; allowed: {', '.join(allowed)}")
        if field in LIMITS:
            if field == "priority_class" and value is None:
                value = 0
            out[field] = _int(field, value)
        elif field == "owner":
            if value is not None and (
                not isinstance(value, str) or len(value) > 255 or not value.isprintable()
            ):
                raise FieldError(
                    field, "must be a printable string of at most 255 characters (or null)"
                )
            out[field] = value
        elif field == "expires_at":
            out[field] = None if value is None else parse_time(field, value, relative=False)
        elif field == "allowed_models":
            if value is not None:
                if (
                    not isinstance(value, list)
                    or not 1 <= len(value) <= MAX_MODELS
                    or not all(
                        isinstance(m, str) and 1 <= len(m) <= 255 and m.isprintable() for m in value
                    )
                ):
                    raise FieldError(
                        field,
                        f"must be a list of 1 to {MAX_MODELS} model names (or null: every model)",
                    )
                value = json.dumps(sorted(set(value)))
            out[field] = value
        elif field == "budget_usd":
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                # The range first: it compares an int of any size exactly, where isfinite
                # would raise OverflowError (a 500) on one too large for a float; NaN fails it.
                or not 0 <= value <= MAX_BUDGET_USD
                or not math.isfinite(value)
            ):
                raise FieldError(
                    field, f"must be a number from 0 to {MAX_BUDGET_USD:g} (or null), got {value!r}"
                )
            out[field] = None if value is None else float(value)
        elif field == "budget_period":
            if value is not None and value not in BUDGET_PERIODS:
                raise FieldError(field, f"must be one of {', '.join(BUDGET_PERIODS)} (or null)")
            out[field] = value
        elif field == "budget_action":
            if value is not None and value not in BUDGET_ACTIONS:
                raise FieldError(field, f"must be one of {', '.join(BUDGET_ACTIONS)} (or null)")
            out[field] = value
    return out


# -- the table ---------------------------------------------------------------------------------
def public(row: Mapping[str, Any]) -> dict[str, Any]:
    """A key as the admin API shows it: never its secret or hash."""

    def t(v: datetime | None) -> str | None:
        return None if v is None else v.astimezone(UTC).isoformat()

    models = row["allowed_models"]
    now = datetime.now(UTC)
    expired = row["expires_at"] is not None and row["expires_at"] <= now
    return {
        "name": row["name"],
        "prefix": row["prefix"],
        "owner": row["owner"],
        "created_at": t(row["created_at"]),
        "expires_at": t(row["expires_at"]),
        "revoked_at": t(row["revoked_at"]),
        "state": "revoked" if row["revoked_at"] is not None else "expired" if expired else "active",
        "allowed_models": None if models is None else json.loads(models),
        "limits": {k: row[k] for k in LIMITS if k != "priority_class"},
        "budget": {
            "budget_usd": row["budget_usd"],
            "budget_period": row["budget_period"],
            "budget_action": row["budget_action"],
        },
        "priority_class": row["priority_class"],
    }


def _flat(view: dict[str, Any]) -> dict[str, Any]:
    """A public view as field -> value (the audit rows' granularity)."""
    out = {k: v for k, v in view.items() if k not in ("limits", "budget", "name", "state")}
    return {**out, **view["limits"], **view["budget"]}


@dataclass(frozen=True, slots=True)
class Audit:
    """Who makes a change, for its audit rows (as a config change's)."""

    instance_id: str
    source: str
    actor: str | None


def _audit(conn: Connection, audit: Audit, name: str, changes: list[tuple[str, Any, Any]]) -> None:
    when = datetime.now(UTC)
    change_id = secrets.token_hex(16)
    write_changes(
        conn,
        audit.instance_id,
        [
            ConfigChange(
                when, audit.source, audit.actor, f"api_keys.{name}{field}", old, new, change_id
            )
            for field, old, new in changes
        ],
    )


class KeyStore:
    """The `api_keys` table: every change in one transaction with its audit rows."""

    def __init__(self, db: Engine) -> None:
        self.db = db

    def _row(self, conn: Connection, name: str) -> Mapping[str, Any]:
        row = conn.execute(select(API_KEYS).where(API_KEYS.c.name == name)).mappings().first()
        if row is None:
            raise KeyNotFoundError(name)
        return row

    def list(self) -> list[dict[str, Any]]:
        with self.db.connect() as conn:
            rows = conn.execute(select(API_KEYS).order_by(API_KEYS.c.name)).mappings().all()
        return [public(r) for r in rows]

    def get(self, name: str) -> dict[str, Any]:
        with self.db.connect() as conn:
            return public(self._row(conn, name))

    def create(
        self, body: Mapping[str, Any], audit: Audit, config_names: Iterable[str] = ()
    ) -> tuple[dict[str, Any], str]:
        """A new key: (its public view, its secret, shown this once)."""
        body = dict(body)
        name = check_name(body.pop("name", None))
        fields = check_fields(body, UPDATABLE)
        if name in set(config_names):
            raise KeyConflictError("name", f"{name!r} is a key of the config file ([[api_keys]])")
        secret = new_secret()
        now = datetime.now(UTC)
        values = {
            "name": name,
            "secret_hash": hash_secret(secret),
            "prefix": secret[:PREFIX_CHARS],
            "created_at": now,
            "updated_at": now,
            "priority_class": 0,
            **fields,
        }
        try:
            with self.db.begin() as conn:
                conn.execute(insert(API_KEYS).values(**values))
                view = public(self._row(conn, name))
                _audit(conn, audit, name, [("", None, _flat(view))])
        except IntegrityError:
            raise KeyConflictError("name", f"{name!r} exists already") from None
        return view, secret

    def update(self, name: str, body: Mapping[str, Any], audit: Audit) -> dict[str, Any]:
        fields = check_fields(body, UPDATABLE)
        with self.db.begin() as conn:
            old = public(self._row(conn, name))
            if fields:
                conn.execute(
                    update(API_KEYS)
                    .where(API_KEYS.c.name == name)
                    .values(**fields, updated_at=datetime.now(UTC))
                )
            new = public(self._row(conn, name))
            before, after = _flat(old), _flat(new)
            changed = [(f".{k}", before[k], after[k]) for k in after if before[k] != after[k]]
            if changed:
                _audit(conn, audit, name, changed)
        return new

    def rotate(self, name: str, audit: Audit) -> tuple[dict[str, Any], str]:
        """A new secret (shown this once); the old one stops (here at once, elsewhere within one
        refresh). A revoked key cannot be rotated (KeyConflictError)."""
        secret = new_secret()
        with self.db.begin() as conn:
            old = public(self._row(conn, name))
            if old["revoked_at"] is not None:
                raise KeyConflictError("name", f"{name!r} is revoked")
            conn.execute(
                update(API_KEYS)
                .where(API_KEYS.c.name == name)
                .values(
                    secret_hash=hash_secret(secret),
                    prefix=secret[:PREFIX_CHARS],
                    updated_at=datetime.now(UTC),
                )
            )
            new = public(self._row(conn, name))
            _audit(conn, audit, name, [(".prefix", old["prefix"], new["prefix"])])
        return new, secret

    def revoke(self, name: str, audit: Audit) -> tuple[dict[str, Any], bool]:
        """(the key, whether this revoked it: False when it was revoked already)."""
        with self.db.begin() as conn:
            old = public(self._row(conn, name))
            if old["revoked_at"] is not None:
                return old, False
            now = datetime.now(UTC)
            conn.execute(
                update(API_KEYS)
                .where(API_KEYS.c.name == name)
                .values(revoked_at=now, updated_at=now)
            )
            new = public(self._row(conn, name))
            _audit(conn, audit, name, [(".revoked_at", None, new["revoked_at"])])
        return new, True


# -- each daemon's copy ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LiveKey:
    """A table key as authentication needs it (the limits engineer reads the rest)."""

    name: str
    secret_hash: str
    expires_at: datetime | None
    allowed_models: tuple[str, ...] | None
    priority_class: int
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None
    max_tokens_per_request: int | None
    budget_usd: float | None
    budget_period: str | None
    budget_action: str | None


class KeyCache:
    """The table's keys in memory, reloaded whole every `refresh_s()` seconds (run_forever) and
    at once after a change made on this daemon (reload)."""

    def __init__(self) -> None:
        self._by_hash: dict[str, LiveKey] = {}
        self._by_name: dict[str, LiveKey] = {}
        self.names: frozenset[str] = frozenset()  # every row's name, revoked ones included
        self.closed = False  # the table has a row: the /v1 API needs a key
        self.loaded_at: float | None = None  # time.monotonic() of the last reload
        self.errors = 0
        # Loads overlap (the periodic one, an admin change's): each takes a ticket before it
        # reads, and a load that read before the last applied one is dropped, so a read from
        # before a change never overwrites one from after it (a revoke undone for a refresh).
        self._tickets = itertools.count(1)
        self._applied = 0
        self._lock = threading.Lock()

    def load(self, db: Engine) -> None:
        ticket = next(self._tickets)
        with db.connect() as conn:
            rows = conn.execute(select(API_KEYS)).mappings().all()
        by_hash = {}
        for r in rows:
            if r["revoked_at"] is not None:
                continue
            models = r["allowed_models"]
            by_hash[r["secret_hash"]] = LiveKey(
                name=r["name"],
                secret_hash=r["secret_hash"],
                expires_at=r["expires_at"],
                allowed_models=None if models is None else tuple(json.loads(models)),
                priority_class=r["priority_class"],
                **{k: r[k] for k in LIMITS if k != "priority_class"},
                budget_usd=r["budget_usd"],
                budget_period=r["budget_period"],
                budget_action=r["budget_action"],
            )
        with self._lock:
            if ticket < self._applied:
                return  # a later load's read is in force already
            self._applied = ticket
            # Swapped whole: a request sees the old copy or the new one, never a mix.
            self._by_hash = by_hash
            self._by_name = {key.name: key for key in by_hash.values()}
            self.names = frozenset(r["name"] for r in rows)
            self.closed = bool(rows)
            self.loaded_at = time.monotonic()

    def limits_of(self, name: str | None) -> dict[str, int | None] | None:
        """A live table key's own rate limits (None each: the [limits] default), or None for a
        config key, an open API or an unknown name: RateLimits' `overrides`."""
        key = self._by_name.get(name) if name is not None else None
        if key is None:
            return None
        return {f: getattr(key, f) for f in LIMIT_FIELDS}

    def priority_class_of(self, name: str) -> int:
        """A live table key's priority class; 0 (the first) for a config key or an unknown name."""
        key = self._by_name.get(name)
        return 0 if key is None else key.priority_class

    def key(self, name: str | None) -> LiveKey | None:
        """The live (not revoked) table key of this name, or None."""
        return self._by_name.get(name) if name is not None else None

    def live(self) -> list[LiveKey]:
        """Every live table key (the copy in force: a reload swaps it whole)."""
        return list(self._by_name.values())

    def lookup(self, given: bytes) -> LiveKey | None:
        """The live key whose secret `given` is (not revoked, not expired), or None."""
        digest = hashlib.sha256(given).hexdigest()
        key = self._by_hash.get(digest)
        if key is None or not hmac.compare_digest(digest, key.secret_hash):
            return None
        if key.expires_at is not None and key.expires_at <= datetime.now(UTC):
            return None
        return key

    async def reload(self, db: Engine | None) -> None:
        if db is None:
            return
        try:
            await asyncio.to_thread(self.load, db)
        except Exception as exc:  # the last copy stays in force; counted and logged
            self.errors += 1
            log.warning("api keys not reloaded (%s: %s)", type(exc).__name__, exc)

    async def run_forever(
        self, db: Callable[[], Engine | None], refresh_s: Callable[[], float]
    ) -> None:
        """Reloads every `refresh_s()` seconds (the first load is the caller's: reload)."""
        while True:
            await asyncio.sleep(refresh_s())
            await self.reload(db())


# -- failed authentication ---------------------------------------------------------------------
class AuthFailures:
    """At most `max_failures` distinct wrong keys per client address in `window_s` seconds;
    after that the address gets 429 (Retry-After: until its oldest failure leaves the window),
    a right key included. A wrong key sent again (a client with a stale key, retrying) is not
    another guess and is not counted again: a brute force is limited, a misconfigured client
    keeps its clean 401. In-process, per daemon; at most `max_addresses` remembered (the least
    recently failing forgotten first)."""

    def __init__(
        self, max_failures: int = 10, window_s: float = 10.0, max_addresses: int = 10_000
    ) -> None:
        self.max_failures, self.window_s, self.max_addresses = max_failures, window_s, max_addresses
        self._failures: OrderedDict[str, deque[tuple[float, str]]] = OrderedDict()
        self.refused = 0  # 429s answered

    def _recent(self, address: str, now: float) -> deque[tuple[float, str]] | None:
        times = self._failures.get(address)
        if times is None:
            return None
        while times and times[0][0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[address]
            return None
        return times

    def retry_after(self, address: str, now: float | None = None) -> int | None:
        """Seconds until `address` may try again; None: it may now."""
        now = time.monotonic() if now is None else now
        times = self._recent(address, now)
        if times is None or len(times) < self.max_failures:
            return None
        self.refused += 1
        return max(1, math.ceil(times[0][0] + self.window_s - now))

    def failed(self, address: str, given: bytes, now: float | None = None) -> None:
        """`address` sent the wrong key `given`."""
        now = time.monotonic() if now is None else now
        digest = hashlib.sha256(given).hexdigest()
        times = self._recent(address, now)
        if times is None:
            times = self._failures[address] = deque(maxlen=self.max_failures)
        elif any(d == digest for _, d in times):
            return
        times.append((now, digest))
        self._failures.move_to_end(address)
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)
