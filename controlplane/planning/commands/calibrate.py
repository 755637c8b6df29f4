"""`controlplane calibrate`: the simulator's cost model, fit on this machine for a config's engine
(docs/planning.md#the-simulator)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from controlplane.planning.commands.common import command


def add_calibrate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit the simulator's cost model on this machine for a config's engine",
        description="Serve a designed mix of requests through the engine a config builds and fit "
        "a step's cost to what it scheduled (docs/planning.md#the-simulator).",
    )
    p.add_argument("--config", help="the config whose [engine] to calibrate (default: embedded)")
    p.add_argument("--out", required=True, help="where to write the cost model (JSON)")
    p.set_defaults(func=command("calibrate", _calibrate))


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
