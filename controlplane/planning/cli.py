"""`controlplane replay` (a window of recorded requests driven again against proposed configs,
side by side with what was recorded), `controlplane calibrate` (the simulator's cost model)
and `controlplane plan` (config and instances for a growth factor at an SLO): docs/planning.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.planning.window import MAX_ROWS, PlanningError, Window

if TYPE_CHECKING:
    from controlplane.config import Config
    from controlplane.engine.settings import EngineSettings
    from controlplane.planning.costmodel import CostModel
    from controlplane.planning.replay import ReplayRun
    from controlplane.planning.summary import Figures, Slo
    from controlplane.planning.workload import Workload


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


def _window_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose the records (replay and plan alike)."""
    p.add_argument("--since", default="24h", help="window start: 24h, 7d, 30m or an ISO time (UTC)")
    p.add_argument("--until", help="window end (default: now)")
    p.add_argument("--key", help="only this API key's requests")
    p.add_argument("--model", help="the served model whose rows to replay (when several)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--db", help="database URL of the records (default: the embedded store)")
    where.add_argument("--db-config", help="a daemon's config file: its store URL")
    p.add_argument(
        "--slo",
        type=_slo,
        help="targets, e.g. ttft_p99=2s,itl_p99=100ms (default: the first config's [autopilot] "
        "targets)",
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


def add_replay_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay recorded requests against proposed configs, side by side with what "
        "was recorded",
        description=__doc__,
    )
    _window_flags(p)
    p.add_argument(
        "--config",
        action="append",
        required=True,
        help="a proposed config file (TOML; its [engine] section); repeat to compare several",
    )
    p.add_argument(
        "--speed",
        type=_speed,
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
    p.set_defaults(func=_command("replay", _run))


def _command(
    name: str, run: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """`run` as a command: a PlanningError is one line on stderr and exit status 2."""

    def command(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except PlanningError as exc:
            print(f"controlplane {name}: {exc}", file=sys.stderr)
            return 2

    return command


def _progress(what: str) -> Callable[[int, int], None]:
    """A one-line progress counter on stderr (a terminal only: no noise in a pipe)."""
    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        if tty:
            end = "\n" if done >= total else ""
            print(f"\r{what}: {done:,} / {total:,}", end=end, file=sys.stderr, flush=True)

    return report


@dataclass(slots=True)
class _Setup:
    window: Window
    configs: list[tuple[str, Config]]
    slo: Slo
    hourly_usd: float


def _setup(args: argparse.Namespace) -> _Setup:
    """The window of records the flags name, the configs, the yardstick (PlanningError)."""
    import sqlalchemy as sa

    from controlplane.common import parse_time
    from controlplane.config import load_config, served_model_name_of
    from controlplane.errors import FieldError
    from controlplane.planning.summary import Slo
    from controlplane.planning.window import read_window

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
    for label, cfg in configs:
        served = served_model_name_of(cfg)
        if served != window.model and not args.other_model:
            raise PlanningError(
                f"the window's requests were served by {window.model}; {label} serves {served}: "
                "replaying them on another model says little (pass --other-model to do it anyway)"
            )
    first = configs[0][1]
    slo = (
        Slo(*args.slo) if args.slo else Slo(first.autopilot.ttft_p99_ms, first.autopilot.itl_p99_ms)
    )
    hourly = first.jobs.gpu_hourly_usd * max(1, first.jobs.num_gpus)
    return _Setup(window, configs, slo, hourly)


def _simulated_workload(
    setup: _Setup, settings: EngineSettings, cost: CostModel, seed: int
) -> Workload:
    """The window as a workload for the simulator: the model's shape from its config alone (no
    weights loaded), the cost model checked against this machine and model."""
    from controlplane.engine.simulation import model_shape
    from controlplane.planning.costmodel import fingerprint_of_settings
    from controlplane.planning.workload import build_workload

    cost.check(fingerprint_of_settings(settings))
    shape = model_shape(settings)
    return build_workload(setup.window, shape.vocab_size, shape.max_model_len, seed)


def _run(args: argparse.Namespace) -> int:
    from controlplane.config import serving_settings
    from controlplane.planning.costmodel import CostModel
    from controlplane.planning.replay import engine_for, replay
    from controlplane.planning.simulate import simulate
    from controlplane.planning.summary import recorded_figures, replay_figures, table
    from controlplane.planning.workload import build_workload

    setup = _setup(args)
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
                           args.admin_token, _progress(f"replaying on {args.url}"))
            )  # fmt: skip
            notes += run.notes
        elif cost is not None:
            workload = _simulated_workload(setup, settings, cost, args.seed)
            run = simulate(workload, settings, cost, label, args.speed, progress=None)
        else:
            engine = engine_for(settings)
            workload = build_workload(
                window, engine.model_config.vocab_size, engine.max_model_len, args.seed
            )
            run = asyncio.run(
                replay(workload, engine, label, args.speed, _progress(f"replaying {label}"))
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
                    "window": _window_json(window),
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


def _window_json(window: Window) -> dict[str, Any]:
    return {
        "since": window.since.isoformat(),
        "until": window.until.isoformat(),
        "model": window.model,
        "requests": len(window.rows),
        "skipped": window.skipped,
    }


# -- controlplane calibrate ---------------------------------------------------------------------
def add_calibrate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit the simulator's cost model on this machine for a config's engine",
        description="Serve a designed mix of requests through the engine a config builds and fit "
        "a step's cost to what it scheduled (docs/planning.md#the-simulator).",
    )
    p.add_argument("--config", help="the config whose [engine] to calibrate (default: embedded)")
    p.add_argument("--out", required=True, help="where to write the cost model (JSON)")
    p.set_defaults(func=_command("calibrate", _calibrate))


def _calibrate(args: argparse.Namespace) -> int:
    from controlplane.config import load_config, serving_settings
    from controlplane.planning.costmodel import calibrate
    from controlplane.planning.replay import engine_for

    engine = engine_for(serving_settings(load_config(args.config)))
    print("calibrating (about a minute) ...", file=sys.stderr, flush=True)
    try:
        cost = calibrate(engine)
    finally:
        engine.close()
    cost.save(args.out)
    print(
        f"{args.out}: base {cost.base_s * 1e3:.2f} ms a step, "
        f"{cost.per_prefill_token_s * 1e6:.1f} us a prompt token, "
        f"{cost.per_decode_row_s * 1e6:.1f} us a decode row, "
        f"{cost.per_context_kilotoken_s * 1e3:.3f} ms per 1,000 context tokens "
        f"(rms error {cost.rms_error_s * 1e3:.2f} ms over {cost.samples} steps)"
    )
    return 0


# -- controlplane plan --------------------------------------------------------------------------
def add_plan_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="the best config and the instances a window's traffic needs at a growth factor "
        "and an SLO (simulated)",
        description="docs/planning.md#plan",
    )
    _window_flags(p)
    p.add_argument("--config", action="append", required=True, help="the base config (TOML)")
    p.add_argument("--cost-model", required=True, help="a cost model from `controlplane calibrate`")
    p.add_argument("--growth", type=float, default=1.0, help="traffic multiplier (default 1)")
    p.add_argument("--top", type=int, default=5, help="candidates listed (default 5)")
    p.set_defaults(func=_command("plan", _plan), speed=1.0)


