"""What a change of the live knobs would do to the traffic this daemon has just served: its
recent request rows simulated twice, under the settings in force and under the change, on a
cost model fit from the engine's own recent steps. POST /admin/simulate answers with it; the
TUI's tuning form shows it beside the preview, and the autopilot may ask it before a step.

The cost model here is fit live (no calibration run): each recent step that did work is a
sample (what the scheduler put in the step, and its time: inside the step, plus the loop's
typical time around a step, so that it prices the whole loop as `calibrate` measures it). A
live daemon's steps vary less than the calibration's designed mix (a quiet one decodes a few
rows over and over), so the fit can say little about batch sizes it has not run: the answer
carries its sample count and error, and the proposed column is a prediction, not a measurement
(docs/planning.md#what-if).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controlplane.planning.costmodel import CostModel, StepSample
from controlplane.planning.simulate import simulate
from controlplane.planning.summary import Figures, Slo, recorded_figures, replay_figures
from controlplane.planning.window import PlanningError, Window
from controlplane.planning.workload import build_workload

if TYPE_CHECKING:
    from controlplane.engine.settings import EngineSettings
    from controlplane.engine.types import StepStats

# The live knobs the simulator models (the scheduler's); others (the queue's length, the
# autopilot's targets, speculation) change nothing in a simulation and are listed as such.
SIMULATED = frozenset(
    {
        "engine.max_num_seqs",
        "engine.max_num_batched_tokens",
        "engine.prefill_chunk_size",
        "engine.preemption_mode",
        "engine.enable_prefix_caching",
        "engine.scheduling_policy",
    }
)
MIN_SAMPLES = 32  # steps that did work before a fit is worth showing
# Two steps ran back to back when the time between their ends exceeds the second's own
# duration by at most this much (the loop handing outputs over); a longer gap was idle.
BACK_TO_BACK_S = 0.05


def samples_of(steps: list[StepStats]) -> list[StepSample]:
    """The cost samples in `steps` (oldest first): each step that did work, priced by its time
    inside the engine's step plus the loop's median time around a step (between the end of
    one step and the start of the next, over the pairs that ran back to back). The median, not
    each pair's own gap: a gap that a request's arrival stretched (the HTTP handlers and the
    step thread share the interpreter) would otherwise price a step at many times its cost."""
    gaps = sorted(
        step.time - before.time - step.step_duration
        for before, step in itertools.pairwise(steps)
        if step.step == before.step + 1
        and _worked(step)
        and 0.0 <= step.time - before.time - step.step_duration <= BACK_TO_BACK_S
    )
    around = gaps[len(gaps) // 2] if gaps else 0.0
    return [
        StepSample(
            s.num_prefill_tokens,
            s.num_decode_tokens,
            s.num_context_tokens,
            s.step_duration + around,
        )
        for s in steps
        if _worked(s)
    ]


def _worked(step: StepStats) -> bool:
    return bool(step.num_prefill_tokens or step.num_decode_tokens)


def live_samples(steps: list[StepStats]) -> list[StepSample]:
    """The samples a live cost model fits on (costmodel.fit), from the engine's recent steps;
    PlanningError while there are too few."""
    samples = samples_of(steps)
    if len(samples) < MIN_SAMPLES:
        raise PlanningError(
            f"{len(samples)} of the engine's recent steps did work, fewer than the "
            f"{MIN_SAMPLES} a cost model needs: serve some traffic first"
        )
    return samples


def proposed_settings(base: EngineSettings, changes: Mapping[str, Any]) -> EngineSettings:
    """`base` with the engine's knobs among `changes` (dotted names) applied, checked as the
    engine checks a live change (InvalidSettingError naming the field)."""
    from controlplane.engine.settings import validate_changes

    engine = {k.removeprefix("engine."): v for k, v in changes.items() if k in SIMULATED}
    return validate_changes(base, engine) if engine else base


@dataclass(frozen=True, slots=True)
class WhatIf:
    window: Window
    cost: CostModel
    recorded: Figures
    now: Figures  # simulated, settings in force
    proposed: Figures  # simulated, with the change
    not_simulated: list[str]  # changed fields the simulator does not model
    unmatched_prefix_tokens: int

    def as_dict(self) -> dict[str, Any]:
        w = self.window
        return {
            "window": {
                "since": w.since.isoformat(),
                "until": w.until.isoformat(),
                "requests": len(w.rows),
                "left_out": w.skipped,
            },
            "cost_model": {
                "samples": self.cost.samples,
                "rms_error_ms": round(self.cost.rms_error_s * 1000, 3),
            },
            "recorded": self.recorded.as_dict(),
            "now": self.now.as_dict(),
            "proposed": self.proposed.as_dict(),
            "not_simulated": self.not_simulated,
            "unmatched_prefix_tokens": self.unmatched_prefix_tokens,
        }


def what_if(
    window: Window,
    now: EngineSettings,
    proposed: EngineSettings,
    not_simulated: list[str],
    cost: CostModel,
    vocab_size: int,
    max_model_len: int,
    slo: Slo,
    hourly_usd: float,
) -> WhatIf:
    """The window simulated under `now` and under `proposed` (proposed_settings of the change);
    `not_simulated`: the change's fields the simulator does not model."""
    if not window.rows:
        raise PlanningError("no request in the window to simulate")
    workload = build_workload(window, vocab_size, max_model_len)
    runs = [
        simulate(workload, settings, cost, label)
        for label, settings in (("now", now), ("proposed", proposed))
    ]
    return WhatIf(
        window=window,
        cost=cost,
        recorded=recorded_figures(window, slo, hourly_usd),
        now=replay_figures(runs[0], slo, hourly_usd),
        proposed=replay_figures(runs[1], slo, hourly_usd),
        not_simulated=not_simulated,
        unmatched_prefix_tokens=workload.unmatched_prefix_tokens,
    )
