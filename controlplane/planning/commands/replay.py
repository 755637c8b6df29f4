"""`controlplane replay`: a window of recorded requests driven again against proposed configs (an
engine in this process, a running daemon by --url, or the simulator), side by side with what
was recorded (docs/planning.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.planning.commands.common import (
    command,
    progress,
    read_setup,
    simulated_workload,
    speed_arg,
    window_flags,
    window_json,
)
from controlplane.planning.window import PlanningError, Window

if TYPE_CHECKING:
    from controlplane.planning.replay import ReplayRun
    from controlplane.planning.summary import Figures


def add_replay_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay recorded requests against proposed configs, side by side with what "
        "was recorded",
        description=__doc__,
    )
    window_flags(p)
    p.add_argument(
        "--config",
        action="append",
        required=True,
        help="a proposed config file (TOML; its [engine] section); repeat to compare several",
    )
    p.add_argument(
        "--speed",
        type=speed_arg,
        default=1.0,
        help="arrivals this many times faster than recorded, or max (all at once; no cost)",
    )
    p.add_argument(
        "--url",
        help="replay against the daemon running there (streamed /v1/completions, timed by the "
        "client) instead of an engine in this process; --config then names that daemon's "
        "config (its model, targets and price)",
    )
    p.add_argument("--api-key", help="bearer key for --url's /v1 requests")
    p.add_argument(
        "--admin-token", help="admin token for --url's /admin/stats (peak KV use, preemptions)"
    )
    p.add_argument(
        "--report",
        metavar="HTML",
        help="also write the table and latency-over-time plots to this HTML file",
    )
    p.add_argument(
        "--simulate",
        metavar="COST_MODEL",
        help="simulate on a cost model from `controlplane calibrate` instead of running the "
        "engine (seconds, not the window's duration)",
    )
    p.set_defaults(func=command("replay", _run))


def _run(args: argparse.Namespace) -> int:
    from controlplane.config import serving_settings
    from controlplane.planning.costmodel import CostModel
    from controlplane.planning.replay import engine_for, replay
    from controlplane.planning.simulate import simulate
    from controlplane.planning.summary import recorded_figures, replay_figures, table
    from controlplane.planning.workload import build_workload

    setup = read_setup(args)
    window, slo, hourly = setup.window, setup.slo, setup.hourly_usd
    cost = CostModel.load(args.simulate) if args.simulate else None
    columns = [recorded_figures(window, slo, hourly)]
    runs = []
    notes: list[str] = []
    if args.url and (cost is not None or len(setup.configs) != 1):
        raise PlanningError(
            "--url replays against one daemon: give its one --config, no --simulate"
        )
    for label, cfg in setup.configs:
        settings = serving_settings(cfg)
        if args.url:
            from controlplane.engine.simulation import model_shape
            from controlplane.planning.remote import replay_url

            shape = model_shape(settings)
            workload = build_workload(window, shape.vocab_size, shape.max_model_len, args.seed)
            run = asyncio.run(
                replay_url(workload, args.url, args.url, args.speed, args.api_key,
                           args.admin_token, progress(f"replaying on {args.url}"))
            )  # fmt: skip
            notes += run.notes
        elif cost is not None:
            workload = simulated_workload(setup, settings, cost, args.seed)
            run = simulate(workload, settings, cost, label, args.speed, progress=None)
        else:
            engine = engine_for(settings)
            workload = build_workload(
                window, engine.model_config.vocab_size, engine.max_model_len, args.seed
            )
            run = asyncio.run(
                replay(workload, engine, label, args.speed, progress(f"replaying {label}"))
            )
        if workload.unmatched_prefix_tokens:
            notes.append(
                f"{workload.unmatched_prefix_tokens:,} recorded cached prompt tokens had no "
                "earlier prompt in the window to share (served as misses)"
            )
        columns.append(replay_figures(run, slo, hourly))
        runs.append(run)
    if cost is not None:
        notes.append(
            f"simulated on the cost model {args.simulate} (no speculation, no grammar masks)"
        )
    if args.json:
        if args.report:
            _write_report(args.report, "replay", window, columns, runs, sorted(set(notes)))
        print(
            json.dumps(
                {
                    "window": window_json(window),
                    "slo": {"ttft_p99_ms": slo.ttft_ms, "itl_p99_ms": slo.itl_ms},
                    "speed": None if math.isinf(args.speed) else args.speed,
                    "simulated": cost is not None,
                    "figures": [c.as_dict() for c in columns],
                    "notes": sorted(set(notes)),
                },
                indent=2,
            )
        )
        return 0
    heading = (
        f"{len(window.rows):,} requests of {window.model} from {window.since:%Y-%m-%d %H:%M} to "
        f"{window.until:%Y-%m-%d %H:%M} UTC, "
        + ("simulated" if cost is not None else "replayed")
        + " at "
        + ("max speed" if math.isinf(args.speed) else f"{args.speed:g}x")
    )
    if args.report:
        _write_report(args.report, heading, window, columns, runs, sorted(set(notes)))
    print(heading)
    print(table(columns))
    for why, n in window.skipped.items():
        print(f"left out: {n:,} rows {why}")
    for c in columns:
        for why, n in c.errors.items():
            print(f"{c.label}: {n:,} failed: {why}")
    for note in sorted(set(notes)):
        print(f"note: {note}")
    return 0


def _write_report(
    path: str,
    heading: str,
    window: Window,
    columns: list[Figures],
    runs: list[ReplayRun],
    notes: list[str],
) -> None:
    from controlplane.planning.report import html_report, recorded_series, run_series

    series = [recorded_series(window), *(run_series(r) for r in runs)]
    text = html_report(heading, columns, [t for t, _ in series], [i for _, i in series], notes)
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise PlanningError(f"--report {path}: {exc.strerror}") from None
    print(f"report: {path}", file=sys.stderr)
