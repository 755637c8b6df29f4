"""`controlplane plan`: the best config and the instances a window's traffic needs at a growth
factor and an SLO, searched with the simulator (docs/planning.md#plan)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from controlplane.planning.commands.common import (
    command,
    read_setup,
    simulated_workload,
    window_flags,
    window_json,
)


def add_plan_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="the best config and the instances a window's traffic needs at a growth factor "
        "and an SLO (simulated)",
        description="docs/planning.md#plan",
    )
    window_flags(p)
    p.add_argument("--config", action="append", required=True, help="the base config (TOML)")
    p.add_argument("--cost-model", required=True, help="a cost model from `controlplane calibrate`")
    p.add_argument("--growth", type=float, default=1.0, help="traffic multiplier (default 1)")
    p.add_argument("--top", type=int, default=5, help="candidates listed (default 5)")
    p.set_defaults(func=command("plan", _plan), speed=1.0)


def _plan(args: argparse.Namespace) -> int:
    from controlplane.config import serving_settings
    from controlplane.planning.costmodel import CostModel
    from controlplane.planning.plan import MAX_INSTANCES, headroom, plan

    setup = read_setup(args)
    cost = CostModel.load(args.cost_model)
    base = serving_settings(setup.configs[0][1])
    workload = simulated_workload(setup, base, cost, args.seed)
    found = plan(workload, base, cost, args.growth, setup.slo, setup.hourly_usd)
    best = found[0]
    if args.json:
        print(
            json.dumps(
                {
                    "window": window_json(setup.window),
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
