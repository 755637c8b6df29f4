"""The tuning form's preview (no Textual): one line per changed setting saying what the change
would do now, from the latest stats; and the simulator's prediction for the whole change on the
last window of traffic (POST /admin/simulate)."""

from __future__ import annotations

from typing import Any

from controlplane.tui.tune_fields import fmt


def _n(stats: dict[str, Any] | None, name: str) -> int | None:
    value = (stats or {}).get(name)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def preview(
    key: str, old: Any, new: Any, stats: dict[str, Any] | None, fields: dict[str, Any]
) -> str:
    """One line: what changing `key` from `old` to `new` would do now, from the latest stats
    (what the daemon does with it: controlplane/engine/scheduler.py preempts the running
    sequences above a lowered max_num_seqs at its next step; controlplane/openai/serving.py
    answers 429 to a new request that would wait beyond max_queue_len, and drops no one)."""
    up = isinstance(new, int | float) and isinstance(old, int | float) and new > old
    running, queue = _n(stats, "num_running"), _n(stats, "queue_length")
    n = fmt(new)
    if key == "engine.max_num_seqs":
        return _seqs_line(n, int(new), up, running, queue, stats, fields)
    if key == "engine.max_num_batched_tokens":
        if up:
            return (
                f"raising max_num_batched_tokens to {n} lengthens prefill steps: ITL p99 may rise"
            )
        seqs = _n(stats, "max_num_seqs") or (fields.get("engine.max_num_seqs") or {}).get("value")
        refused = isinstance(seqs, int) and new < seqs
        return f"lowering max_num_batched_tokens to {n}: shorter steps, prompts take more of " + (
            f"them; below max_num_seqs ({seqs}): the daemon will refuse it"
            if refused
            else "them: TTFT may rise"
        )
    if key == "engine.prefill_chunk_size":
        if up:
            return (
                f"raising prefill_chunk_size to {n}: first tokens sooner, but the decode steps "
                "a chunk rides with stall longer: ITL p99 may rise"
            )
        return (
            f"lowering prefill_chunk_size to {n}: smoother decode steps, long prompts take "
            "more steps: TTFT may rise"
        )
    if key == "server.max_queue_len":
        return _queue_line(n, new, up, queue)
    if key in ("autopilot.ttft_p99_ms", "autopilot.itl_p99_ms"):
        metric = "TTFT" if "ttft" in key else "ITL"
        pilot = (stats or {}).get("autopilot") or {}
        off = " (the autopilot is off: p turns it on)" if pilot.get("state") == "off" else ""
        if not new:
            return f"no {metric} p99 target: the autopilot stops aiming at {metric}{off}"
        measured = (stats or {}).get(key.removeprefix("autopilot."))
        if not isinstance(measured, int | float):
            return f"{metric} p99 target {n} ms (no {metric} measured yet){off}"
        verdict = "missed" if measured > new else "met"
        return f"{metric} p99 target {n} ms: {verdict} now ({measured:.0f} ms, last minute){off}"
    if key == "autopilot.enabled":
        if new:
            return "autopilot on: it moves max_num_seqs, the token budget and the chunk size"
        return "autopilot off: the knobs keep their current values"
    if key == "engine.enable_prefix_caching":
        if new:
            return "prefix caching on: requests sharing a prompt prefix reuse its KV blocks"
        rate = (stats or {}).get("prefix_cache_hit_rate")
        now = f" (hit rate now {rate:.0%})" if isinstance(rate, int | float) else ""
        return f"prefix caching off: no new cache hits{now}; blocks in use are not freed"
    if key == "engine.preemption_mode":
        if new == "swap":
            return "swap: a preempted request's KV moves to host memory, not recomputed"
        return "recompute: a preempted request's KV is dropped and recomputed when it resumes"
    if key == "engine.speculative_method":
        return "speculation off" if new == "off" else f"speculation {new}: from the next step"
    if key == "engine.speculative_max_batch_size":
        now = "" if running is None else f" ({running} running now: "
        now += "" if running is None else ("paused)" if running > new else "active)")
        return f"speculation pauses above {n} running sequences{now}"
    if key == "engine.speculative_num_tokens":
        longer = "longer" if up else "shorter"
        return f"{n} draft tokens per step (from {fmt(old)}): {longer} verification steps"
    return f"{key.removeprefix('engine.')} {fmt(old)} -> {n}"


