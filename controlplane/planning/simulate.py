"""A replay without the model, in seconds: the workload through the engine's own scheduler on a
virtual clock (controlplane/engine/simulation.py) that the cost model advances, returned as the
ReplayRun a real replay returns, so that the same summary judges both."""

from __future__ import annotations

import math
from collections.abc import Callable

from controlplane.engine.settings import EngineSettings
from controlplane.engine.simulation import SimRequest, run_schedule, with_block_size
from controlplane.planning.costmodel import CostModel
from controlplane.planning.replay import ReplayRun, Served
from controlplane.planning.workload import Workload


def simulate(
    workload: Workload,
    settings: EngineSettings,
    cost: CostModel,
    label: str,
    speed: float = 1.0,
    num_kv_blocks: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayRun:
    """`workload` through `settings`' scheduler on the cost model's clock (its KV budget the
    calibrated engine's unless the settings or `num_kv_blocks` say otherwise; arrivals `speed`
    times faster, all at once for inf); `wall_s` is the virtual span."""
    blocks = num_kv_blocks or settings.num_kv_blocks or cost.num_kv_blocks
    settings = with_block_size(settings, cost.block_size)
    pending = sorted(workload.requests, key=lambda r: r.offset_s)
    requests = [
        SimRequest(0.0 if math.isinf(speed) else r.offset_s / speed, r.prompt, r.max_tokens, r.n)
        for r in pending
    ]
    result = run_schedule(
        requests,
        settings,
        cost.step_s,
        blocks,
        settings.swap_space_bytes // cost.kv_bytes_per_block,
        progress,
    )
    served = [
        Served(
            req,
            ok=result.finished[i],
            error=result.errors.get(i),
            metrics=result.metrics[i],
            completion_tokens=result.metrics[i].num_output_tokens if result.finished[i] else 0,
        )
        for i, req in enumerate(pending)
    ]
    return ReplayRun(
        label=label,
        settings=settings,
        speed=speed,
        served=served,
        wall_s=result.wall_s,
        peak_kv_usage=result.peak_kv_usage,
        preemptions=result.preemptions,
        gaps=result.gaps,
    )
