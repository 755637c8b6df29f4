"""What explains an incident, on one screen: the diagnosis line and the signals panel.

Both read the daemon's stats snapshot (GET /admin/stats, the SSE stream) as it comes: the
daemon computes the rates over 10 s, the 60 s and 10 s latency percentiles, the thresholds and
the diagnosis; this module only lays them out and colours them (controlplane/tui/severity.py).
Trend lines come from the dashboard's own 15-minute history of snapshots.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.reactive import var
from textual.widgets import Static

from controlplane.tui.history import StatsHistory, fmt_age, fmt_ms, fmt_num, fmt_value
from controlplane.tui.panels import Panel
from controlplane.tui.severity import (
    CRIT,
    LINE_STYLE,
    WARN,
    header_slo,
    metric_level,
    paint,
    queue_fill,
)

# (label, stats key, thresholds key or None, unit) of each trend line, in the order an incident
# is read: is work piling up, are users waiting, is memory the cause, is the engine still
# producing.
TRENDS = (
    ("queue", "queue_length", None, ""),
    ("TTFT p99", "ttft_p99_ms", "ttft_p99_ms", "ms"),
    ("ITL p99", "itl_p99_ms", "itl_p99_ms", "ms"),
    ("KV", "kv_usage_perc", "kv_usage_perc", "%"),
    ("tok/s", "decode_tokens_per_s", None, ""),
)


def fmt_rate(v: Any) -> str:
    return "–" if not isinstance(v, (int, float)) else f"{v:.1f}/s"


class DiagnosisBar(Static):
    """One line under the header: the daemon's diagnosis and the knob that addresses it, or
    that nothing is wrong by its rules. `stats` is bound to the dashboard screen's."""

    stats: var[dict[str, Any] | None] = var(None)

    def watch_stats(self, stats: dict[str, Any] | None) -> None:
        diag = (stats or {}).get("diagnosis")
        if not stats:
            self.update("")
            self.set_class(False, "-incident")
        elif diag:
            message, knob_name = str(diag.get("message") or ""), diag.get("knob")
            knob = "" if not knob_name or knob_name in message else f"  [dim]knob:[/] {knob_name}"
            # The message names the diagnosis itself ("overloaded: ..."): a marker is enough.
            self.update(f"[bold reverse red] ▲ [/] {message}{knob}")
            self.set_class(True, "-incident")
        else:
            self.update("[green]●[/] [dim]no incident signal (queue, KV, prefill, load)[/]")
            self.set_class(False, "-incident")


class SignalsPanel(Panel):
    """Arrivals against completions, rejections and failures, the queue against its cap and its
    oldest request's age, prefill against decode step time, latency over 60 s and 10 s, SLO
    attainment, and 15-minute trend lines. `stats` is bound to the dashboard screen's."""

    stats: var[dict[str, Any] | None] = var(None)

    def __init__(self, title: str, history: StatsHistory, **kwargs: Any) -> None:
        super().__init__(title, **kwargs)
        self.history = history
        self.body = Static(id="signals-body")

    def compose(self) -> ComposeResult:
        yield self.body

    def on_resize(self) -> None:
        self.watch_stats(self.stats)  # the trend lines fit the new width

    def watch_stats(self, stats: dict[str, Any] | None) -> None:
        stats = stats or {}
        # Before the first layout the panel has no size yet: assume the screen's width.
        width = max(20, self.content_size.width or self.app.size.width - 6)
        self.body.update("\n".join(signal_lines(stats) + trend_lines(stats, self.history, width)))


def signal_lines(s: dict[str, Any]) -> list[str]:
    """Three lines of at most ~72 characters (they fit an 80-column panel): load, queue and
    memory, latency and the SLO."""
    arrivals, best = s.get("arrivals_per_s"), s.get("best_completion_rate_per_s")
    over = (
        CRIT
        if isinstance(arrivals, (int, float))
        and isinstance(best, (int, float))
        and arrivals > 1.1 * best
        else None
    )
    load = (
        f"in {paint(fmt_rate(arrivals), over)} out [b]{fmt_rate(s.get('completions_per_s'))}[/]"
        f" [dim](best {fmt_rate(best)})[/]  "
        f"rej {paint(fmt_rate(s.get('rejected_per_s')), metric_level(s, 'rejected_per_s'))}"
        f" [dim](429 {fmt_num(s.get('rejected_429_per_s'))} "
        f"503 {fmt_num(s.get('rejected_503_per_s'))})[/]  "
        f"fail {paint(fmt_rate(s.get('failed_per_s')), metric_level(s, 'failed_per_s'))}"
    )
    q_level = metric_level(s, "queue_fill", queue_fill(s))
    oldest = s.get("oldest_waiting_s")
    pre, dec = s.get("prefill_step_p50_ms"), s.get("decode_step_p50_ms")
    stall = (
        WARN
        if isinstance(pre, (int, float)) and isinstance(dec, (int, float)) and pre >= 4 * dec
        else None
    )
    q = f"{fmt_value(s.get('queue_length'))}/{fmt_value(s.get('max_queue_len'))}"
    kv = fmt_num(s.get("kv_usage_perc"), 0) + "%"
    queue = (
        f"queue {paint(q, q_level)} oldest {paint(fmt_age(oldest), q_level if oldest else None)}"
        f"  KV {paint(kv, metric_level(s, 'kv_usage_perc'))}"
        f"  prefill {paint(fmt_ms(pre), stall)} decode [b]{fmt_ms(dec)}[/]"
    )

    def lat(name: str) -> str:
        v60, v10 = s.get(f"{name}_p99_ms"), s.get(f"{name}_p99_10s_ms")
        return (
            f"{paint(fmt_ms(v60), metric_level(s, f'{name}_p99_ms'))}"
            f" [dim](10 s[/] {paint(fmt_ms(v10), metric_level(s, f'{name}_p99_ms', v10))}[dim])[/]"
        )

    word, slo_level = header_slo(s)
    latency = f"TTFT p99 {lat('ttft')}  ITL p99 {lat('itl')}  SLO {paint(word or '–', slo_level)}"
    return [load, queue, latency]


def trend_lines(s: dict[str, Any], hist: StatsHistory, width: int) -> list[str]:
    """One cell per `label spark value` of TRENDS, two or three to a line as the width allows;
    each coloured by its current level."""
    per_line = 3 if width >= 120 else 2
    cell_w = (width - 2 * (per_line - 1)) // per_line
    cells = []
    for label, key, limits, unit in TRENDS:
        value = s.get(key)
        text = fmt_ms(value) if unit == "ms" else fmt_num(value, 0) + unit
        lvl = metric_level(s, limits) if limits else None
        if key == "queue_length":
            lvl = metric_level(s, "queue_fill", queue_fill(s))
        spark_w = max(4, cell_w - len(label) - len(text) - 2)
        line = hist.trend(key, spark_w)
        pad = " " * (cell_w - len(label) - spark_w - len(text) - 2)
        cells.append(
            f"[dim]{label}[/] {paint(line.ljust(spark_w), lvl, LINE_STYLE)} {pad}{paint(text, lvl)}"
        )
    rows = [cells[i : i + per_line] for i in range(0, len(cells), per_line)]
    return ["  ".join(r) for r in rows]
