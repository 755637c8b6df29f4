"""The SLO autopilot's decision: a pure function of what the last window measured, the knobs'
current values, their bounds and the targets (torch-free, no I/O; the daemon's runner in
controlplane/autopilot/pilot.py gathers the figures and applies the decision).

What each knob trades (the seeds' reasoning, and what the branches below act on):
  * max_num_seqs: more sequences per step is more throughput, but every decode step takes
    longer, so inter-token latency (ITL) grows; fewer slots make requests queue (TTFT).
  * prefill_chunk_size: a bigger prefill chunk reaches the first token sooner (TTFT), but the
    decode steps it rides along with stall, so ITL grows. It is blamed for ITL when the steps
    that carry prompt tokens take STALL times as long as decode-only steps; it is then set
    below what those steps actually carry (a smaller chunk than any prompt changes nothing).
  * max_num_batched_tokens: the token budget of one step; when it, not the slots, limits the
    batch, raising it admits more work per step; lowering it bounds how many prompt tokens
    ride along with the decodes of one step (several prompts arriving together stall the
    decodes however small each one's chunk is).
  * speculative_num_tokens: more draft tokens make each verification step longer.

One knob moves per decision, by a bounded step (down: x0.75, up: x1.25, at least 1), never past
its bounds, never a knob an operator has pinned. Oscillation is prevented three ways: a
hysteresis band (targets met but without `headroom` changes nothing), a ceiling (a value at
which a target was missed is not climbed back to while the ceiling holds) and the runner's
cooldown (one window of fresh figures after each change before the next decision).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

KNOBS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "prefill_chunk_size",
    "speculative_num_tokens",
    "speculative_max_batch_size",
)
LATENCY, THROUGHPUT = "latency", "throughput"
# Prefill chunks, not the batch size, stretch the decode gaps when the steps that carry prompt
# tokens take this many times as long as the decode-only steps.
STALL = 1.5
# Slots (or the token budget) "limit" the batch when used this full on average.
FULL = 0.9


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Window:
    """What the last window measured: the figures /admin/stats shows, over `duration_s`."""

    duration_s: float
    requests: int  # finished in the window
    ttft_p99_ms: float | None
    itl_p99_ms: float | None
    queue_length: float  # mean requests waiting
    kv_usage: float  # mean, 0-1
    preemptions: int
    output_tokens_per_s: float
    prefill_share: float  # prompt tokens / all tokens the window's steps scheduled
    batch_fill: float  # mean running / max_num_seqs
    token_fill: float  # mean scheduled tokens / max_num_batched_tokens
    # Step durations: median of decode-only steps, p90 of steps carrying prompt tokens, and the
    # mean prompt tokens such a step carried (None: no such step in the window).
    decode_step_ms: float | None = None
    prefill_step_ms: float | None = None
    prefill_tokens_per_prefill_step: float | None = None
    tokens_per_prefill_step: float | None = None  # prompt and decode tokens of those steps
    speculating: bool = False


@dataclass(frozen=True, slots=True)
class Policy:
    min_requests: int = 20  # fewer finished requests in a window: no decision
    headroom: float = 0.8  # "met with headroom": p99 <= headroom x target
    decrease: float = 0.75
    increase: float = 1.25


@dataclass(frozen=True, slots=True)
class Decision:
    reason: str
    knob: str | None = None  # None: hold
    old: int | None = None
    new: int | None = None
    direction: str | None = None  # LATENCY or THROUGHPUT

    @property
    def changes(self) -> bool:
        return self.knob is not None


def _fmt(ms: float) -> str:
    return f"{ms:.0f} ms"


def _step(old: int, lo: int, hi: int, direction: str, policy: Policy, ceiling: int | None) -> int:
    if direction == LATENCY:
        return max(lo, min(old - 1, math.floor(old * policy.decrease)))
    top = hi if ceiling is None else min(hi, ceiling - 1)
    return min(top, max(old + 1, math.ceil(old * policy.increase)))


def _move(
    candidates: list[str],
    direction: str,
    why: str,
    knobs: Mapping[str, int],
    bounds: Mapping[str, tuple[int, int]],
    pinned: frozenset[str],
    ceilings: Mapping[str, int],
    policy: Policy,
    in_effect: Mapping[str, float] | None = None,
    floors: Mapping[str, int] | None = None,
    vetoed: Mapping[str, str] | None = None,
) -> Decision:
    """The first candidate that can move in `direction`; a hold that says why none can.
    `in_effect`: a knob's value as the engine feels it, where less than its setting (a chunk
    larger than any prompt acts as the prompt's size); a step down starts from there.
    `vetoed`: knobs not to move this time, with why (the simulator predicted no gain)."""
    blocked = []
    for knob in candidates:
        if knob not in knobs or knob not in bounds:
            continue
        old = knobs[knob]
        lo, hi = bounds[knob]
        if knob in pinned:
            blocked.append(f"{knob} pinned by an operator")
            continue
        if vetoed and knob in vetoed:
            blocked.append(f"{knob}: {vetoed[knob]}")
            continue
        start = old
        if direction == LATENCY and in_effect and knob in in_effect:
            start = max(1, min(old, math.ceil(in_effect[knob])))
        if knob == "max_num_batched_tokens":  # every running sequence decodes in each step
            lo = max(lo, knobs.get("max_num_seqs", 1))
        if direction == LATENCY and floors and knob in floors and old <= floors[knob]:
            blocked.append(f"{knob} held at {old}: lowering it made things worse")
            continue
        new = _step(start, lo, hi, direction, policy, ceilings.get(knob))
        if start < old and new >= start:  # its floor is above what the steps carry
            blocked.append(f"{knob} cannot go below what the steps carry ({start}) within {lo}")
            continue
        if (
            new == old
            or (direction == LATENCY and new > old)
            or (direction == THROUGHPUT and new < old)
        ):
            if direction == LATENCY:
                blocked.append(f"{knob} at its lower bound {lo}")
            elif knob in ceilings and ceilings[knob] - 1 <= min(hi, old):
                blocked.append(
                    f"{knob} {old} just below {ceilings[knob]}, where a target was missed"
                )
            else:
                blocked.append(f"{knob} at its upper bound {hi}")
            continue
        return Decision(f"{why}: {knob} {old} -> {new}", knob, old, new, direction)
    return Decision(f"{why}, but " + ("; ".join(blocked) or "no knob to move") + ": holding")


def decide(
    window: Window,
    knobs: Mapping[str, int],
    bounds: Mapping[str, tuple[int, int]],
    targets: Targets,
    *,
    pinned: frozenset[str] = frozenset(),
    ceilings: Mapping[str, int] | None = None,
    floors: Mapping[str, int] | None = None,
    policy: Policy = Policy(),
    vetoed: Mapping[str, str] | None = None,
) -> Decision:
    """One decision for the last window: which knob to move, or why nothing moves.
    `ceilings` / `floors`: values not to climb back to / go below again (the runner learns
    them from changes that missed a target or made things worse); `vetoed`: knobs not to move
    this time, with why (the runner's simulator found the move would not help)."""
    ceilings = ceilings or {}
    if targets.ttft_p99_ms is None and targets.itl_p99_ms is None:
        return Decision("no target set (autopilot.ttft_p99_ms, autopilot.itl_p99_ms): holding")
    if window.requests < policy.min_requests:
        return Decision(
            f"too few samples: {window.requests} requests finished in the last "
            f"{window.duration_s:.0f} s (need {policy.min_requests}): holding"
        )

    def missed(target: float | None, p99: float | None) -> bool:
        return target is not None and p99 is not None and p99 > target

    def roomy(target: float | None, p99: float | None) -> bool:
        return target is None or p99 is None or p99 <= policy.headroom * target

    itl_missed = missed(targets.itl_p99_ms, window.itl_p99_ms)
    ttft_missed = missed(targets.ttft_p99_ms, window.ttft_p99_ms)
    in_effect = {
        knob: value
        for knob, value in (
            ("prefill_chunk_size", window.prefill_tokens_per_prefill_step),
            ("max_num_batched_tokens", window.tokens_per_prefill_step),
        )
        if value
    }
    move = lambda cands, direction, why: _move(  # noqa: E731
        cands, direction, why, knobs, bounds, pinned, ceilings, policy, in_effect, floors, vetoed
    )
    if itl_missed:
        why = f"itl_p99 {_fmt(window.itl_p99_ms)} > {_fmt(targets.itl_p99_ms)} target"
        if ttft_missed:
            why = f"both missed (ttft_p99 {_fmt(window.ttft_p99_ms)} > {_fmt(targets.ttft_p99_ms)}), {why}; running requests first"
        # Prefill chunks riding in decode steps stretch the gaps; otherwise the batch does.
        stall = (
            window.prefill_step_ms is not None
            and window.decode_step_ms is not None
            and window.prefill_step_ms >= STALL * window.decode_step_ms
        )
        if stall:
            why += (
                f" (steps with prompt tokens {_fmt(window.prefill_step_ms)}, "
                f"decode-only {_fmt(window.decode_step_ms)})"
            )
            cands = ["max_num_batched_tokens", "prefill_chunk_size"]
            # A smaller batch shortens only the decode part of a stalled step: worth it only
            # when that part is a real share of the target.
            if (window.decode_step_ms or 0) >= 0.5 * (targets.itl_p99_ms or 0):
                cands.append("max_num_seqs")
        else:
            cands = ["max_num_seqs", "prefill_chunk_size"]
        if window.speculating:
            cands.append("speculative_num_tokens")
        return move(cands, LATENCY, why)
    if ttft_missed:
        why = f"ttft_p99 {_fmt(window.ttft_p99_ms)} > {_fmt(targets.ttft_p99_ms)} target"
        cands = []
        # Requests wait for a slot: more slots, if decode latency has room for a bigger batch.
        if (
            window.queue_length >= 1
            and window.batch_fill >= FULL
            and roomy(targets.itl_p99_ms, window.itl_p99_ms)
        ):
            cands.append("max_num_seqs")
        # Prompts wait for prefill: bigger steps and bigger chunks reach the first token sooner.
        if window.token_fill >= FULL:
            cands.append("max_num_batched_tokens")
        cands.append("prefill_chunk_size")
        if "max_num_batched_tokens" not in cands:
            cands.append("max_num_batched_tokens")
        return move(cands, THROUGHPUT, why)
    met = "targets met"
    if not (
        roomy(targets.itl_p99_ms, window.itl_p99_ms)
        and roomy(targets.ttft_p99_ms, window.ttft_p99_ms)
    ):
        return Decision(f"{met} without {1 - policy.headroom:.0%} headroom: holding")
    if window.queue_length < 1:
        return Decision(f"{met} with headroom, nothing queued: nothing to gain, holding")
    why = f"{met} with headroom and {window.queue_length:.1f} requests queued"
    cands = []
    if window.batch_fill >= FULL:
        cands.append("max_num_seqs")
    if window.token_fill >= FULL:
        cands.append("max_num_batched_tokens")
    if not cands:
        return Decision(
            f"{why}, but neither the slots ({window.batch_fill:.0%} full) nor the token budget "
            f"({window.token_fill:.0%}) limit the batch (KV cache {window.kv_usage:.0%}): holding"
        )
    return move(cands, THROUGHPUT, why)
