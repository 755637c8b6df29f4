"""The autopilot's decision function, table-driven: every branch (pure: no daemon, no clock)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from controlplane.autopilot import LATENCY, THROUGHPUT, Targets, Window, decide

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
        "itl missed, prefill-heavy steps: smaller prefill chunks first",
        w(itl_p99_ms=142, prefill_share=0.5, prefill_tokens_per_step=400),
        BOTH,
        {},
        ("prefill_chunk_size", 384, LATENCY),
        "prefill_chunk_size 512 -> 384",
    ),
    (
        "itl missed, many short prompts (chunks never half full): fewer sequences",
        w(itl_p99_ms=142, prefill_share=0.5, prefill_tokens_per_step=40),
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
