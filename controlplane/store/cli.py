"""`controlplane db ...`: schema management for the request store."""

from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy import make_url


def _url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url
    from controlplane.config import load_config

    return load_config(args.config).store_url


def _shown(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from controlplane.store import migrate
    from controlplane.store.db import check_store

    url = _url(args)
    check_store(url)  # a missing driver or an unreachable database: one line, no traceback
    before = migrate.current(url)
    migrate.upgrade(url, args.revision)
    after = migrate.current(url)
    if before == after:
        print(f"{_shown(url)}: already at revision {after}, nothing to do")
    else:
        print(f"{_shown(url)}: upgraded from {before or '<empty>'} to {after}")
    return 0


def _cmd_current(args: argparse.Namespace) -> int:
    from controlplane.store import migrate
    from controlplane.store.db import check_store

    url = _url(args)
    check_store(url)  # a missing driver or an unreachable database: one line, no traceback
    rev = migrate.current(url)
    head = migrate.head()
    if rev is None:
        print(f"{_shown(url)}: no schema (run `controlplane db upgrade`); latest is {head}")
    elif rev == head:
        print(f"{_shown(url)}: {rev} (head)")
    else:
        print(f"{_shown(url)}: {rev} (behind head {head}: run `controlplane db upgrade`)")
    return 0


def add_db_parser(subparsers: Any) -> None:
    """Add `db upgrade` and `db current` to the CLI's subparsers (sets `func` like the others)."""
    db = subparsers.add_parser("db", help="manage the request store's database schema")
    sub = db.add_subparsers(dest="db_command", required=True)
    up = sub.add_parser("upgrade", help="migrate the database to the latest schema")
    up.add_argument("revision", nargs="?", default="head", help="target revision (default: head)")
    up.set_defaults(func=_cmd_upgrade)
    cur = sub.add_parser("current", help="show the database's schema revision")
    cur.set_defaults(func=_cmd_current)
    for p in (up, cur):
        p.add_argument("--config", help="TOML config file (its store URL is used)")
        p.add_argument("--url", help="database URL (default: from the config, store.url)")
