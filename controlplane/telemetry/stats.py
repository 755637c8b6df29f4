"""Numbers for ``GET /admin/stats``, computed from the engine's recent StepStats.

Pure functions: the engine's StepStats (torch-free, `controlplane.engine.types`) in, a
JSON-ready dict out. Nothing here imports torch or needs an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from controlplane.common import percentile
from controlplane.engine.types import StepStats

__all__ = ["async_scheduling", "cache_and_speculation", "summarize"]


def summarize(
    steps: Sequence[StepStats],
    *,
    now: float,
    window_s: float = 10.0,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> dict[str, Any]:
    """Summarize recent engine steps (oldest first) for ``GET /admin/stats``.

    Point-in-time values come from the latest step (``steps[-1]``): ``num_running``,
    ``num_waiting``, ``num_swapped``, ``kv_blocks_used``, ``kv_blocks_total``,
    ``kv_usage_perc`` (percent, 0-100; note that the Prometheus gauge
    ``controlplane:kv_cache_usage_perc`` is a 0-1 fraction, as in vLLM), ``num_preemptions``
    and ``num_finished`` (cumulative), ``step`` (its number) and ``batch_fill_seqs``
    (``num_running / max_num_seqs``).

    Windowed values use the steps whose ``time`` lies in ``(now - window_s, now]``, step 0
    (the engine's snapshot before its first step) excluded:

    - ``steps_in_window``;
    - ``step_time_p50_ms`` / ``step_time_p99_ms``: linear-interpolation percentiles of
      ``step_duration``; None when no step is in the window;
    - ``prefill_step_p50_ms`` / ``decode_step_p50_ms``: the p50 of ``step_duration`` over the
      window's steps that carried prefill tokens (``num_prefill_tokens > 0``, decodes beside
      them or not) and over its decode-only steps (no prefill, ``num_decode_tokens > 0``);
      None when the window has no such step. Prefill steps far slower than decode-only ones
      are what stalls every running stream (the diagnosis ``prefill_stall``);
    - ``batch_fill_tokens``: mean of ``(num_prefill_tokens + num_decode_tokens) /
      max_num_batched_tokens``; None when no step is in the window;
    - ``preemptions_in_window``: latest cumulative ``num_preemptions`` in the window minus the
      cumulative count at the last step before the window (0 if the steps go back to the
      engine's first step; otherwise the oldest step's count, which may miss that one step's
      preemptions);
    - ``prefill_tokens_per_s`` / ``decode_tokens_per_s``: tokens of the window's steps divided
      by ``rate_window_s`` = ``min(window_s, now - start of the oldest step given)``, where a
      step starts at ``time - step_duration``. So the divisor is ``window_s`` once the steps
      cover the whole window, and the time since the first step began when the engine is
      younger than the window (or the ring holds less than a window of steps). 0.0 when no
      step is in the window.

    Empty input (engine just started, or idle with an empty ring) gives zeros and Nones, never an
    exception. ``max_num_seqs`` / ``max_num_batched_tokens`` <= 0 give None fills.
    """
    latest = steps[-1] if steps else None
    real = [s for s in steps if s.step > 0]
    lo = now - window_s
    window = [s for s in real if lo < s.time <= now]

    # Rates: tokens in the window over the time the window (or the data) covers.
    rate_window_s: float | None = None
    prefill_rate = decode_rate = 0.0
    if real:
        first = real[0]
        rate_window_s = max(0.0, min(window_s, now - (first.time - first.step_duration)))
        if window:
            prefill = sum(s.num_prefill_tokens for s in window)
            decode = sum(s.num_decode_tokens for s in window)
            if rate_window_s > 0:
                prefill_rate, decode_rate = prefill / rate_window_s, decode / rate_window_s

    durations_ms = [s.step_duration * 1000.0 for s in window]
    prefill_ms = [s.step_duration * 1000.0 for s in window if s.num_prefill_tokens > 0]
    decode_ms = [
        s.step_duration * 1000.0
        for s in window
        if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0
    ]

    batch_fill_tokens: float | None = None
    if window and max_num_batched_tokens > 0:
        batch_fill_tokens = sum(
            (s.num_prefill_tokens + s.num_decode_tokens) / max_num_batched_tokens for s in window
        ) / len(window)

    preemptions_in_window = 0
    if window:
        before = [s for s in steps if s.time <= lo]
        if before:
            base = before[-1].num_preemptions
        elif steps[0].step <= 1:
            base = 0
        else:
            base = steps[0].num_preemptions
        preemptions_in_window = max(0, window[-1].num_preemptions - base)

    if latest is None:
        return {
            "step": None,
            "num_running": 0,
            "num_waiting": 0,
            "num_swapped": 0,
            "kv_blocks_used": 0,
            "kv_blocks_total": 0,
            "kv_usage_perc": 0.0,
            "prefill_tokens_per_s": 0.0,
            "decode_tokens_per_s": 0.0,
            "step_time_p50_ms": None,
            "step_time_p99_ms": None,
            "prefill_step_p50_ms": None,
            "decode_step_p50_ms": None,
            "batch_fill_seqs": 0.0 if max_num_seqs > 0 else None,
            "batch_fill_tokens": None,
            "num_preemptions": 0,
            "preemptions_in_window": 0,
            "num_finished": 0,
            "steps_in_window": 0,
            "window_s": window_s,
            "rate_window_s": None,
        }
    total = latest.kv_blocks_total
    return {
        "step": latest.step,
        "num_running": latest.num_running,
        "num_waiting": latest.num_waiting,
        "num_swapped": latest.num_swapped,
        "kv_blocks_used": latest.kv_blocks_used,
        "kv_blocks_total": total,
        "kv_usage_perc": 100.0 * latest.kv_blocks_used / total if total else 0.0,
        "prefill_tokens_per_s": prefill_rate,
        "decode_tokens_per_s": decode_rate,
        "step_time_p50_ms": percentile(durations_ms, 50),
        "step_time_p99_ms": percentile(durations_ms, 99),
        "prefill_step_p50_ms": percentile(prefill_ms, 50),
        "decode_step_p50_ms": percentile(decode_ms, 50),
        "batch_fill_seqs": latest.num_running / max_num_seqs if max_num_seqs > 0 else None,
        "batch_fill_tokens": batch_fill_tokens,
        "num_preemptions": latest.num_preemptions,
        "preemptions_in_window": preemptions_in_window,
        "num_finished": latest.num_finished,
        "steps_in_window": len(window),
        "window_s": window_s,
        "rate_window_s": rate_window_s,
    }


def _delta(latest: StepStats, base: StepStats | None, name: str) -> Any:
    """A cumulative counter's growth since `base` (None: since start)."""
    return getattr(latest, name) - (getattr(base, name) if base is not None else 0)


