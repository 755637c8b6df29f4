"""`controlplane fleet ls`: the daemons sharing a database, from SQL (torch-free; the daemons
need not be reachable: an unreachable one is exactly what this shows)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import Any

from controlplane.reports_cli import _url, table_console

COLUMNS = (
    ("id", "instance"),
    ("advertise_url", "url"),
    ("state", "state"),
    ("model", "model"),
    ("num_running", "run"),
    ("num_waiting", "wait"),
    ("kv_usage", "KV"),
    ("output_tokens_per_s", "tok/s"),
    ("ttft_p50_s", "TTFT p50"),
    ("heartbeat_age_s", "heartbeat"),
)
STATE_STYLE = {"unreachable": "bold red", "draining": "yellow", "loading": "cyan"}


def add_fleet_parser(subparsers: Any) -> None:
    fleet = subparsers.add_parser("fleet", help="the daemons sharing this database")
    sub = fleet.add_subparsers(dest="fleet_command", required=True)
    ls = sub.add_parser(
        "ls",
        help="list every instance, worst first (unreachable, draining, loading, serving, stopped)",
    )
    ls.add_argument("--format", choices=["table", "json"], default="table")
    ls.add_argument(
        "--all", action="store_true", help="also instances stopped more than an hour ago"
    )
    where = ls.add_mutually_exclusive_group()
    where.add_argument("--config", help="TOML config file (its store URL and fleet ages)")
    where.add_argument(
        "--url", "--db", dest="url", help="database URL (default: the config's store.url)"
    )
    ls.set_defaults(func=_ls)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "kv_usage":
        return f"{value * 100:.0f}%"
    if key == "output_tokens_per_s":
        return f"{value:.1f}"
    if key == "ttft_p50_s":
        return f"{value * 1000:.0f} ms"
    if key == "heartbeat_age_s":
        return f"{value:.0f}s ago"
    return str(value)


def _ls(args: argparse.Namespace) -> int:
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.pool import NullPool

    from controlplane.config import load_config
    from controlplane.store.db import make_engine, sqlite_path
    from controlplane.store.fleet import INSTANCES, members

    cfg = load_config(args.config)
    url = _url(args)
    path = sqlite_path(url)
    found = []
    if path is None or path.exists():  # never create an empty database file
        engine = make_engine(url, poolclass=NullPool)
        try:
            if inspect(engine).has_table(INSTANCES.name):
                found = members(
                    engine,
                    now=datetime.now(UTC),
                    unreachable_after_s=cfg.fleet.unreachable_after_s,
                    include_stopped=args.all,
                )
        except SQLAlchemyError as exc:
            print(f"controlplane fleet: database error: {exc}", file=sys.stderr)
            return 1
        finally:
            engine.dispose()
    if args.format == "json":
        print(json.dumps({"instances": [m.to_dict() for m in found]}, indent=2))
        return 0
    if not found:
        print("no instances in this database (none has started on it; --all: long stopped too)")
        return 0
    from rich.table import Table

    table = Table()
    for _, header in COLUMNS:
        table.add_column(header)
    for m in found:
        row = m.to_dict()
        cells = [_cell(key, row[key]) for key, _ in COLUMNS]
        if m.unreachable_since is not None:
            cells[2] = f"unreachable since {m.unreachable_since:%H:%M:%S}"
        table.add_row(*cells, style=STATE_STYLE.get(m.state))
    table_console().print(table)
    return 0