def _plan(args: argparse.Namespace) -> int:
    from controlplane.config import serving_settings
    from controlplane.planning.costmodel import CostModel
    from controlplane.planning.plan import MAX_INSTANCES, headroom, plan

    setup = _setup(args)
    cost = CostModel.load(args.cost_model)
    base = serving_settings(setup.configs[0][1])
    workload = _simulated_workload(setup, base, cost, args.seed)
    found = plan(workload, base, cost, args.growth, setup.slo, setup.hourly_usd)
    best = found[0]
    if args.json:
        print(
            json.dumps(
                {
                    "window": _window_json(setup.window),
                    "growth": args.growth,
                    "slo": {"ttft_p99_ms": setup.slo.ttft_ms, "itl_p99_ms": setup.slo.itl_ms},
                    "candidates": [
                        {
                            **c.knobs,
                            "instances": c.instances,
                            "cost_per_hour_usd": c.cost_per_hour_usd,
                            "cost_per_mtok_usd": c.cost_per_mtok_usd,
                            "headroom": headroom(c, setup.slo),
                            "worst_instance": c.worst.as_dict() if c.worst else None,
                        }
                        for c in found[: args.top]
                    ],
                },
                indent=2,
            )
        )
        return 0
    w = setup.window
    print(
        f"{len(w.rows):,} requests of {w.model} ({w.since:%Y-%m-%d %H:%M} to "
        f"{w.until:%Y-%m-%d %H:%M} UTC) at {args.growth:g}x, targets TTFT p99 "
        f"{setup.slo.ttft_ms:g} ms, ITL p99 {setup.slo.itl_ms:g} ms"
    )
    if best.instances is None:
        print(f"no candidate holds the targets with up to {MAX_INSTANCES} instances")
        return 1
    room = headroom(best, setup.slo)
    knobs = ", ".join(f"{k} = {v}" for k, v in best.knobs.items())
    print(f"best: {knobs}")
    print(
        f"instances: {best.instances}, ${best.cost_per_hour_usd:,.2f} an hour, "
        f"${best.cost_per_mtok_usd:,.4f} per million tokens"
    )
    print(
        "headroom (worst instance): "
        + ", ".join(f"{k} {v:.0%}" for k, v in room.items() if v is not None)
    )
    print(
        f"{'max_num_seqs':>12} {'budget':>7} {'chunk':>6} {'preempt':>9} {'instances':>9} {'$/M tok':>9}"
    )
    for c in found[: args.top]:
        k = c.knobs
        n = "–" if c.instances is None else str(c.instances)
        usd = "–" if c.cost_per_mtok_usd is None else f"{c.cost_per_mtok_usd:.4f}"
        print(
            f"{k['max_num_seqs']:>12} {k['max_num_batched_tokens']:>7} "
            f"{k['prefill_chunk_size']:>6} {k['preemption_mode']:>9} {n:>9} {usd:>9}"
        )
    return 0
