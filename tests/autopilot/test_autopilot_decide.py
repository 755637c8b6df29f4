"""The autopilot's decision function, table-driven: every branch (pure: no daemon, no clock)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest

from controlplane.autopilot.policy import LATENCY, THROUGHPUT, Decision, Targets, Window, decide

KNOBS = {
    "max_num_seqs": 32,
    "max_num_batched_tokens": 1024,
    "prefill_chunk_size": 512,
    "speculative_num_tokens": 4,
    "speculative_max_batch_size": 8,
}
BOUNDS = {
    "max_num_seqs": (4, 64),
    "max_num_batched_tokens": (256, 4096),
    "prefill_chunk_size": (64, 2048),
    "speculative_num_tokens": (1, 8),
    "speculative_max_batch_size": (1, 32),
}
BOTH = Targets(ttft_p99_ms=2000, itl_p99_ms=80)
CALM = Window(
    duration_s=30,
    requests=100,
    ttft_p99_ms=1000,  # met with headroom (<= 0.8 x 2000)
    itl_p99_ms=50,  # met with headroom (<= 0.8 x 80)
    queue_length=0,
    kv_usage=0.4,
    preemptions=0,
    output_tokens_per_s=500,
    prefill_share=0.1,
    batch_fill=0.5,
    token_fill=0.3,
)


def w(**changes) -> Window:
    return dataclasses.replace(CALM, **changes)


# (case, window, targets, extra kwargs, expected (knob, new, direction) or None, reason words)
CASES = [
    (
        "itl missed: fewer sequences",
        w(itl_p99_ms=142),
        BOTH,
        {},
        ("max_num_seqs", 24, LATENCY),
        "itl_p99 142 ms > 80 ms target: max_num_seqs 32 -> 24",
    ),
    (
        "itl missed, steps with prompt tokens stall decodes: a smaller step budget first",
        w(
            itl_p99_ms=142,
            decode_step_ms=50,
            prefill_step_ms=400,
            prefill_tokens_per_prefill_step=600,
            tokens_per_prefill_step=632,
        ),
        BOTH,
        {},
        ("max_num_batched_tokens", 474, LATENCY),
        "(steps with prompt tokens 400 ms, decode-only 50 ms): max_num_batched_tokens 1024 -> 474",
    ),
    (
        "stalls, budget pinned: the chunk goes below what the steps actually carry",
        w(
            itl_p99_ms=142,
            decode_step_ms=50,
            prefill_step_ms=400,
            prefill_tokens_per_prefill_step=200,
        ),
        BOTH,
        {"pinned": frozenset({"max_num_batched_tokens"})},
        ("prefill_chunk_size", 150, LATENCY),
        "prefill_chunk_size 512 -> 150",
    ),
    (
        "stalls, steps carry fewer tokens than the budget's floor: the chunk instead",
        w(itl_p99_ms=142, decode_step_ms=50, prefill_step_ms=400, tokens_per_prefill_step=40),
        BOTH,
        {},
        ("prefill_chunk_size", 384, LATENCY),
        "prefill_chunk_size 512 -> 384",
    ),
    (
        "stalls, nothing left to lower: hold, saying why each knob cannot move",
        w(itl_p99_ms=142, decode_step_ms=50, prefill_step_ms=400, tokens_per_prefill_step=40),
        BOTH,
        {"knobs": {**KNOBS, "prefill_chunk_size": 64, "max_num_seqs": 4}},
        None,
        "max_num_batched_tokens cannot go below what the steps carry (40) within 256",
    ),
    (
        "itl missed, prompt steps no slower than decode steps: fewer sequences",
        w(
            itl_p99_ms=142,
            decode_step_ms=100,
            prefill_step_ms=120,
            prefill_tokens_per_prefill_step=40,
        ),
        BOTH,
        {},
        ("max_num_seqs", 24, LATENCY),
        "max_num_seqs 32 -> 24",
    ),
    (
        "itl missed while speculating, other knobs at their floors: fewer draft tokens",
        w(itl_p99_ms=142, speculating=True),
        BOTH,
        {"knobs": {**KNOBS, "max_num_seqs": 4, "prefill_chunk_size": 64}},
        ("speculative_num_tokens", 3, LATENCY),
        "speculative_num_tokens 4 -> 3",
    ),
    (
        "ttft missed with a queue and full slots: more sequences",
        w(ttft_p99_ms=3500, queue_length=6, batch_fill=0.97),
        BOTH,
        {},
        ("max_num_seqs", 40, THROUGHPUT),
        "ttft_p99 3500 ms > 2000 ms target",
    ),
    (
        "ttft missed, slots full but itl near its target: not more sequences, bigger chunks",
        w(ttft_p99_ms=3500, queue_length=6, batch_fill=0.97, itl_p99_ms=75),
        BOTH,
        {},
        ("prefill_chunk_size", 640, THROUGHPUT),
        "prefill_chunk_size 512 -> 640",
    ),
    (
        "ttft missed, token budget full: a bigger budget",
        w(ttft_p99_ms=3500, token_fill=0.95),
        BOTH,
        {},
        ("max_num_batched_tokens", 1280, THROUGHPUT),
        "max_num_batched_tokens 1024 -> 1280",
    ),
    (
        "ttft missed, no queue: bigger prefill chunks",
        w(ttft_p99_ms=3500),
        BOTH,
        {},
        ("prefill_chunk_size", 640, THROUGHPUT),
        "640",
    ),
    (
        "both missed: running requests first (latency)",
        w(itl_p99_ms=120, ttft_p99_ms=5000, queue_length=9, batch_fill=1.0),
        BOTH,
        {},
        ("max_num_seqs", 24, LATENCY),
        "both missed",
    ),
    (
        "headroom and a queue on full slots: more sequences",
        w(queue_length=3, batch_fill=0.95),
        BOTH,
        {},
        ("max_num_seqs", 40, THROUGHPUT),
        "targets met with headroom and 3.0 requests queued: max_num_seqs 32 -> 40",
    ),
    (
        "headroom and a queue on a full token budget: a bigger budget",
        w(queue_length=3, token_fill=0.95),
        BOTH,
        {},
        ("max_num_batched_tokens", 1280, THROUGHPUT),
        "max_num_batched_tokens 1024 -> 1280",
    ),
    (
        "headroom and a queue neither slots nor budget explain (KV-bound): hold",
        w(queue_length=3, kv_usage=0.98),
        BOTH,
        {},
        None,
        "KV cache 98%",
    ),
    ("headroom without a queue: hold", CALM, BOTH, {}, None, "nothing queued: nothing to gain"),
    (
        "met, but inside the hysteresis band: hold",
        w(itl_p99_ms=70, queue_length=5, batch_fill=1.0),
        BOTH,
        {},
        None,
        "without 20% headroom",
    ),
    (
        "too few samples: hold and say so",
        w(requests=7, itl_p99_ms=500),
        BOTH,
        {},
        None,
        "too few samples: 7 requests finished in the last 30 s (need 20)",
    ),
    ("no targets: hold", w(itl_p99_ms=500), Targets(), {}, None, "no target set"),
    (
        "only an itl target, missed",
        w(itl_p99_ms=90, ttft_p99_ms=99999),
        Targets(itl_p99_ms=80),
        {},
        ("max_num_seqs", 24, LATENCY),
        "itl_p99 90 ms",
    ),
    (
        "pinned knob: the next one moves",
        w(itl_p99_ms=142),
        BOTH,
        {"pinned": frozenset({"max_num_seqs"})},
        ("prefill_chunk_size", 384, LATENCY),
        "prefill_chunk_size 512 -> 384",
    ),
    (
        "every candidate pinned or at its bound: hold, naming why",
        w(itl_p99_ms=142),
        BOTH,
        {"pinned": frozenset({"max_num_seqs"}), "knobs": {**KNOBS, "prefill_chunk_size": 64}},
        None,
        "max_num_seqs pinned by an operator; prefill_chunk_size at its lower bound 64",
    ),
    (
        "lower bound: the step stops at it",
        w(itl_p99_ms=142),
        BOTH,
        {"knobs": {**KNOBS, "max_num_seqs": 5}},
        ("max_num_seqs", 4, LATENCY),
        "max_num_seqs 5 -> 4",
    ),
    (
        "upper bound reached: the next throughput knob",
        w(queue_length=3, batch_fill=0.95, token_fill=0.95),
        BOTH,
        {"knobs": {**KNOBS, "max_num_seqs": 64}},
        ("max_num_batched_tokens", 1280, THROUGHPUT),
        "max_num_batched_tokens 1024 -> 1280",
    ),
    (
        "upper bound capped, not passed",
        w(queue_length=3, batch_fill=0.95),
        BOTH,
        {"knobs": {**KNOBS, "max_num_seqs": 60}},
        ("max_num_seqs", 64, THROUGHPUT),
        "max_num_seqs 60 -> 64",
    ),
    (
        "a ceiling: never climb back to where a target was missed",
        w(queue_length=3, batch_fill=0.95),
        BOTH,
        {"ceilings": {"max_num_seqs": 36}},
        ("max_num_seqs", 35, THROUGHPUT),
        "max_num_seqs 32 -> 35",
    ),
    (
        "a knob the simulator vetoed: the next candidate moves",
        w(itl_p99_ms=142),
        BOTH,
        {"vetoed": {"max_num_seqs": "simulated itl p99 140 -> 141 ms, no gain"}},
        ("prefill_chunk_size", 384, LATENCY),
        "prefill_chunk_size 512 -> 384",
    ),
    (
        "every candidate vetoed: a hold that gives the simulator's reasons",
        w(itl_p99_ms=142),
        BOTH,
        {
            "vetoed": {
                "max_num_seqs": "simulated itl p99 140 -> 141 ms, no gain",
                "prefill_chunk_size": "simulated itl p99 140 -> 139 ms, no gain",
            }
        },
        None,
        "max_num_seqs: simulated itl p99 140 -> 141 ms, no gain; prefill_chunk_size: simulated",
    ),
    (
        "just below the ceiling: hold",
        w(queue_length=3, batch_fill=0.95),
        BOTH,
        {"ceilings": {"max_num_seqs": 33}},
        None,
        "just below 33, where a target was missed",
    ),
]


@pytest.mark.parametrize(
    ("window", "targets", "extra", "expected", "words"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decide(window, targets, extra, expected, words) -> None:
    extra = dict(extra)
    knobs = extra.pop("knobs", KNOBS)
    d = decide(window, knobs, BOUNDS, targets, **extra)
    assert words in d.reason
    if expected is None:
        assert not d.changes and d.knob is None and "holding" in d.reason
    else:
        knob, new, direction = expected
        assert (d.knob, d.new, d.direction) == (knob, new, direction)
        assert d.old == knobs[knob]
        lo, hi = BOUNDS[knob]
        assert lo <= d.new <= hi and d.new != d.old


def test_steady_load_does_not_oscillate() -> None:
    """A toy plant where ITL grows with the batch: from too big, the autopilot lowers, then
    settles; it never climbs back to a value where the target was missed (the ceiling) and
    inside the band it holds. Over 60 decisions the knob changes a few times, then never."""

    def itl(seqs: int) -> float:
        return 20 + 2.5 * seqs  # 80 ms at 24 sequences

    seqs, ceilings, history = 48, {}, []
    for _ in range(60):
        window = w(itl_p99_ms=itl(seqs), queue_length=4, batch_fill=1.0)
        d = decide(window, {**KNOBS, "max_num_seqs": seqs}, BOUNDS, BOTH, ceilings=ceilings)
        if d.changes:
            if d.direction == LATENCY:
                ceilings[d.knob] = d.old
            seqs = d.new
        history.append(seqs)
    changes = sum(a != b for a, b in itertools.pairwise(history))
    assert itl(history[-1]) <= 80  # the target is held
    assert changes <= 6 and len(set(history[-30:])) == 1  # settled: no sawtooth


# -- the runner's own state (a real Runtime and store, no engine) ------------------------------


def runner(engine=None):
    from controlplane.autopilot.pilot import Autopilot
    from controlplane.config import build_config
    from controlplane.http.auth import AdminAuth
    from controlplane.runtime.live_config import LiveConfig
    from controlplane.runtime.runtime import Runtime

    cfg = build_config({"autopilot": {"enabled": True, "itl_p99_ms": 80, "give_up_after": 3}})
    runtime = Runtime(LiveConfig(cfg, {}, {}), "ap", AdminAuth([]))
    runtime.store.db = engine
    return runtime, Autopilot(runtime)


def test_changes_that_improve_nothing_are_counted_and_a_better_one_resets():
    _, ap = runner()
    change = Decision("x", "max_num_seqs", 32, 24, LATENCY)

    def judged(metric: str, before: float, window: Window) -> int:
        ap._judging = (metric, before, change)  # what the last change aimed at, and before
        ap._judge(window, now=0.0)
        return ap.fruitless

    assert judged("itl_p99_ms", 150, w(itl_p99_ms=150)) == 1  # no better
    assert judged("itl_p99_ms", 150, w(itl_p99_ms=160)) == 2  # worse (within noise)
    assert judged("itl_p99_ms", 150, w(itl_p99_ms=90)) == 0  # better: the count starts over
    assert judged("output_tokens_per_s", 500, w(output_tokens_per_s=480)) == 1
    assert judged("output_tokens_per_s", 500, w(output_tokens_per_s=620)) == 0


def test_a_change_that_made_things_worse_is_undone_and_not_tried_again(db_engine):
    runtime, ap = runner(db_engine)
    asyncio.run(runtime.change_config({"engine.max_num_seqs": 24}, "autopilot", "autopilot"))
    change = Decision("itl ...: max_num_seqs 32 -> 24", "max_num_seqs", 32, 24, LATENCY)
    ap._judging = ("itl_p99_ms", 200.0, change)
    assert ap._judge(w(itl_p99_ms=215), now=1000.0) is None  # worse, but within 10%: kept
    ap._judging = ("itl_p99_ms", 200.0, change)
    undo = ap._judge(w(itl_p99_ms=290), now=1000.0)
    assert (undo.knob, undo.old, undo.new, undo.direction) == ("max_num_seqs", 24, 32, THROUGHPUT)
    assert undo.reason == (
        "reverting: max_num_seqs 32 -> 24 made itl_p99 worse (200 -> 290 ms): max_num_seqs 24 -> 32"
    )
    assert ap.floors["max_num_seqs"][0] == 32
    # With that floor the next latency decision leaves the knob alone and moves another.
    d = decide(w(itl_p99_ms=142), KNOBS, BOUNDS, BOTH, floors={"max_num_seqs": 32})
    assert d.knob == "prefill_chunk_size"
    held = decide(
        w(itl_p99_ms=142), {**KNOBS, "prefill_chunk_size": 64}, BOUNDS, BOTH,
        floors={"max_num_seqs": 32},
    )  # fmt: skip
    assert (
        not held.changes and "max_num_seqs held at 32: lowering it made things worse" in held.reason
    )
    # An operator set the knob since: nothing to undo.
    asyncio.run(runtime.change_config({"engine.max_num_seqs": 20}, "api", "ops"))
    ap._judging = ("itl_p99_ms", 200.0, change)
    assert ap._judge(w(itl_p99_ms=290), now=1000.0) is None


def test_operator_changes_pin_knobs_and_turning_off_is_audited(db_engine):
    runtime, ap = runner(db_engine)

    async def main() -> None:
        await runtime.change_config({"engine.max_num_seqs": 12}, "api", "ops")
        assert set(ap.pins) == {"max_num_seqs"}  # an operator's knob: left alone
        await runtime.change_config({"engine.prefill_chunk_size": 256}, "autopilot", "autopilot")
        assert set(ap.pins) == {"max_num_seqs"}  # its own changes pin nothing
        await ap.turn_off("its last 3 changes improved nothing (autopilot.give_up_after)")

    asyncio.run(main())
    assert ap.state == "off" and not runtime.cfg.autopilot.enabled
    from controlplane.store.audit import history

    (row,) = history(db_engine, field="autopilot.enabled")
    assert (row["source"], row["old_value"], row["new_value"]) == ("autopilot", True, False)
    assert (
        row["reason"] == "turned off: its last 3 changes improved nothing (autopilot.give_up_after)"
    )
    # Switched on again by an operator: a fresh start.
    asyncio.run(runtime.change_config({"autopilot.enabled": True}, "api", "ops"))
    assert ap.state == "holding" and ap.off_reason is None


def test_turning_off_holds_even_when_the_audit_log_is_down():
    _, ap = runner(engine=None)  # no store: the audited change cannot be written
    asyncio.run(ap.turn_off("the daemon is draining"))
    assert ap.state == "off" and ap.off_reason == "the daemon is draining"
    assert ap.describe()["enabled"] is False


def test_the_config_bounds_every_knob_and_nothing_else() -> None:
    # AutopilotSettings.bounds() reads its <knob>_min/_max fields; the policy turns KNOBS.
    from controlplane.autopilot.policy import KNOBS
    from controlplane.config import AutopilotSettings

    bounds = AutopilotSettings().bounds()
    assert list(bounds) == list(KNOBS)
    assert all(lo <= hi for lo, hi in bounds.values())
