"""`controlplane report cost|requests|utilization`: reports, straight from SQL.

Reads only the database, so it works while the daemon is down. Torch-free (and cheap to
import): the store and rich are imported when a report runs.

    controlplane report cost --since 7d --group-by day,model,api_key
    controlplane report requests --since 7d --group-by user
    controlplane report cost --since 2026-03-01 --until 2026-04-01 --format csv
    controlplane report utilization --since 24h --group-by hour,instance --format json

    controlplane report cost --since 10m --group-by api_key,end_user
    controlplane report requests --since 24h --group-by api_key   # throttled, budget use

`--format table` (the default) prints a table with a totals row; `csv` prints a header and the
rows (no totals row, so scripts can sum columns); `json` prints {"columns", "rows", "totals",
"since", "until"}, and for cost {"source", "scope", "instance_id"} too. A cost window of 1
minute to 24 hours that is not whole UTC hours (or grouped by end_user) is exact, from the
request rows ("source": "requests"); others read the hourly rollups ("rollups", whole hours);
the title and since / until say which window was used. `--instance ID` counts one instance. Cost rows that include requests the rollup has not counted yet have
`provisional` true (`*` in the table, explained in a footnote). With no data in the window, `table` prints a sentence saying so; `csv` and
`json` print their empty document and the sentence goes to stderr. Either way the exit status
is 0. Bad flags exit with status 2 and name the flag; an unreachable database exits with 1.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

# Kept in step with controlplane.accounting.reports (not imported here: that pulls in SQLAlchemy).
_GROUPS = {
    "cost": ("day", "hour", "model", "api_key", "end_user"),
    "requests": ("day", "hour", "model", "api_key", "user"),
    "utilization": ("day", "hour", "instance"),
}
_DEFAULTS = {
    "cost": ("7d", "day,model,api_key"),
    "requests": ("7d", "day,user"),
    "utilization": ("24h", "hour"),
}
_EMPTY_HINT = {
    "cost": "is the daemon running with store.record_requests = true and have rollups run?",
    "requests": "is the daemon running with store.record_requests = true?",
    "utilization": "is the daemon running (it samples every jobs.utilization_interval_s)?",
}
# Where a group column missing from one report lives instead.
_ELSEWHERE = {
    ("cost", "user"): "the end user is `end_user` here (windows of up to 24 h, from the request "
    "rows); `controlplane report requests --group-by user` reaches back as far as the rows",
}
# What each report reads: tables, and columns added by later migrations.
_NEEDED_TABLES = {
    "cost": {"cost_rollups"},
    "requests": {"requests"},
    "utilization": {"utilization_samples", "gpu_samples"},
}
# A report on a database one migration short would fail on the missing column: it gets the
# "not migrated" sentence instead.
_NEEDED_COLUMNS = {
    "cost": (("cost_rollups", "cache_savings_usd"),),  # migration 0005
    "requests": (("requests", "end_user"),),  # migration 0004
    "utilization": (("utilization_samples", "prefix_cache_hit_rate"),),  # migration 0005
}


def _time_arg(flag: str) -> Callable[[str], str]:
    """Checks a --since / --until value; `_run` reads it (against one "now" for both bounds,
    so `--since 24h` is exactly 24 hours)."""

    def parse(value: str) -> str:
        from controlplane.common import parse_report_time
        from controlplane.errors import FieldError

        try:
            parse_report_time(flag, value)
        except FieldError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
        return value

    return parse


def _group_arg(kind: str) -> Callable[[str], list[str]]:
    allowed = _GROUPS[kind]

    def parse(value: str) -> list[str]:
        names = [n.strip() for n in value.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad:
            hint = _ELSEWHERE.get((kind, bad[0]))
            raise argparse.ArgumentTypeError(
                f"unknown column {bad[0]!r}; use any of {', '.join(allowed)}"
                + (f" ({hint})" if hint else "")
            )
        if "day" in names and "hour" in names:
            raise argparse.ArgumentTypeError("day and hour exclude each other")
        return [n for n in allowed if n in names]

    return parse


def _url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url
    from controlplane.config import load_config

    return load_config(args.config).store_url


def _shown(at: str, seconds: bool = False) -> str:
    fmt = "%Y-%m-%d %H:%M:%S UTC" if seconds else "%Y-%m-%d %H:%M UTC"
    return datetime.fromisoformat(at).astimezone(UTC).strftime(fmt)


def _window_note(report: Any) -> str:
    """What a cost report's window is and where it was read from (the table's title)."""
    if report.source == "requests":
        note = (
            "exact window, from the request rows; GPU cost and utilization are kept per whole hour"
        )
    else:
        note = "whole UTC hours, from the hourly rollups"
    if report.scope == "instance":
        note += f"; instance {report.instance_id} only"
    return note


def _empty_sentence(kind: str, since: str, until: str) -> str:
    return f"no {kind} data between {_shown(since)} and {_shown(until)}; {_EMPTY_HINT[kind]}"


# -- rendering ----------------------------------------------------------------------------------

_HEADERS = {
    "api_key": "API key",
    "end_user": "end user",
    "requests": "requests",
    "token_share": "tok share",
    "mean_ttft_s": "TTFT s",
    "mean_e2e_latency_s": "latency s",
    "requests_succeeded": "ok",
    "requests_failed": "failed",
    "prompt_tokens": "prompt tok",
    "cached_prompt_tokens": "cached tok",
    "cached_share": "cached",
    "cache_savings_usd": "cache saved $",
    "completion_tokens": "compl. tok",
    "list_cost_usd": "list $",
    "list_usd_per_mtok_prompt": "list $/M prompt",
    "list_usd_per_mtok_completion": "list $/M compl.",
    "gpu_cost_usd": "GPU $",
    "gpu_usd_per_mtok": "GPU $/M tok",
    "mean_utilization": "util",
    "mfu": "MFU",
    "covered_s": "covered",
    "mean_busy_fraction": "busy",
    "mean_kv_usage": "KV",
    "mean_batch_fill_seqs": "fill seqs",
    "mean_batch_fill_tokens": "fill tok",
    "mean_prefix_cache_hit_rate": "prefix hit",
    "mean_spec_acceptance_rate": "spec accept",
    "mean_prefill_tokens_per_s": "prefill tok/s",
    "mean_decode_tokens_per_s": "decode tok/s",
    "mean_queue_length": "queue",
    "mean_num_running": "running",
    "mean_gpu_utilization_pct": "GPU util",
    "mean_gpu_power_w": "GPU W",
    "max_gpu_temperature_c": "GPU max °C",
    "gpu_energy_j": "GPU kWh",
    "provisional": "*",
    "throttled": "throttled",
    "throttled_by_reason": "throttled by reason",
    "budget_usd": "budget $",
    "budget_period": "period",
    "budget_spend_usd": "spent $",
    "budget_use": "budget use",
}
_FOOTNOTE = (
    "* provisional: requests the hourly rollup has not counted yet, summed from the request "
    "rows (GPU cost as of the last rollup); final after the next rollup "
    "(jobs.rollup_interval_s, and at daemon shutdown)"
)
_PERCENT = {
    "cached_share",
    "token_share",
    "mean_prefix_cache_hit_rate",
    "mean_spec_acceptance_rate",
    "mean_utilization",
    "mfu",
    "mean_busy_fraction",
    "mean_kv_usage",
    "mean_batch_fill_seqs",
    "mean_batch_fill_tokens",
    "budget_use",
}


def _cell(column: str, value: Any) -> str:
    if column == "provisional":
        return "*" if value else ""
    if value is None:
        return "-"
    if column == "api_key":
        return value or "(no key)"
    if column in ("user", "end_user"):
        return value or "(no user)"
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # throttled_by_reason
        return ", ".join(f"{reason} {n:,}" for reason, n in value.items())
    if column in _PERCENT:
        return f"{value * 100:.1f}%"
    if column == "mean_gpu_utilization_pct":
        return f"{value:.1f}%"
    if column == "gpu_energy_j":
        return f"{value / 3.6e6:.3f}"
    if column == "covered_s":
        return f"{value / 3600:.2f} h"
    if column.startswith("mean_") and column.endswith("_s"):
        return f"{value:.3f}"
    if column.endswith("_usd"):
        return f"{value:,.4f}"
    if column.endswith("_per_mtok") or "_per_mtok_" in column:
        return f"{value:,.4f}"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.2f}"


def table_console() -> Any:
    """A rich Console for tables: a terminal's own width; piped, no wrapping to a guessed one."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 400))


