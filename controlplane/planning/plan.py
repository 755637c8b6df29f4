"""`controlplane plan`: the config and the number of instances a window's traffic needs at a
growth factor and an SLO, searched with the simulator.

The search: candidate configs around the base one (max_num_seqs halved to quadrupled, the token
budget from 256 to 2,048 tokens with the prefill chunk at most the budget, recompute and swap
preemption). For a candidate and k instances, the window's requests are dealt round-robin to k
instances (a load balancer's even split), each instance's share arrives `growth` times faster
than recorded, and each is simulated; the candidate serves at k when every instance's TTFT and
ITL p99 are within the targets. The smallest such k (up to MAX_INSTANCES) is the candidate's
count; the best candidate needs the fewest instances, then costs least per million tokens.
Headroom: how far below each target the worst instance's p99 stays at that count.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from controlplane.engine.settings import EngineSettings
from controlplane.planning.costmodel import CostModel
from controlplane.planning.simulate import simulate
from controlplane.planning.summary import Figures, Slo, replay_figures
from controlplane.planning.window import PlanningError
from controlplane.planning.workload import Workload

MAX_INSTANCES = 64


@dataclass(frozen=True, slots=True)
class Candidate:
    settings: EngineSettings
    instances: int | None  # None: not within the targets at MAX_INSTANCES
    worst: Figures | None  # the slowest instance's figures at that count
    cost_per_hour_usd: float | None
    cost_per_mtok_usd: float | None

    @property
    def knobs(self) -> dict[str, object]:
        s = self.settings
        return {
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "prefill_chunk_size": s.prefill_chunk_size,
            "preemption_mode": s.preemption_mode,
        }


def candidates(base: EngineSettings) -> list[EngineSettings]:
    seqs = sorted({max(1, min(1024, base.max_num_seqs * f // 2)) for f in (1, 2, 4, 8)})
    out = []
    for n in seqs:
        for budget in (256, 512, 1024, 2048):
            for mode in ("recompute", "swap"):
                out.append(
                    dataclasses.replace(
                        base,
                        max_num_seqs=n,
                        max_num_batched_tokens=budget,
                        prefill_chunk_size=min(budget, base.prefill_chunk_size),
                        preemption_mode=mode,
                    )
                )
    return out


def _split(workload: Workload, k: int) -> list[Workload]:
    return [Workload(workload.requests[i::k], 0, 0) for i in range(k) if workload.requests[i::k]]


def _within(f: Figures, slo: Slo) -> bool:
    """Every request served, and the p99s within the targets (Slo's rule, on the p99s)."""
    return f.failed == 0 and slo.met_ms(f.ttft_p99_ms, f.itl_p99_ms)


def evaluate(
    workload: Workload,
    settings: EngineSettings,
    cost: CostModel,
    growth: float,
    slo: Slo,
    hourly_usd: float,
) -> Candidate:
    """The fewest instances of `settings` that hold `slo` for `workload` at `growth`."""
    for k in range(1, MAX_INSTANCES + 1):
        figures = [
            replay_figures(simulate(part, settings, cost, f"x{k}", speed=growth), slo, hourly_usd)
            for part in _split(workload, k)
        ]
        if all(_within(f, slo) for f in figures):
            worst = max(figures, key=lambda f: (f.ttft_p99_ms or 0.0, f.itl_p99_ms or 0.0))
            per_hour = k * hourly_usd
            # Computed tokens, as the rollup's GPU view counts them (cached prompt tokens free).
            tokens = sum(
                f.prompt_tokens * (1 - (f.prefix_hit_rate or 0.0)) + f.completion_tokens
                for f in figures
            )
            span_h = max(1e-9, workload.requests[-1].offset_s / growth / 3600)
            per_mtok = per_hour * span_h / tokens * 1e6 if tokens else None
            return Candidate(settings, k, worst, per_hour, per_mtok)
    return Candidate(settings, None, None, None, None)


def plan(
    workload: Workload,
    base: EngineSettings,
    cost: CostModel,
    growth: float,
    slo: Slo,
    hourly_usd: float,
) -> list[Candidate]:
    """Every candidate evaluated, best first (PlanningError without a target)."""
    if not slo.any:
        raise PlanningError(
            "no latency target: give --slo ttft_p99=...,itl_p99=... (or set the config's "
            "[autopilot] targets)"
        )
    if not 0 < growth < math.inf:
        raise PlanningError(f"--growth must be a positive number, got {growth:g}")
    found = [evaluate(workload, s, cost, growth, slo, hourly_usd) for s in candidates(base)]
    return sorted(
        found,
        key=lambda c: (
            c.instances is None,
            c.instances or 0,
            c.cost_per_mtok_usd if c.cost_per_mtok_usd is not None else math.inf,
        ),
    )


def headroom(c: Candidate, slo: Slo) -> dict[str, float | None]:
    """1 - p99 / target of the worst instance, per target (None without that target)."""
    f = c.worst
    out: dict[str, float | None] = {"ttft": None, "itl": None}
    if f is None:
        return out
    if slo.ttft_ms > 0 and f.ttft_p99_ms is not None:
        out["ttft"] = 1 - f.ttft_p99_ms / slo.ttft_ms
    if slo.itl_ms > 0 and f.itl_p99_ms is not None:
        out["itl"] = 1 - f.itl_p99_ms / slo.itl_ms
    return out
