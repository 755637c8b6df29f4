"""`controlplane replay`: a window of recorded requests driven again against proposed configs,
printed side by side with what was recorded (docs/planning.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from controlplane.planning.window import MAX_ROWS, PlanningError


def _speed(value: str) -> float:
    if value == "max":
        return math.inf
    try:
        speed = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or max, got {value!r}") from None
    if not 0 < speed < math.inf:
        raise argparse.ArgumentTypeError(f"must be positive, got {value!r}")
    return speed


def _slo(value: str) -> tuple[float, float]:
    """`ttft_p99=2s,itl_p99=100ms` -> (ttft ms, itl ms); 0 for a target left out."""
    targets = {"ttft_p99": 0.0, "itl_p99": 0.0}
    for part in filter(None, (p.strip() for p in value.split(","))):
        name, _, amount = part.partition("=")
        if name not in targets:
            raise argparse.ArgumentTypeError(f"unknown target {name!r}: ttft_p99, itl_p99")
        amount = amount.strip().lower()
        scale = 1.0
        if amount.endswith("ms"):
            amount = amount[:-2]
        elif amount.endswith("s"):
            amount, scale = amount[:-1], 1000.0
        try:
            targets[name] = float(amount) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: a duration like 2s or 100ms") from None
    return targets["ttft_p99"], targets["itl_p99"]


def add_replay_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay recorded requests against proposed configs, side by side with what "
        "was recorded",
        description=__doc__,
    )
    p.add_argument("--since", default="24h", help="window start: 24h, 7d, 30m or an ISO time (UTC)")
    p.add_argument("--until", help="window end (default: now)")
    p.add_argument("--key", help="only this API key's requests")
    p.add_argument("--model", help="the served model whose rows to replay (when several)")
    p.add_argument(
        "--config",
        action="append",
        required=True,
        help="a proposed config file (TOML; its [engine] section); repeat to compare several",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--db", help="database URL of the records (default: the embedded store)")
    where.add_argument("--db-config", help="a daemon's config file: its store URL")
    p.add_argument(
        "--speed",
        type=_speed,
        default=1.0,
        help="arrivals this many times faster than recorded, or max (all at once; no cost)",
    )
    p.add_argument(
        "--slo",
        type=_slo,
        help="targets for SLO attainment, e.g. ttft_p99=2s,itl_p99=100ms (default: the first "
        "config's [autopilot] targets)",
    )
    p.add_argument(
        "--other-model",
        action="store_true",
        help="replay on a config that serves another model than the recorded one",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the replayed prompts' token ids")
    p.add_argument(
        "--max-rows",
        type=int,
        default=MAX_ROWS,
        help=f"refuse a window of more rows than this (default {MAX_ROWS:,})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=_cmd_replay)


def _cmd_replay(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except PlanningError as exc:
        print(f"controlplane replay: {exc}", file=sys.stderr)
        return 2


def _progress(what: str) -> Callable[[int, int], None]:
    """A one-line progress counter on stderr (a terminal only: no noise in a pipe)."""
    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        if tty:
            end = "\n" if done >= total else ""
            print(f"\r{what}: {done:,} / {total:,}", end=end, file=sys.stderr, flush=True)

    return report


def _run(args: argparse.Namespace) -> int:
    import sqlalchemy as sa

    from controlplane.common import parse_time
    from controlplane.config import default_model, load_config, served_model_name_of
    from controlplane.errors import FieldError
    from controlplane.planning.replay import engine_for, replay, with_model
    from controlplane.planning.summary import Slo, recorded_figures, replay_figures, table
    from controlplane.planning.window import read_window
    from controlplane.planning.workload import build_workload

    now = datetime.now(UTC)
    try:
        since = parse_time("since", args.since, now=now)
        until = parse_time("until", args.until, now=now) if args.until else now
        configs = [(Path(c).name, load_config(c)) for c in args.config]
    except FieldError as exc:
        raise PlanningError(f"--{exc.field}: {exc.message}") from None
    except (OSError, ValueError) as exc:
        raise PlanningError(str(exc)) from None
    url = args.db or load_config(args.db_config).store_url
    db = sa.create_engine(url)
    try:
        window = read_window(
            db,
            since,
            until,
            key=args.key,
            model=args.model,
            max_rows=args.max_rows,
            progress=_progress("reading rows"),
        )
    except sa.exc.DBAPIError as exc:
        where = db.url.render_as_string(hide_password=True)
        raise PlanningError(
            f"cannot read the records at {where}: {str(exc.orig).strip()} (a controlplane "
            "store? --db or --db-config names it)"
        ) from None
    finally:
        db.dispose()
    first = configs[0][1]
    slo = (
        Slo(*args.slo) if args.slo else Slo(first.autopilot.ttft_p99_ms, first.autopilot.itl_p99_ms)
    )
    hourly = first.jobs.gpu_hourly_usd * max(1, first.jobs.num_gpus)
    columns = [recorded_figures(window, slo, hourly)]
    notes: list[str] = []
    for label, cfg in configs:
        served = served_model_name_of(cfg)
        if served != window.model and not args.other_model:
            raise PlanningError(
                f"the window's requests were served by {window.model}; {label} serves {served}: "
                "replaying them on another model says little (pass --other-model to do it anyway)"
            )
        engine = engine_for(with_model(cfg.engine, default_model(cfg)))
        workload = build_workload(
            window, engine.model_config.vocab_size, engine.max_model_len, args.seed
        )
        if workload.unmatched_prefix_tokens:
            notes.append(
                f"{workload.unmatched_prefix_tokens:,} recorded cached prompt tokens had no "
                "earlier prompt in the window to share (served as misses)"
            )
        run = asyncio.run(
            replay(workload, engine, label, args.speed, _progress(f"replaying {label}"))
        )
        columns.append(replay_figures(run, slo, hourly))
    if args.json:
        print(
            json.dumps(
                {
                    "window": {
                        "since": window.since.isoformat(),
                        "until": window.until.isoformat(),
                        "model": window.model,
                        "requests": len(window.rows),
                        "skipped": window.skipped,
                    },
                    "slo": {"ttft_p99_ms": slo.ttft_ms, "itl_p99_ms": slo.itl_ms},
                    "speed": None if math.isinf(args.speed) else args.speed,
                    "figures": [c.as_dict() for c in columns],
                    "notes": sorted(set(notes)),
                },
                indent=2,
            )
        )
        return 0
    print(
        f"{len(window.rows):,} requests of {window.model} from {window.since:%Y-%m-%d %H:%M} to "
        f"{window.until:%Y-%m-%d %H:%M} UTC, replayed at "
        + ("max speed" if math.isinf(args.speed) else f"{args.speed:g}x")
    )
    print(table(columns))
    for why, n in window.skipped.items():
        print(f"left out: {n:,} rows {why}")
    for c in columns:
        for why, n in c.errors.items():
            print(f"{c.label}: {n:,} failed: {why}")
    for note in sorted(set(notes)):
        print(f"note: {note}")
    return 0