def _print_table(report: Any) -> None:
    from rich.table import Table

    console = table_console()
    # The title is printed on its own: as a table title rich pads it to the console width.
    exact = report.source == "requests"
    title = f"{report.kind} report, {_shown(report.since, exact)} to {_shown(report.until, exact)}"
    if report.source is not None:
        title += f" ({_window_note(report)})"
    console.print(title, style="bold", highlight=False, soft_wrap=True)
    table = Table()
    # From the request rows the hourly-only figures are all empty: not shown in the table.
    hidden = {"gpu_cost_usd", "gpu_usd_per_mtok", "mean_utilization", "mfu", "provisional"}
    columns = [c for c in report.columns if not (exact and c in hidden)]
    for column in columns:
        grouped = column in report.group_by
        table.add_column(
            _HEADERS.get(column, column),
            justify="left" if grouped else "right",
            no_wrap=True,
        )
    for row in report.rows:
        table.add_row(*(_cell(c, row[c]) for c in columns))
    table.add_section()
    labels = ["total"] + [""] * (len(report.group_by) - 1) if report.group_by else []
    table.add_row(
        *labels,
        *(_cell(c, report.totals.get(c)) for c in columns[len(report.group_by) :]),
        style="bold",
    )
    console.print(table)
    if report.totals.get("provisional"):
        console.print(_FOOTNOTE, highlight=False, soft_wrap=True)


