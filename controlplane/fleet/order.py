"""The fleet's "worst first" order: one pure function, shared by `GET /admin/fleet`,
`controlplane fleet ls` and the dashboard's fleet screen (stdlib only: the dashboard imports
it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The order in one line, for help screens and docs (worst_first_key's docstring in words).
WORST_FIRST = (
    "worst first: unreachable; then missing its SLO; then most waiting requests; then the "
    "oldest waiting request; then draining, loading, serving; then the fullest KV cache; "
    "stopped last; ties by instance id"
)

_STATE_RANK = {"draining": 0, "loading": 1, "serving": 2}


def _figure(m: Any, name: str) -> Any:
    """`name` of a member (a registry.Member, or its dict from the API), looked up on the
    member itself, then in a "stats" mapping it may carry; None when absent (an older
    daemon's heartbeat does not have the newer figures)."""
    if isinstance(m, Mapping):
        value, stats = m.get(name), m.get("stats")
    else:
        value, stats = getattr(m, name, None), getattr(m, "stats", None)
    if value is None and isinstance(stats, Mapping):
        value = stats.get(name)
    return value


def _number(value: Any) -> float:
    """A figure as a number to sort by (unknown: 0, as if idle). bool is not a number here."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if value == value else 0.0  # NaN: unknown


def slo_missed(m: Any) -> bool | None:
    """Whether the instance's heartbeat says it misses its SLO: its `slo_met` flag when it
    sends one; else its TTFT p99 (`ttft_p99_ms`) above its autopilot target (the live setting
    `autopilot.ttft_p99_ms` in its heartbeat's config; 0: none); None when it cannot tell."""
    met = _figure(m, "slo_met")
    if isinstance(met, bool):
        return not met
    p99 = _figure(m, "ttft_p99_ms")
    config = _figure(m, "config")
    target = config.get("autopilot.ttft_p99_ms") if isinstance(config, Mapping) else None
    if _number(p99) > 0 and _number(target) > 0:
        return _number(p99) > _number(target)
    return None


def worst_first_key(m: Any) -> tuple:
    """Sort key of the fleet's "worst first" order (smallest first), in this order:

    1. unreachable (no heartbeat for `fleet.unreachable_after_s`) first, stopped last;
    2. then instances missing their SLO (the heartbeat's `slo_met` flag, or its TTFT p99
       over its `autopilot.ttft_p99_ms` target; unknown counts as met);
    3. then more waiting requests (`num_waiting`);
    4. then an older oldest waiting request (`oldest_waiting_s`);
    5. then draining, loading, serving;
    6. then a fuller KV cache (`kv_usage`);
    7. ties by instance id.

    `m` is a registry.Member or its dict (the API's, the dashboard's); figures an older
    heartbeat lacks (None or absent) sort as 0 / met.
    """
    state = _figure(m, "state")
    liveness = 0 if state == "unreachable" else 2 if state == "stopped" else 1
    return (
        liveness,
        0 if slo_missed(m) else 1,
        -_number(_figure(m, "num_waiting")),
        -_number(_figure(m, "oldest_waiting_s")),
        _STATE_RANK.get(str(state), 3),
        -_number(_figure(m, "kv_usage")),
        str(_figure(m, "id") or ""),
    )
