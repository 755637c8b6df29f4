"""Severity of the numbers that can be bad: ok, warn or crit against the daemon's thresholds.

The daemon sends its effective thresholds with every stats snapshot (`thresholds`: the
`[alerts]` section, or warn 0.8 x / crit 1 x the autopilot's target where one is set), so every
dashboard on a fleet colours the same value the same way. Pure functions, no Textual.
"""

from __future__ import annotations

from typing import Any

OK, WARN, CRIT = 0, 1, 2
# crit is reverse video as well as red, so that it still stands out under NO_COLOR.
STYLE = {OK: "green", WARN: "bold yellow", CRIT: "bold reverse red"}
WORD = {OK: "ok", WARN: "warn", CRIT: "crit"}
# Trend lines in their level's colour, never reversed (reverse video hides block glyphs).
LINE_STYLE = {OK: "green", WARN: "yellow", CRIT: "red"}


def level(value: Any, limits: dict[str, Any] | None) -> int | None:
    """OK / WARN / CRIT for a value where higher is worse; None when either is unknown."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not limits:
        return None
    warn, crit = limits.get("warn"), limits.get("crit")
    if isinstance(crit, (int, float)) and value >= crit:
        return CRIT
    if isinstance(warn, (int, float)) and value >= warn:
        return WARN
    return OK


def metric_level(stats: dict[str, Any], name: str, value: Any = None) -> int | None:
    """`name`'s level in this snapshot (its own value unless `value` is given)."""
    limits = (stats.get("thresholds") or {}).get(name)
    return level(stats.get(name) if value is None else value, limits)


def queue_fill(stats: dict[str, Any]) -> float | None:
    q, cap = stats.get("queue_length"), stats.get("max_queue_len")
    if isinstance(q, (int, float)) and isinstance(cap, (int, float)) and cap > 0:
        return q / cap
    return None


def paint(text: str, lvl: int | None, styles: dict[int, str] = STYLE) -> str:
    """`text` in its level's style (Rich markup); plain bold when the level is unknown."""
    return f"[b]{text}[/]" if lvl is None else f"[{styles[lvl]}]{text}[/]"


def worst(*levels: int | None) -> int | None:
    known = [lv for lv in levels if lv is not None]
    return max(known) if known else None


def header_slo(stats: dict[str, Any]) -> tuple[str, int | None]:
    """SLO attainment over 60 s as a word, and its level: crit when the p99s miss a target,
    ok when they meet them; ("", None) when no target is known."""
    slo = stats.get("slo") or {}
    att, met = slo.get("attainment"), slo.get("met")
    if att is None and met is None:
        return "", None
    return ("–" if att is None else f"{att:.0%}"), None if met is None else (OK if met else CRIT)