def async_scheduling(latest: StepStats | None, base: StepStats | None) -> dict[str, Any]:
    """``async_step_share``: the steps of the counter window (`base` as in
    `cache_and_speculation`) that ran ahead (engine.async_scheduling), None without steps."""
    if latest is None:
        return {"async_step_share": None}
    steps = _delta(latest, base, "step")
    ahead = _delta(latest, base, "async_steps_total")
    return {"async_step_share": ahead / steps if steps > 0 else None}


def cache_and_speculation(latest: StepStats | None, base: StepStats | None) -> dict[str, Any]:
    """Prefix cache and speculative decoding figures for ``GET /admin/stats``.

    Gauges come from `latest`: ``kv_blocks_cached`` (blocks holding a cached prefix, in use or
    not), ``kv_blocks_evictable`` (cached and unused), ``prefix_cache_evictions`` (cumulative)
    and ``speculation`` (off | active | paused). Rates are the differences of the cumulative
    counters between `base` (the caller's snapshot from about a minute ago; None: since start)
    and `latest`:

    - ``prefix_cache_hit_rate``: prompt tokens found cached / prompt tokens looked up; None
      when nothing was looked up;
    - ``spec_acceptance_rate``: accepted / proposed draft tokens; None without proposals;
    - ``spec_mean_accepted_len``: tokens emitted per verification and sequence (accepted /
      drafts + 1, vLLM's "mean acceptance length"); None without drafts.
    """
    if latest is None:
        return {
            "kv_blocks_cached": 0,
            "kv_blocks_evictable": 0,
            "prefix_cache_evictions": 0,
            "prefix_cache_hit_rate": None,
            "prefix_cache_queries_in_window": 0,
            "speculation": "off",
            "spec_acceptance_rate": None,
            "spec_mean_accepted_len": None,
            "spec_drafts_in_window": 0,
        }
    delta = partial(_delta, latest, base)
    queries, hits = delta("prefix_cache_queries_total"), delta("prefix_cache_hits_total")
    drafts = delta("spec_decode_num_drafts_total")
    proposed = delta("spec_decode_num_draft_tokens_total")
    accepted = delta("spec_decode_num_accepted_tokens_total")
    return {
        "kv_blocks_cached": latest.kv_blocks_cached,
        "kv_blocks_evictable": latest.kv_blocks_evictable,
        "prefix_cache_evictions": latest.prefix_cache_evictions_total,
        "prefix_cache_hit_rate": hits / queries if queries > 0 else None,
        "prefix_cache_queries_in_window": queries,
        "speculation": latest.speculation,
        "spec_acceptance_rate": accepted / proposed if proposed > 0 else None,
        "spec_mean_accepted_len": accepted / drafts + 1 if drafts > 0 else None,
        "spec_drafts_in_window": drafts,
    }


def structured_outputs(
    latest: StepStats | None, base: StepStats | None, constrained: int, finished: int
) -> dict[str, Any]:
    """Structured-output figures for ``GET /admin/stats``: ``structured_share`` (constrained /
    finished requests in the latency window, None when none finished), ``grammar_states`` (a
    gauge), and over the counter window (`base` as in `cache_and_speculation`): mask work per
    step that had constrained rows (``grammar_mask_ms_per_step``: computing and applying;
    ``grammar_mask_wait_ms_per_step``: the step waiting for the masks after its forward,
    what the overlap did not hide) and ``grammar_cache_hit_rate`` (None without requests)."""
    out: dict[str, Any] = {
        "structured_share": constrained / finished if finished else None,
        "structured_in_window": constrained,
        "grammar_states": latest.grammar_states if latest else 0,
        "grammar_mask_ms_per_step": None,
        "grammar_mask_wait_ms_per_step": None,
        "grammar_cache_hit_rate": None,
    }
    if latest is None:
        return out
    delta = partial(_delta, latest, base)
    steps = delta("grammar_mask_steps_total")
    if steps > 0:
        out["grammar_mask_ms_per_step"] = round(1000 * delta("grammar_mask_s_total") / steps, 3)
        wait = delta("grammar_mask_wait_s_total")
        out["grammar_mask_wait_ms_per_step"] = round(1000 * wait / steps, 3)
    hits, compiles = delta("grammar_cache_hits_total"), delta("grammar_compiles_total")
    if hits + compiles > 0:
        out["grammar_cache_hit_rate"] = hits / (hits + compiles)
    return out
