"""The one-line diagnosis of ``GET /admin/stats``: what limits this daemon right now, where the
daemon can tell, and the knob that addresses it (saying plainly when retuning cannot).

A pure function of a few figures (`Signals`, built by Runtime.stats_payload from the same
payload); the rules, first match wins:

- ``overloaded``: more arrives than this daemon has ever completed lately (arrivals_per_s >
  OVERLOAD_FACTOR x the best completion rate of the last 15 minutes) and the queue is growing,
  full (429s), or its oldest request has waited more than OVERLOAD_WAIT_S: shed load or add
  instances; no batch setting completes more than the best already seen.
- ``memory_bound``: requests wait while the KV cache is at least MEMORY_BOUND_KV_PERC full
  (or preemptions happened in the window): fewer sequences stop the preemption churn; more
  throughput needs KV memory.
- ``prefill_stall``: steps that carry prefill take at least PREFILL_STALL_RATIO x as long as
  decode-only steps, and at least PREFILL_STALL_MS: every running stream stalls that long.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

OVERLOAD_FACTOR = 1.1
OVERLOAD_WAIT_S = 5.0
MEMORY_BOUND_KV_PERC = 95.0
PREFILL_STALL_RATIO = 4.0
PREFILL_STALL_MS = 200.0


@dataclass(frozen=True, slots=True)
class Signals:
    """The figures the rules read (as /admin/stats reports them)."""

    arrivals_per_s: float | None = None
    best_completion_rate_per_s: float | None = None
    # The queue is longer than ~10 s ago, or full (turning requests away with 429).
    queue_growing: bool = False
    oldest_waiting_s: float | None = None
    waiting: int = 0  # requests not running: the daemon's queue and the engine's waiting
    kv_usage_perc: float = 0.0  # 0-100
    preemptions_in_window: int = 0
    prefill_step_p50_ms: float | None = None
    decode_step_p50_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Diagnosis:
    code: str  # overloaded | memory_bound | prefill_stall
    message: str  # one line for an operator
    knob: str  # the config key that addresses it

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _duration(ms: float) -> str:
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def diagnose(s: Signals) -> Diagnosis | None:
    """The first rule that matches (see the module's docstring); None: nothing to say."""
    arrivals, best = s.arrivals_per_s, s.best_completion_rate_per_s
    waits_long = s.oldest_waiting_s is not None and s.oldest_waiting_s > OVERLOAD_WAIT_S
    if (
        arrivals is not None
        and best is not None
        and arrivals > OVERLOAD_FACTOR * best
        and (s.queue_growing or waits_long)
    ):
        return Diagnosis(
            "overloaded",
            f"overloaded: {arrivals:.1f} req/s arriving, at most {best:.1f} req/s completed in "
            "15 min: shed load (server.max_queue_len) or add instances; retuning the batch "
            "cannot fix it",
            "server.max_queue_len",
        )
    if s.waiting > 0 and (s.kv_usage_perc >= MEMORY_BOUND_KV_PERC or s.preemptions_in_window > 0):
        churn = (
            f", {s.preemptions_in_window} preemptions in 10 s" if s.preemptions_in_window else ""
        )
        return Diagnosis(
            "memory_bound",
            f"memory-bound: KV cache {s.kv_usage_perc:.0f}% full, {s.waiting} waiting{churn}: "
            "lower engine.max_num_seqs to stop preemption churn; more throughput needs KV "
            "memory (engine.kv_cache_dtype int8, restart) or instances",
            "engine.max_num_seqs",
        )
    pre, dec = s.prefill_step_p50_ms, s.decode_step_p50_ms
    if (
        pre is not None
        and dec is not None
        and pre >= PREFILL_STALL_RATIO * dec
        and pre >= PREFILL_STALL_MS
    ):
        return Diagnosis(
            "prefill_stall",
            f"prefill stalls: steps with prefill take {_duration(pre)}, decode-only "
            f"{_duration(dec)}: lower engine.max_num_batched_tokens (or "
            "engine.prefill_chunk_size)",
            "engine.max_num_batched_tokens",
        )
    return None