def _csv_value(value: Any) -> Any:
    if isinstance(value, bool):  # as in JSON, not Python's True / False
        return "true" if value else "false"
    if isinstance(value, dict):  # throttled_by_reason: reason=count;reason=count
        return ";".join(f"{k}={v}" for k, v in value.items())
    return "" if value is None else value


def _print_csv(report: Any) -> None:
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(report.columns)
    for row in report.rows:
        writer.writerow([_csv_value(row[c]) for c in report.columns])


def _print_json(report: Any) -> None:
    keys = ("columns", "rows", "totals", "since", "until", "source", "scope", "instance_id")
    doc = {k: v for k, v in report.to_dict().items() if k in keys}
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


# -- the command --------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    from controlplane.common import parse_report_time
    from controlplane.errors import FieldError

    kind = args.report_kind
    now = datetime.now(UTC)
    since = parse_report_time("since", args.since, now=now)
    until = parse_report_time("until", args.until, now=now) if args.until else now
    if not since < until:
        args.report_parser.error(
            f"argument --since: must be before --until ({since.isoformat()} >= {until.isoformat()})"
        )

    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.pool import NullPool

    from controlplane.accounting import reports
    from controlplane.store.db import make_engine, sqlite_path

    extra: dict[str, Any] = {}
    if kind == "cost":
        try:
            source, start, end = reports.cost_window(since, until, args.group_by)
        except FieldError as exc:
            flag = "--" + exc.field.replace("_", "-")
            args.report_parser.error(f"argument {flag}: {exc.message}")
        extra = {"source": "auto", "instance_id": args.instance}

    url = _url(args)
    build = {
        "cost": reports.cost_report,
        "requests": reports.requests_report,
        "utilization": reports.utilization_report,
    }[kind]
    path = sqlite_path(url)
    schema_ok = path is None or path.exists()  # never create an empty database file
    report = None
    if schema_ok:
        engine = make_engine(url, poolclass=NullPool)
        try:
            schema_ok = _has_schema(inspect(engine), kind)
            if schema_ok:
                report = build(engine, since=since, until=until, group_by=args.group_by, **extra)
        except SQLAlchemyError as exc:
            print(f"controlplane report: database error: {exc}", file=sys.stderr)
            return 1
        finally:
            engine.dispose()
    if report is None:  # no database or no schema yet: an empty report of the same shape
        if kind != "cost":
            start, end, _, _ = reports.window(since, until)
        columns = {
            "cost": [*args.group_by, *reports.COST_METRICS],
            "requests": reports.request_columns(args.group_by),
            "utilization": [*args.group_by, *reports.UTILIZATION_METRICS],
        }[kind]
        metrics = columns[len(args.group_by) :]
        report = reports.Report(
            kind=kind,
            group_by=args.group_by,
            columns=columns,
            rows=[],
            totals={**dict.fromkeys(metrics), **({"provisional": False} if kind == "cost" else {})},
            since=start.isoformat(),
            until=end.isoformat(),
            empty=True,
            **(
                {
                    "source": source,
                    "scope": "fleet" if args.instance is None else "instance",
                    "instance_id": args.instance,
                }
                if kind == "cost"
                else {}
            ),
        )
    if report.empty:
        sentence = _empty_sentence(kind, report.since, report.until)
        if report.source is not None:
            sentence += f" ({_window_note(report)})"
        if not schema_ok:
            sentence += (
                " (the database is not migrated for this report yet: `controlplane db upgrade`)"
            )
        if args.format == "table":
            print(sentence)
            return 0
        print(sentence, file=sys.stderr)
    {"table": _print_table, "csv": _print_csv, "json": _print_json}[args.format](report)
    return 0


