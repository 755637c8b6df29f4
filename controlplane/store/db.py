"""Engines for the request store: SQLite (the default, a file under data_dir) or PostgreSQL."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import NullPool

SQLITE_BUSY_TIMEOUT_MS = 10_000
PG_CONNECT_TIMEOUT_S = 10


def normalize_url(url: str | URL) -> URL:
    """Parse `url`; plain `postgresql://` (and `postgres://`) means psycopg 3, not psycopg2."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def sqlite_path(url: str | URL) -> Path | None:
    """The database file of a SQLite URL; None for other backends and in-memory databases."""
    u = normalize_url(url)
    if u.get_backend_name() != "sqlite":
        return None
    db = u.database
    if not db or db == ":memory:" or db.startswith("file:") or u.query.get("uri"):
        return None
    return Path(db)


def _sqlite_on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    try:
        # WAL: readers (the admin API, the TUI) never block the recorder's writes and vice versa.
        cur.execute("PRAGMA journal_mode=WAL")
        # NORMAL is durable against process crashes in WAL mode; only a power loss can lose the
        # last transactions, which is fine for request telemetry and much cheaper than FULL.
        cur.execute("PRAGMA synchronous=NORMAL")
        # Wait for another writer's lock instead of failing at once with "database is locked".
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        # SQLite ignores foreign keys unless asked, per connection.
        cur.execute("PRAGMA foreign_keys=ON")
    finally:
        cur.close()


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An Engine for `url`; extra keyword arguments go to `sqlalchemy.create_engine`."""
    u = normalize_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        path = sqlite_path(u)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(u, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    if backend == "postgresql":
        if "connect_timeout" not in u.query:
            # libpq waits forever by default; an unreachable server must fail, not hang.
            connect_args = {"connect_timeout": PG_CONNECT_TIMEOUT_S}
            connect_args.update(kwargs.pop("connect_args", {}))
            kwargs["connect_args"] = connect_args
        # pre_ping: a pooled connection that died while the database restarted is replaced at
        # checkout instead of failing the next write.
        kwargs.setdefault("pool_pre_ping", True)
        return create_engine(u, **kwargs)
    raise ValueError(f"unsupported database {u.drivername!r}: use sqlite:/// or postgresql://")


class StoreUnavailableError(RuntimeError):
    """The store cannot be opened at start: its driver is not installed, or the database is
    unreachable. The message is one line naming the URL (password hidden) and the fix."""


def check_store(url: str | URL) -> None:
    """Load the driver and connect once, so a start that cannot reach its database fails with
    one clear line (StoreUnavailableError) instead of a traceback from deep in a migration.
    Only for start-up: at run time the recorder buffers and retries instead."""
    u = normalize_url(url)
    shown = u.render_as_string(hide_password=True)
    path = sqlite_path(u)
    if u.get_backend_name() == "sqlite" and (path is None or not path.exists()):
        return  # the standard library's driver; connecting would create an empty file
    driver = u.get_driver_name()
    try:
        engine = make_engine(u, poolclass=NullPool)
    except (ImportError, sa_exc.NoSuchModuleError) as exc:  # the dialect imports its driver
        fix = (
            "pip install 'controlplane[postgres]'"
            if driver == "psycopg"
            else f"install the {driver} driver, or use postgresql+psycopg:// "
            "with pip install 'controlplane[postgres]'"
        )
        raise StoreUnavailableError(
            f"store {shown}: the database driver {driver!r} is not installed ({exc}); {fix}"
        ) from None
    try:
        with engine.connect():
            pass
    except sa_exc.DBAPIError as exc:
        # The driver's message, on one line (psycopg's has a hint on a second line).
        detail = " ".join(line.strip() for line in str(exc.orig).splitlines() if line.strip())
        if u.password:
            detail = detail.replace(str(u.password), "***")
        raise StoreUnavailableError(
            f"cannot connect to the store at {shown}: {detail}; check that the database is "
            "up and store.url (CONTROLPLANE_STORE__URL) is right"
        ) from None
    finally:
        engine.dispose()


def dialect_insert(dialect_name: str) -> Any:
    """The dialect's `insert` construct, which has on_conflict_do_update / _do_nothing."""
    if dialect_name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect_name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise ValueError(f"unsupported database dialect {dialect_name!r}")
    return insert
