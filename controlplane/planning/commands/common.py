"""What the planning commands share: the flags that choose a window of records and the setup they
read (the window, the configs, the SLO, the price), the wrapper that turns a PlanningError into
one line and exit status 2, and a progress counter."""

from __future__ import annotations

import argparse
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
    from controlplane.planning.summary import Slo
    from controlplane.planning.workload import Workload


def speed_arg(value: str) -> float:
    if value == "max":
        return math.inf
    try:
        speed = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or max, got {value!r}") from None
    if not 0 < speed < math.inf:
        raise argparse.ArgumentTypeError(f"must be positive, got {value!r}")
    return speed


def slo_targets(value: str) -> tuple[float, float]:
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


def window_flags(p: argparse.ArgumentParser) -> None:
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
        type=slo_targets,
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


def command(
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


def progress(what: str) -> Callable[[int, int], None]:
    """A one-line progress counter on stderr (a terminal only: no noise in a pipe)."""
    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        if tty:
            end = "\n" if done >= total else ""
            print(f"\r{what}: {done:,} / {total:,}", end=end, file=sys.stderr, flush=True)

    return report


@dataclass(slots=True)
class Setup:
    window: Window
    configs: list[tuple[str, Config]]
    slo: Slo
    hourly_usd: float


def read_setup(args: argparse.Namespace) -> Setup:
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
            progress=progress("reading rows"),
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
    return Setup(window, configs, slo, hourly)


def simulated_workload(
    setup: Setup, settings: EngineSettings, cost: CostModel, seed: int
) -> Workload:
    """The window as a workload for the simulator: the model's shape from its config alone (no
    weights loaded), the cost model checked against this machine and model."""
    from controlplane.engine.simulation import model_shape
    from controlplane.planning.costmodel import fingerprint_of_settings
    from controlplane.planning.workload import build_workload

    cost.check(fingerprint_of_settings(settings))
    shape = model_shape(settings)
    return build_workload(setup.window, shape.vocab_size, shape.max_model_len, seed)


def window_json(window: Window) -> dict[str, Any]:
    return {
        "since": window.since.isoformat(),
        "until": window.until.isoformat(),
        "model": window.model,
        "requests": len(window.rows),
        "skipped": window.skipped,
    }
