"""The SLO autopilot in the daemon: every `autopilot.interval_s` it measures the last window,
asks `controlplane.autopilot.policy.decide` what to do, and applies a change through the same live
config path as the API, the TUI and the file (audited, source "autopilot", with its reason).

State it keeps between decisions (the decision function itself is pure):
  * pins: a knob an operator (api, tui, file, fleet) changed is left alone for
    `operator_hold_s`;
  * ceilings: a value at which a target was missed is not climbed back to for
    CEILING_HOLD_S (no sawtooth on a steady load);
  * cooldown: after a change, the next decision waits until a full window of figures measured
    after it exists;
  * give-up: after `give_up_after` changes in a row that improved nothing it turns itself off,
    as it does when the daemon drains, and says so (log, event, audit row).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from controlplane.autopilot.foresight import prediction, verdict
from controlplane.autopilot.policy import (
    KNOBS,
    LATENCY,
    THROUGHPUT,
    Decision,
    Policy,
    Targets,
    Window,
    decide,
)
from controlplane.common import percentile
from controlplane.runtime.state import DaemonState

if TYPE_CHECKING:
    from controlplane.config import Config
    from controlplane.runtime.live_config import FieldChange
    from controlplane.runtime.runtime import Runtime

log = logging.getLogger("controlplane.autopilot")

SOURCE = "autopilot"
CEILING_HOLD_S = 900.0
OPERATOR_SOURCES = ("api", "tui", "file", "env", "fleet")
OFF, HOLDING, ADJUSTING = "off", "holding", "adjusting"
# A change after which what it aimed at got this much worse (x1.1 latency, /1.1 throughput)
# is undone.
WORSE = 1.1


@dataclass(slots=True)
class Record:
    """One decision as /admin/autopilot and the TUI show it."""

    time: float
    reason: str
    knob: str | None = None
    old: int | None = None
    new: int | None = None
    direction: str | None = None
    applied: bool = False
    figures: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(runtime: Runtime, now: float, since: float | None = None) -> Window:
    """The last window's figures: `window_s`, widened up to `max_window_s` until it holds
    `min_requests` finished requests, and never reaching back before `since` (a change: the
    figures before it describe other settings)."""
    a = runtime.cfg.autopilot
    floor = now - a.max_window_s if since is None else max(since, now - a.max_window_s)
    start = max(floor, now - a.window_s)
    done = runtime.ledger.finished_since(floor)
    if sum(1 for f in done if f.time > start) < a.min_requests:
        # Widen back to the min_requests-th most recent finish (or the floor).
        times = sorted((f.time for f in done), reverse=True)
        start = times[a.min_requests - 1] - 1e-6 if len(times) >= a.min_requests else floor
    done = [f for f in done if f.time > start]
    ttfts = [f.ttft for f in done if f.ttft is not None]
    gaps = [g for f in done for g in f.gaps]
    history = runtime.snapshots()
    snaps = [h for h in history if h.time > start]
    before = [h for h in history if h.time <= start]
    s = runtime.cfg.engine
    latest = runtime.engine.stats()
    first = before[-1] if before else (snaps[0] if snaps else latest)
    steps = (latest.step - first.step) if latest and first else 0
    prefill = (latest.prefill_tokens_total - first.prefill_tokens_total) if steps else 0
    decode = (latest.decode_tokens_total - first.decode_tokens_total) if steps else 0
    elapsed = max(1e-9, (latest.time - first.time) if latest and first else 0.0)

    # Step by step (the engine's ring of recent steps): how long decode-only steps take, and
    # the steps carrying prompt tokens (the stalls a prefill chunk causes).
    ring = runtime.engine.recent_steps()
    recent = [x for x in ring if x.time > start]
    decode_only = [1000 * x.step_duration for x in recent if not x.num_prefill_tokens]
    with_prompt = [x for x in recent if x.num_prefill_tokens]

    def per_step(total: str, cap: int) -> float:
        if not steps or cap <= 0:
            return 0.0
        return (getattr(latest, total) - getattr(first, total)) / steps / cap

    return Window(
        duration_s=now - start,
        requests=len(done),
        ttft_p99_ms=1000 * percentile(ttfts, 99) if ttfts else None,
        itl_p99_ms=1000 * percentile(gaps, 99) if gaps else None,
        queue_length=(
            sum(h.num_waiting + h.num_swapped for h in snaps) / len(snaps) if snaps else 0.0
        ),
        kv_usage=sum(h.kv_usage for h in snaps) / len(snaps) if snaps else 0.0,
        preemptions=(latest.num_preemptions - first.num_preemptions) if steps else 0,
        output_tokens_per_s=decode / elapsed if steps else 0.0,
        prefill_share=prefill / (prefill + decode) if prefill + decode else 0.0,
        decode_step_ms=percentile(decode_only, 50) if decode_only else None,
        prefill_step_ms=(
            percentile([1000 * x.step_duration for x in with_prompt], 90) if with_prompt else None
        ),
        prefill_tokens_per_prefill_step=(
            sum(x.num_prefill_tokens for x in with_prompt) / len(with_prompt)
            if with_prompt
            else None
        ),
        tokens_per_prefill_step=(
            sum(x.num_prefill_tokens + x.num_decode_tokens for x in with_prompt) / len(with_prompt)
            if with_prompt
            else None
        ),
        batch_fill=per_step("running_total", s.max_num_seqs),
        token_fill=per_step("batched_tokens_total", s.max_num_batched_tokens),
        speculating=bool(latest and latest.speculation == "active"),
    )


def attainment(runtime: Runtime, now: float, window_s: float) -> dict[str, float | None]:
    """Fraction of the requests finished in the last `window_s` within each target (a request
    meets the ITL target when its own p99 inter-token gap does); None: no target or none
    finished."""
    a = runtime.cfg.autopilot
    done = runtime.ledger.finished_since(now - window_s)
    out: dict[str, float | None] = {"ttft": None, "itl": None}
    if not done:
        return out
    if a.ttft_p99_ms:
        timed = [f.ttft for f in done if f.ttft is not None]
        if timed:
            out["ttft"] = sum(t * 1000 <= a.ttft_p99_ms for t in timed) / len(timed)
    if a.itl_p99_ms:
        spread = [f.gaps for f in done if f.gaps]
        if spread:
            out["itl"] = sum(percentile(gs, 99) * 1000 <= a.itl_p99_ms for gs in spread) / len(
                spread
            )
    return out


class Autopilot:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.decisions: deque[Record] = deque(maxlen=50)
        self.pins: dict[str, float] = {}  # knob -> pinned until (time.time())
        self.ceilings: dict[str, tuple[int, float]] = {}  # knob -> (missed at, until)
        self.floors: dict[str, tuple[int, float]] = {}  # knob -> (worse below, until)
        self.last_change: float | None = None
        # The change being judged ("did it improve?"): what it aimed at, the value before.
        self._judging: tuple[str, float, Decision] | None = None
        self.fruitless = 0  # changes in a row that improved nothing
        self.off_reason: str | None = None
        # Off until switched on again, even where the audited turn-off could not be written.
        self.suspended = False
        runtime.live.subscribe(self._on_config)

    # -- what operators see ---------------------------------------------------------------------
    @property
    def state(self) -> str:
        if not self.runtime.cfg.autopilot.enabled or self.suspended:
            return OFF
        last = self.decisions[-1] if self.decisions else None
        return ADJUSTING if last is not None and last.applied else HOLDING

    def brief(self) -> dict[str, Any]:
        """For /admin/stats (and the TUI's header): state and targets."""
        a = self.runtime.cfg.autopilot
        return {
            "state": self.state,
            "ttft_p99_ms": a.ttft_p99_ms or None,
            "itl_p99_ms": a.itl_p99_ms or None,
        }

    def describe(self) -> dict[str, Any]:
        a = self.runtime.cfg.autopilot
        now = time.time()
        return {
            "enabled": a.enabled and not self.suspended,
            "state": self.state,
            "targets": {"ttft_p99_ms": a.ttft_p99_ms or None, "itl_p99_ms": a.itl_p99_ms or None},
            "interval_s": a.interval_s,
            "bounds": {k: list(v) for k, v in a.bounds().items()},
            "pinned": {k: round(t - now, 1) for k, t in self.pins.items() if t > now},
            "ceilings": {k: v for k, (v, until) in self.ceilings.items() if until > now},
            "floors": {k: v for k, (v, until) in self.floors.items() if until > now},
            "off_reason": self.off_reason,
            "attainment": attainment(self.runtime, now, max(a.window_s, 60.0)),
            "decisions": [r.to_dict() for r in reversed(self.decisions)],
        }

    # -- listening ------------------------------------------------------------------------------
    def _on_config(
        self, new: Config, diff: list[FieldChange], source: str, actor: str | None
    ) -> None:
        now = time.time()
        for c in diff:
            knob = c.field.removeprefix("engine.")
            if source in OPERATOR_SOURCES and knob in KNOBS:
                self.pins[knob] = now + new.autopilot.operator_hold_s
            if c.field == "autopilot.enabled" and c.new:
                # Switched on: a fresh start (an operator's earlier turn-off reason is history).
                self.off_reason, self.fruitless, self._judging = None, 0, None
                self.last_change, self.suspended = None, False

    # -- deciding -------------------------------------------------------------------------------
    async def tick(self) -> Record | None:
        """One decision (None while off, cooling down or not loaded)."""

        rt = self.runtime
        a = rt.cfg.autopilot
        if not a.enabled or self.suspended or not rt.engine.loaded:
            return None
        now = time.time()
        if rt.state == DaemonState.DRAINING:
            await self.turn_off("the daemon is draining")
            return None
        if self.last_change is not None and now - self.last_change < a.window_s:
            return None  # cooldown: a full window of figures measured after the change
        window = measure(rt, now, since=self.last_change)
        knobs = {k: getattr(rt.cfg.engine, k) for k in KNOBS}
        targets = Targets(a.ttft_p99_ms or None, a.itl_p99_ms or None)
        revert = self._judge(window, now)
        if self.fruitless >= a.give_up_after:
            await self.turn_off(
                f"its last {self.fruitless} changes improved nothing (autopilot.give_up_after)"
            )
            return None

        def choose(vetoed: dict[str, str] | None = None) -> Decision:
            return decide(
                window,
                knobs,
                a.bounds(),
                targets,
                pinned=frozenset(k for k, until in self.pins.items() if until > now),
                ceilings={k: v for k, (v, until) in self.ceilings.items() if until > now},
                floors={k: v for k, (v, until) in self.floors.items() if until > now},
                policy=Policy(min_requests=a.min_requests, headroom=a.headroom),
                vetoed=vetoed,
            )

        decision = revert or choose()
        if revert is None and decision.changes and a.simulate_first:
            decision = await self._simulate_first(decision, choose, targets)
        record = Record(
            now,
            decision.reason,
            decision.knob,
            decision.old,
            decision.new,
            decision.direction,
            figures=asdict(window),
        )
        if decision.changes:
            record.applied = await self._apply(decision, window, now)
        elif self.decisions and self.decisions[-1].reason == record.reason:
            self.decisions[-1].time = now  # the same hold again: one entry, kept current
            return self.decisions[-1]
        self.decisions.append(record)
        rt.metrics.observe_autopilot(
            decision.knob if record.applied else None,
            decision.direction,
            attainment(rt, now, window.duration_s),
        )
        rt.events.broadcast(
            {"type": "autopilot", "state": self.state, "decision": record.to_dict()}
        )
        return record

    async def _simulate_first(
        self,
        decision: Decision,
        choose: Callable[[dict[str, str]], Decision],
        targets: Targets,
    ) -> Decision:
        """`decision`, or the policy's next choice, once the simulator predicts that it helps
        (controlplane/autopilot/foresight.py); a knob it does not model moves unsimulated, and
        where nothing can be simulated (too little traffic, the store not open) the decision
        stands as the policy made it, saying so."""
        from controlplane.errors import FieldError
        from controlplane.planning.whatif import SIMULATED
        from controlplane.planning.window import PlanningError
        from controlplane.runtime.store_handle import StoreNotOpenError

        window_s = max(self.runtime.cfg.autopilot.window_s, 60.0)
        vetoed: dict[str, str] = {}
        while decision.changes and f"engine.{decision.knob}" in SIMULATED:
            try:
                _, sim = await self.runtime.what_if(
                    {f"engine.{decision.knob}": decision.new}, window_s
                )
            except (PlanningError, FieldError, StoreNotOpenError) as exc:
                return dataclasses.replace(
                    decision, reason=f"{decision.reason} (not simulated: {exc})"
                )
            why_not = verdict(decision, sim.now, sim.proposed, targets)
            if why_not is None:
                note = prediction(decision, sim.now, sim.proposed)
                if note is not None:
                    decision = dataclasses.replace(decision, reason=f"{decision.reason} ({note})")
                return decision
            vetoed[decision.knob] = why_not
            decision = choose(vetoed)
        return decision

    async def _apply(self, decision: Decision, window: Window, now: float) -> bool:
        from controlplane.runtime.live_config import ConfigChangeError

        assert decision.knob is not None and decision.old is not None
        try:
            await self.runtime.change_config(
                {f"engine.{decision.knob}": decision.new},
                SOURCE,
                SOURCE,
                reason=decision.reason,
            )
        except ConfigChangeError as exc:
            log.warning("autopilot change refused: %s (%s)", exc, decision.reason)
            return False
        log.info("autopilot: %s", decision.reason, extra={"event": "autopilot"})
        self.last_change = now
        if decision.reason.startswith("reverting"):
            return True  # judged already: it undoes a change that made things worse
        if decision.direction == LATENCY:
            self.ceilings[decision.knob] = (decision.old, now + CEILING_HOLD_S)
            metric = "itl_p99_ms" if decision.reason.startswith(("itl", "both")) else "ttft_p99_ms"
        else:
            metric = "output_tokens_per_s"
        value = getattr(window, metric)
        self._judging = (metric, value, decision) if value is not None else None
        return True

    def _judge(self, window: Window, now: float) -> Decision | None:
        """Did the last change improve what it aimed at (latency down, throughput up)? One
        that made it more than WORSE worse is undone (the decision returned), and the value it
        left is not tried again for CEILING_HOLD_S."""
        if self._judging is None:
            return None
        metric, before, change = self._judging
        self._judging = None
        after = getattr(window, metric)
        if after is None or change.knob is None or change.new is None or change.old is None:
            return None
        higher_is_better = metric == "output_tokens_per_s"
        better = after > before if higher_is_better else after < before
        self.fruitless = 0 if better else self.fruitless + 1
        worse = after < before / WORSE if higher_is_better else after > before * WORSE
        if not worse or getattr(self.runtime.cfg.engine, change.knob) != change.new:
            return None  # within noise, or an operator has set the knob since
        if change.direction == LATENCY:
            self.floors[change.knob] = (change.old, now + CEILING_HOLD_S)
            self.ceilings.pop(change.knob, None)
        else:
            self.ceilings[change.knob] = (change.new, now + CEILING_HOLD_S)
        unit = "" if higher_is_better else " ms"
        return Decision(
            f"reverting: {change.knob} {change.old} -> {change.new} made {metric.removesuffix('_ms')} "
            f"worse ({before:.0f} -> {after:.0f}{unit}): {change.knob} {change.new} -> {change.old}",
            change.knob,
            change.new,
            change.old,
            THROUGHPUT if change.direction == LATENCY else LATENCY,
        )

    async def turn_off(self, why: str) -> None:
        """Switch `autopilot.enabled` off through the audited path, and say so everywhere."""
        self.off_reason, self.suspended = why, True
        try:
            await self.runtime.change_config(
                {"autopilot.enabled": False}, SOURCE, SOURCE, reason=f"turned off: {why}"
            )
        except Exception as exc:  # the audit log is down: still stop deciding
            log.error("autopilot could not record turning itself off (%s); off anyway", exc)
        log.warning("autopilot turned itself off: %s", why, extra={"event": "autopilot_off"})
        self.decisions.append(Record(time.time(), f"turned off: {why}"))
        self.runtime.events.broadcast({"type": "autopilot", "state": OFF, "reason": why})
