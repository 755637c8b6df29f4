"""The autopilot's look before it moves a knob (autopilot.simulate_first): the step the policy
chose, simulated on the last window of traffic (controlplane/planning/whatif.py), is taken only
where the simulator predicts that it helps what it aims at; otherwise the knob is vetoed for
this decision and the policy picks again (the next knob, or a hold that says why).

Both columns it compares are simulated (the settings in force and the step), on the same
requests and the same cost model, so the cost model's bias cancels where it prices both alike;
the recorded figures are not the baseline (they were measured, not simulated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controlplane.autopilot.policy import Decision, Targets

if TYPE_CHECKING:
    from controlplane.planning.summary import Figures

# A step is taken when the simulator predicts the latency it aims at lower by at least this
# fraction: a smaller predicted gain is inside the cost model's error.
MIN_GAIN = 0.02


def aimed_at(decision: Decision) -> str | None:
    """The figure a step means to lower: ITL p99 (an ITL miss, or both missed), TTFT p99 (a
    TTFT miss), or None (targets met with headroom: more throughput within the targets)."""
    if decision.reason.startswith(("itl", "both")):
        return "itl_p99_ms"
    if decision.reason.startswith("ttft"):
        return "ttft_p99_ms"
    return None


def measured(figures: Figures, metric: str) -> float | None:
    """`metric` of `figures` as the autopilot measures it: ITL p99 over every inter-token gap
    where the simulation kept them (a prefill chunk stalls one gap of many requests: the p99
    of their mean gaps barely moves, and a benchmark run that judged by it vetoed the chunk
    steps that fixed an ITL miss), else the figure itself."""
    if metric == "itl_p99_ms" and figures.itl_gap_p99_ms is not None:
        return figures.itl_gap_p99_ms
    return getattr(figures, metric)


def _name(metric: str) -> str:
    return metric.removesuffix("_ms").replace("_", " ")  # itl_p99_ms -> "itl p99"


def prediction(decision: Decision, now: Figures, step: Figures) -> str | None:
    """What the simulator predicted for the figure the step aims at (TTFT p99 for a throughput
    step), `simulated itl p99 140 -> 96 ms`; None where a figure is missing."""
    metric = aimed_at(decision) or "ttft_p99_ms"
    before, after = measured(now, metric), measured(step, metric)
    if before is None or after is None:
        return None
    return f"simulated {_name(metric)} {before:,.0f} -> {after:,.0f} ms"


def verdict(decision: Decision, now: Figures, step: Figures, targets: Targets) -> str | None:
    """None where the simulated step helps (or the simulation cannot tell); else why not."""
    metric = aimed_at(decision)
    if metric is not None:
        before, after = measured(now, metric), measured(step, metric)
        if before is None or after is None or after <= before * (1 - MIN_GAIN):
            return None
        return f"{prediction(decision, now, step)}, no gain"
    for metric, target in (
        ("ttft_p99_ms", targets.ttft_p99_ms),
        ("itl_p99_ms", targets.itl_p99_ms),
    ):
        after = measured(step, metric)
        if target and after is not None and after > target:
            return (
                f"simulated {_name(metric)} {after:,.0f} ms would miss the {target:,.0f} ms target"
            )
    return None
