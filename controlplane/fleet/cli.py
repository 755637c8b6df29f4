"""`controlplane fleet ls | apply | drain | resume`: the daemons sharing a database (torch-free).

`ls` reads SQL only (the daemons need not be reachable: an unreachable one is exactly what it
shows); `apply`, `drain` and `resume` find the instances in SQL and act through each one's
own admin API with the fleet's admin token (controlplane.fleet.actions).

Exit status of `apply`: 0 applied on every instance in the fleet; 1 applied nowhere (an
instance refused it, naming the field, or could not be asked); 2 applied, but not everywhere
(an instance unreachable, still loading, or failing as it applied).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from controlplane.accounting.cli import _url, table_console

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
    _where(ls)
    ls.set_defaults(func=_ls)
    apply = sub.add_parser(
        "apply",
        help="apply one config change to every live instance (validated by all before any applies)",
    )
    apply.add_argument(
        "file", help='TOML or JSON of the fields to change ([engine] max_num_seqs = 16; "-": stdin)'
    )
    apply.add_argument("--format", choices=["table", "json"], default="table")
    _where(apply, token=True)
    apply.set_defaults(func=_apply)
    for action, what in (
        ("drain", "stop admitting new requests on one instance (running ones finish)"),
        ("resume", "admit requests again on a drained instance"),
    ):
        p = sub.add_parser(action, help=what)
        p.add_argument("instance", help="instance id (or a unique prefix of it, or its URL)")
        _where(p, token=True)
        p.set_defaults(func=_admission, action=action)


def _where(p: argparse.ArgumentParser, token: bool = False) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", help="TOML config file (its store URL, data dir, fleet ages)")
    where.add_argument(
        "--url", "--db", dest="url", help="database URL (default: the config's store.url)"
    )
    if token:
        p.add_argument(
            "--token",
            help="admin token for every instance (default: CONTROLPLANE_ADMIN_TOKEN, "
            "else <data_dir>/admin_token)",
        )


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


def _members(args: argparse.Namespace, include_stopped: bool = False) -> list[Any]:
    """The fleet from SQL; SystemExit(1) with the database's error."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.pool import NullPool

    from controlplane.config import load_config
    from controlplane.fleet.registry import INSTANCES, members
    from controlplane.store.db import make_engine, sqlite_path

    cfg = load_config(args.config)
    url = _url(args)
    path = sqlite_path(url)
    if path is not None and not path.exists():  # never create an empty database file
        return []
    engine = make_engine(url, poolclass=NullPool)
    try:
        if not inspect(engine).has_table(INSTANCES.name):
            return []
        return members(
            engine,
            now=datetime.now(UTC),
            unreachable_after_s=cfg.fleet.unreachable_after_s,
            include_stopped=include_stopped,
        )
    except SQLAlchemyError as exc:
        raise SystemExit(f"controlplane fleet: database error: {exc}") from None
    finally:
        engine.dispose()


def _token(args: argparse.Namespace) -> str | None:
    from controlplane.client.token import resolve_token
    from controlplane.config import load_config

    env = {**os.environ, "CONTROLPLANE_DATA_DIR": str(load_config(args.config).data_path)}
    return resolve_token(args.token, env)


def _ls(args: argparse.Namespace) -> int:
    from controlplane.fleet.registry import config_drift

    found = _members(args, include_stopped=args.all)
    drift = config_drift(found)
    if args.format == "json":
        body = {"instances": [m.to_dict() for m in found], "config_drift": drift}
        print(json.dumps(body, indent=2))
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
    for key, d in drift.items():
        odd = ", ".join(f"{i} = {v!r}" for i, v in d["instances"].items())
        print(f"config drift: {key}: most have {d['majority']!r}; {odd}")
    return 0


def read_changes(path: str) -> dict[str, Any]:
    """The fields to change from a TOML or JSON file ("-": JSON or TOML on stdin); ValueError
    naming the file for anything else."""
    import tomllib

    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        body = json.loads(text) if text.lstrip().startswith("{") else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: neither JSON nor TOML ({exc})") from None
    if not isinstance(body, dict) or not body:
        raise ValueError(f"{path}: no fields to change (want e.g. [engine] max_num_seqs = 16)")
    return body


def _apply(args: argparse.Namespace) -> int:
    import asyncio

    from controlplane.fleet.actions import APPLIED, apply_change, fleet_summary

    try:
        changes = read_changes(args.file)
    except (OSError, ValueError) as exc:
        print(f"controlplane fleet apply: {exc}", file=sys.stderr)
        return 1
    result = asyncio.run(apply_change(_members(args), changes, _token(args)))
    if args.format == "json":
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from rich.table import Table

        table = Table()
        for header in ("instance", "url", "outcome", "detail"):
            table.add_column(header)
        for o in result.instances:
            if o.outcome == APPLIED:
                detail = ", ".join(
                    f"{c['field']} {c['old']} -> {c['new']}" for c in o.changed or []
                )
            else:
                detail = f"{o.param}: {o.detail}" if o.param else o.detail or ""
            style = None if o.outcome == APPLIED else "bold red"
            table.add_row(o.instance, o.url, o.outcome, detail or "no change", style=style)
        if result.instances:
            table_console().print(table)
        print(fleet_summary(result), file=sys.stderr if result.partial else sys.stdout)
    if not any(o.outcome == APPLIED for o in result.instances):
        return 1
    return 2 if result.partial else 0


def _admission(args: argparse.Namespace) -> int:
    import asyncio

    from controlplane.client.admin import ClientError
    from controlplane.fleet.actions import find_member, set_admission

    try:
        target = find_member(_members(args), args.instance)
        answer = asyncio.run(set_admission(target, _token(args), args.action))
    except (LookupError, ClientError) as exc:
        print(f"controlplane fleet {args.action}: {exc}", file=sys.stderr)
        return 1
    print(f"{target.id} ({target.advertise_url}): {answer.get('state')}")
    return 0