def _has_schema(inspector: Any, kind: str) -> bool:
    """Whether the database has what the report reads (not migrated far enough: no)."""
    if not _NEEDED_TABLES[kind] <= set(inspector.get_table_names()):
        return False
    return all(
        column in {c["name"] for c in inspector.get_columns(table)}
        for table, column in _NEEDED_COLUMNS.get(kind, ())
    )


def add_report_parser(subparsers: Any) -> None:
    """Add `report cost|requests|utilization` to the CLI's subparsers (sets `func`)."""
    report = subparsers.add_parser(
        "report", help="cost and utilization reports from the database (daemon not needed)"
    )
    sub = report.add_subparsers(dest="report_kind", required=True)
    helps = {
        "cost": "list-price and GPU-amortized cost by day|hour, model and API key",
        "requests": "requests, tokens, list cost and latency by day|hour, model, API key and "
        "user, from the request rows; by API key also the requests refused (per hour) and "
        "each key's budget use",
        "utilization": "engine and GPU utilization by day|hour and instance",
    }
    for kind in ("cost", "requests", "utilization"):
        since, group_by = _DEFAULTS[kind]
        p = sub.add_parser(kind, help=helps[kind], description=helps[kind])
        p.add_argument(
            "--since",
            type=_time_arg("since"),
            default=since,  # a string default goes through `type` when the flag is absent
            help=f"start: a duration back from now (24h, 7d, 30m, 2w) or an ISO date/time, "
            f"UTC (default {since})"
            + (
                "; a window of 1 minute to 24 hours that is not whole UTC hours is exact (from "
                "the request rows), longer ones are read from the hourly rollups (whole hours)"
                if kind == "cost"
                else ""
            ),
        )
        p.add_argument("--until", type=_time_arg("until"), help="end: like --since (default: now)")
        p.add_argument(
            "--group-by",
            type=_group_arg(kind),
            default=group_by,
            help=f"comma-separated: {' | '.join(_GROUPS[kind])} (day and hour exclude each "
            f"other; default {group_by})",
        )
        if kind == "cost":
            p.add_argument(
                "--instance",
                metavar="ID",
                help="only this instance's requests (its instance id; default: every instance "
                "on the database, the fleet)",
            )
        p.add_argument("--format", choices=["table", "csv", "json"], default="table")
        where = p.add_mutually_exclusive_group()
        where.add_argument("--config", help="TOML config file (its store URL is used)")
        where.add_argument("--url", help="database URL (default: from the config, store.url)")
        p.set_defaults(func=_run, report_parser=p)
