"""One utilization sample of the engine over a wall-clock interval, from its per-step stats.

Pure: no torch, no engine, no clock. Every interval the daemon takes the engine's latest
`StepStats` and differences it with the one taken at the previous sample: the snapshots carry
cumulative counters, so the sample is exact for any interval length and any step rate.
"""

from __future__ import annotations

from datetime import UTC, datetime

from controlplane.accounting.samples import UtilizationSample  # the store owns the record shapes
from controlplane.engine.types import StepStats

__all__ = ["UtilizationSample", "make_sample"]


def make_sample(
    prev: StepStats,
    cur: StepStats,
    *,
    start: float,
    end: float,
    model: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    queue_length: int,
    flops_per_token: float | None,
) -> UtilizationSample:
    """The interval ``(start, end]`` as the difference of two engine snapshots.

    ``prev`` and ``cur`` are the engine's `StepStats` taken at ``start`` and ``end``. Their
    cumulative counters (busy time, tokens, running and batched-token sums) make the sample
    exact however many steps ran in between and however long the interval is; a step is
    attributed to the snapshot after it ends.

    - ``busy_fraction``: busy time between the snapshots over ``end - start``, clipped to [0, 1].
    - fills: means over the steps between the snapshots (None when no step ran); not clipped,
      so above 1 means ``max_num_seqs`` was lowered live under a fuller batch.
    - rates: tokens between the snapshots over ``end - start``.
    - ``kv_usage`` and ``num_running``: from ``cur``.
    - ``prefix_cache_hit_rate``: prompt tokens found cached / looked up between the snapshots,
      ``spec_acceptance_rate``: accepted / proposed draft tokens; None when there were none.
    """
    if not end > start:
        raise ValueError(f"empty interval: start={start} end={end}")
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
    interval = end - start
    steps = cur.step - prev.step
    busy = cur.busy_s_total - prev.busy_s_total
    fill_seqs = fill_tokens = None
    if steps > 0:
        fill_seqs = (cur.running_total - prev.running_total) / (steps * max_num_seqs)
        fill_tokens = (cur.batched_tokens_total - prev.batched_tokens_total) / (
            steps * max_num_batched_tokens
        )
    return UtilizationSample(
        time=datetime.fromtimestamp(end, UTC),
        interval_s=interval,
        model=model,
        busy_fraction=min(max(busy / interval, 0.0), 1.0),
        batch_fill_seqs=fill_seqs,
        batch_fill_tokens=fill_tokens,
        kv_usage=cur.kv_blocks_used / cur.kv_blocks_total if cur.kv_blocks_total > 0 else None,
        prefill_tokens_per_s=(cur.prefill_tokens_total - prev.prefill_tokens_total) / interval,
        decode_tokens_per_s=(cur.decode_tokens_total - prev.decode_tokens_total) / interval,
        queue_length=queue_length,
        num_running=cur.num_running,
        flops_per_token=flops_per_token,
        prefix_cache_hit_rate=_ratio(
            cur.prefix_cache_hits_total - prev.prefix_cache_hits_total,
            cur.prefix_cache_queries_total - prev.prefix_cache_queries_total,
        ),
        spec_acceptance_rate=_ratio(
            cur.spec_decode_num_accepted_tokens_total - prev.spec_decode_num_accepted_tokens_total,
            cur.spec_decode_num_draft_tokens_total - prev.spec_decode_num_draft_tokens_total,
        ),
    )


def _ratio(part: int, whole: int) -> float | None:
    # None when nothing was counted, and when a counter went backwards (a restarted engine
    # starts its counters at 0): the interval's ratio is unknown then, not negative or above 1.
    return part / whole if whole > 0 and 0 <= part <= whole else None
