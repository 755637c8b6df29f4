"""The dashboard's header line: which daemon, its state, how stale the numbers are, SLO
attainment, the autopilot, the model, the kernels and the compiled step, and uptime."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.reactive import var
from textual.widgets import Static

from controlplane.tui.history import fmt_duration
from controlplane.tui.kernels import kernels_status
from controlplane.tui.severity import STYLE as SEVERITY_STYLE
from controlplane.tui.severity import header_slo

STATE_STYLE = {
    "serving": "bold green",
    "draining": "bold yellow",
    "drained: safe to stop": "bold reverse yellow",
    "loading": "bold cyan",
    "unreachable": "bold red",
    "unauthorized": "bold red",
    "connecting": "bold cyan",
    "dead": "bold red",
    "stopped": "bold red",
}


AUTOPILOT_STYLE = {"off": "dim", "holding": "bold green", "adjusting": "bold yellow"}


def display_state(state: str | None) -> str:
    return {"ready": "serving", None: "unreachable"}.get(state, state or "unreachable")


class HeaderBar(Static):
    """One line: daemon, state, staleness, SLO attainment, autopilot, model, uptime; what does
    not fit the width is left out, least urgent first. A connection problem gets a second
    line (its reason must be readable at 80 columns).

    Its reactives are bound to the dashboard screen's (`data_bind`): any of them changing
    redraws the line."""

    url: var[str] = var("")
    stats: var[dict[str, Any] | None] = var(None)
    connected: var[bool] = var(False)
    note: var[str] = var("")
    down_state: var[str] = var("connecting")
    stale_s: var[float | None] = var(None)

    def _redraw(self) -> None:
        if self.is_mounted:
            self.update(self.line())

    watch_url = watch_stats = watch_connected = _redraw
    watch_note = watch_down_state = watch_stale_s = _redraw

    def on_resize(self) -> None:
        self._redraw()

    def line(self) -> Text:
        stats, connected, note, stale_s = self.stats, self.connected, self.note, self.stale_s
        state = display_state(stats.get("state")) if stats and connected else self.down_state
        if state == "draining" and stats and not stats.get("requests_in_flight"):
            # Nothing left in flight or queued: stopping the daemon now loses no request.
            state = "drained: safe to stop"
        # (priority: lower is kept first, label, value, style)
        parts: list[tuple[int, str, str, str]] = [
            (0, "", self.url.removeprefix("http://").removeprefix("https://"), ""),
            (0, "", state, STATE_STYLE.get(state, "bold")),
        ]
        if stats and not connected and stale_s is not None:
            # The panels below keep the last numbers, dimmed: say how old they are.
            parts.append((0, "", f"STALE {fmt_duration(stale_s)}", "bold reverse yellow"))
        if stats and connected:
            word, lvl = header_slo(stats)
            if word:
                parts.append((1, "SLO", word, SEVERITY_STYLE[lvl] if lvl is not None else "bold"))
        if stats:
            pilot = stats.get("autopilot")
            if pilot:
                missed = (stats.get("slo") or {}).get("met") is False and pilot["state"] != "off"
                # Never green while the target is missed: holding then means "cannot help".
                style = "bold red" if missed else AUTOPILOT_STYLE.get(pilot["state"], "")
                parts.append((1, "autopilot", pilot["state"] + (" ✗" if missed else ""), style))
            quant = (stats.get("memory") or {}).get("quantization")
            model = str(stats.get("model") or "–")
            parts.append((2, "", model + (f" {quant}" if quant and quant != "none" else ""), ""))
            kernels = kernels_status(stats)
            if kernels is not None and kernels[0] != "ok":
                # Slower than it should be: worth the header's room (the batch panel has the
                # reason and the compiled step).
                parts.append((1, "kernels", kernels[0], "bold yellow"))
            parts.append((3, "up", fmt_duration(stats.get("uptime_s")), ""))
            if connected and note:
                parts.append((1, "", note, "yellow"))
        width = (self.size.width or self.app.size.width) - 15
        keep: set[int] = set()
        used = 0
        for i in sorted(range(len(parts)), key=lambda i: parts[i][0]):
            n = len(parts[i][1]) + len(parts[i][2]) + 3
            if used + n <= width or parts[i][0] == 0:
                keep.add(i)
                used += n
        t = Text()
        t.append(" controlplane ", style="bold reverse")
        for i, (_, label, value, style) in enumerate(parts):
            if i in keep:
                t.append(f"  {label} " if label else "  ", style="dim")
                t.append(value, style=style)
        if note and not connected:  # its own line: the reason must fit at 80 columns
            t.append(f"\n {note}", style="bold red")
        return t