def _seqs_line(
    n: str,
    new: int,
    up: bool,
    running: int | None,
    queue: int | None,
    stats: dict[str, Any] | None,
    fields: dict[str, Any],
) -> str:
    if up:
        start = ""
        if running is not None and queue is not None:
            start = f": up to {min(queue, max(0, new - running))} of the {queue} waiting start"
        kv = (stats or {}).get("kv_usage_perc")
        kv_text = f" (KV cache {kv:.0f}% used)" if isinstance(kv, int | float) else ""
        return f"raising max_num_seqs to {n}{start}; longer steps: ITL p99 may rise{kv_text}"
    mode = (fields.get("engine.preemption_mode") or {}).get("value")
    what = "KV swapped to host" if mode == "swap" else "KV dropped, recomputed later"
    if running is None:
        return f"lowering max_num_seqs to {n} preempts the running requests above {n} ({what})"
    if running > new:
        return (
            f"lowering max_num_seqs to {n} preempts about {running - new} of the {running} "
            f"running requests at the next step ({what})"
        )
    return (
        f"lowering max_num_seqs to {n}: {running} running, none preempted; fewer start per "
        f"step, the queue ({queue or 0}) may grow"
    )


def _queue_line(n: str, new: Any, up: bool, queue: int | None) -> str:
    if new == 0:
        return "max_queue_len 0: every request that finds no free batch slot gets 429"
    if queue is not None and new <= queue:
        op = "<" if new < queue else "="
        return (
            f"max_queue_len {n} {op} queue {queue}: the {queue} waiting stay queued (none is "
            f"dropped); each new request that would wait gets 429 until fewer than {n} wait"
        )
    if up:
        return f"raising max_queue_len to {n}: more requests wait (longer TTFT) instead of a 429"
    now = "" if queue is None else f" (queue now {queue})"
    return f"lowering max_queue_len to {n}{now}: a request that would wait beyond {n} gets 429"


# (title, figure, format) of the simulator's line: what an operator tunes against.
_SIMULATED = (
    ("TTFT p99", "ttft_p99_ms", "{:,.0f} ms"),
    ("ITL p99", "itl_p99_ms", "{:,.1f} ms"),
    ("throughput", "throughput_tok_s", "{:,.0f} tok/s"),
    ("preemptions", "preemptions", "{:,}"),
    ("SLO met", "slo_attainment", "{:.0%}"),
)


def simulation_lines(answer: dict[str, Any], window_s: float) -> list[str]:
    """POST /admin/simulate's answer as the form shows it: what was simulated, then each figure
    now -> with the change (both simulated: the recorded figures are another machine state's
    measurement, not the baseline of a prediction)."""
    window = answer.get("window") or {}
    cost = answer.get("cost_model") or {}
    now, new = answer.get("now") or {}, answer.get("proposed") or {}
    head = (
        f"simulated on the last {window_s / 60:g} min ({window.get('requests', 0):,} requests; "
        f"cost model of {cost.get('samples', 0):,} steps, rms {cost.get('rms_error_ms', 0):g} ms):"
    )
    parts = []
    for title, name, form in _SIMULATED:
        if name == "itl_p99_ms" and now.get("itl_gap_p99_ms") is not None:
            name = "itl_gap_p99_ms"  # over every gap, as the dashboard's ITL p99
        a, b = now.get(name), new.get(name)
        if a is None and b is None:
            continue
        shown = [("-" if v is None else form.format(v)) for v in (a, b)]
        parts.append(f"{title} {shown[0]} -> {shown[1]}")
    lines = [head, " · ".join(parts)]
    if answer.get("not_simulated"):
        lines.append("not simulated: " + ", ".join(answer["not_simulated"]))
    return lines
