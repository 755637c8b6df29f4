"""Alembic environment for the request store.

Run through `controlplane.store.migrate` (or `controlplane db upgrade`), which passes the
database URL in `config.attributes["url"]`. Plain `alembic` from the repository root works too
(alembic.ini); the URL then comes from `-x url=...`, else from the controlplane config
(defaults plus CONTROLPLANE_* environment overrides, e.g. CONTROLPLANE_STORE__URL).
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.pool import NullPool

from controlplane.store.db import make_engine, normalize_url
from controlplane.store.migrate import MIGRATION_LOCK_ID
from controlplane.store.models import Base, UTCDateTime

config = context.config
if config.config_file_name is not None:  # plain `alembic` with alembic.ini: its logging
    fileConfig(config.config_file_name, disable_existing_loggers=False)
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        from controlplane.config import load_config

        url = load_config().store_url
    return url


def _render_item(type_: str, obj: object, autogen_context: object) -> str | bool:
    # Migrations spell the column type plainly; UTC handling lives in the models, not the schema.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        render_item=_render_item,
        **kwargs,
    )


def run_migrations_offline() -> None:
    url = normalize_url(_url())
    _configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.get_backend_name() == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_online(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # SQLite cannot ALTER most things: batch mode recreates the table instead, which with
        # foreign keys enforced would fail (or cascade) for referenced tables. The pragma only
        # takes effect outside a transaction, hence the commit.
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.commit()
    _configure(connection=connection, render_as_batch=sqlite)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Daemons of a fleet starting together on an empty database would otherwise race
            # each other's CREATE TABLE: one migrates, the others wait here, then find the
            # schema at head and do nothing. (SQLite: a file lock in store/migrate.py.)
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_ID})")
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_online(connection)
        return
    engine = make_engine(_url(), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            _run_online(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
