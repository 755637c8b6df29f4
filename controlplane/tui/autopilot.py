"""The SLO autopilot's detail view (GET /admin/autopilot): on / off and targets, its bounds, the
operator pins in force (which knob, by whom, how long still), and its last decisions, each
with the time, acted or held, the knob, old -> new and the full reason, wrapped, never cut.
Refreshes every few seconds; escape closes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, ClassVar

from rich.console import Group
from rich.markup import escape
from rich.padding import Padding
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from controlplane.client.admin import APIError, ClientError
from controlplane.tui.closing import StopsWorkersOnClose

# Who pins a knob: the sources the autopilot counts as an operator's (autopilot/pilot.py).
OPERATOR_SOURCES = ("api", "tui", "file", "env", "fleet")
HISTORY_LIMIT = 200  # audit entries read to find who set a pinned knob


def _ms(value: Any) -> str:
    return f"{value:g} ms" if isinstance(value, int | float) else "none"


def _pct(value: Any) -> str:
    return f"{value:.0%}" if isinstance(value, int | float) else "–"


def remaining(seconds: float) -> str:
    """How long a pin still holds: 9m 52s left (or 1h 2m left)."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60}m left"
    return f"{s // 60}m {s % 60:02d}s left" if s >= 60 else f"{s}s left"


def summary_text(state: dict[str, Any]) -> str:
    on = state.get("enabled")
    word = "[b green]ON[/]" if on else "[b red]OFF[/]"
    targets = state.get("targets") or {}
    att = state.get("attainment") or {}
    lines = [
        f"[b]Autopilot[/] {word} ({escape(str(state.get('state')))}) · decides every "
        f"{state.get('interval_s', 0):g} s",
        f"targets: TTFT p99 ≤ {_ms(targets.get('ttft_p99_ms'))}, ITL p99 ≤ "
        f"{_ms(targets.get('itl_p99_ms'))} · requests within them: TTFT {_pct(att.get('ttft'))}, "
        f"ITL {_pct(att.get('itl'))}",
    ]
    bounds = state.get("bounds") or {}
    if bounds:
        lines.append(
            "bounds: " + ", ".join(f"{k} {lo}–{hi}" for k, (lo, hi) in bounds.items()),
        )
    if state.get("off_reason"):
        lines.append(f"[b yellow]turned off: {escape(str(state['off_reason']))}[/]")
    return "\n".join(lines)


def pins_text(state: dict[str, Any], setters: dict[str, str]) -> str:
    """The pins in force, with who set the knob (from the audit log) and the time left; the
    ceilings and floors it learned."""
    pinned = state.get("pinned") or {}
    lines = ["[b]Operator pins[/] (the autopilot leaves these knobs alone)"]
    for knob, left in sorted(pinned.items()):
        who = setters.get(knob, "an operator")
        lines.append(f"  [b]{escape(knob)}[/] pinned by {escape(who)}, {remaining(left)}")
    if not pinned:
        lines.append("  [dim]none[/]")
    for name, says in (("ceilings", "not climbed back to"), ("floors", "not gone below")):
        values = state.get(name) or {}
        if values:
            shown = ", ".join(f"{k} {v}" for k, v in values.items())
            lines.append(f"{name} ({says}): {escape(shown)}")
    return "\n".join(lines)


def decision_parts(d: dict[str, Any]) -> tuple[str, str]:
    """One decision: its head line (time, acted / held, knob old -> new, as Rich markup) and
    its full reason (plain text)."""
    t = d.get("time")
    when = time.strftime("%H:%M:%S", time.localtime(t)) if isinstance(t, int | float) else "?"
    if d.get("applied"):
        head = f"[b green]ACTED[/] {escape(str(d.get('knob')))} {d.get('old')} → {d.get('new')}"
        if d.get("direction"):
            head += f" [dim]({escape(str(d['direction']))})[/]"
    elif d.get("knob"):  # a change it decided but could not apply
        head = f"[b red]REFUSED[/] {escape(str(d['knob']))} {d.get('old')} → {d.get('new')}"
    else:
        head = "[b]HELD[/]"
    return f"[b]{when}[/] {head}", str(d.get("reason") or "")


def decisions_renderable(decisions: list[dict[str, Any]]) -> Group:
    """The decisions, newest first: each reason wrapped under its head line with a hanging
    indent (the whole text, never cut to a cell)."""
    parts: list[Any] = [Text.from_markup(f"[b]Last decisions[/] ({len(decisions)}, newest first)")]
    for d in decisions:
        head, reason = decision_parts(d)
        parts += [Text.from_markup(head), Padding(Text(reason), (0, 0, 1, 2))]
    if not decisions:
        parts.append(Text.from_markup("  [dim]none yet[/]"))
    return Group(*parts)


def setters_from(history: list[dict[str, Any]], knobs: list[str]) -> dict[str, str]:
    """knob -> "source (actor)" of the newest operator change to engine.<knob>."""
    out: dict[str, str] = {}
    for entry in history:  # newest first
        knob = str(entry.get("field") or "").removeprefix("engine.")
        if knob in knobs and knob not in out and entry.get("source") in OPERATOR_SOURCES:
            actor = entry.get("actor")
            out[knob] = f"{entry['source']} ({actor})" if actor else str(entry["source"])
    return out


class AutopilotScreen(StopsWorkersOnClose, ModalScreen[None]):
    """`AutopilotScreen(client)`: what the autopilot is doing and why, from GET
    /admin/autopilot every `interval` seconds (and GET /admin/config/history for who pinned a
    knob). Escape (or q) closes; g refreshes now."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape,q", "close", "Close"),
        Binding("g", "refresh", "Refresh"),
    ]

    def __init__(
        self, client: Any, interval: float = 2.0, clock: Callable[[], float] | None = None
    ):
        super().__init__()
        self.client = client
        self.interval = interval
        self.clock = clock or time.time
        self.state: dict[str, Any] | None = None
        self.setters: dict[str, str] = {}
        self.fetches = 0

    def compose(self) -> ComposeResult:
        with Vertical(id="autopilot-box"):
            yield Static("[b]Autopilot[/] loading…", id="ap-summary")
            yield Static("", id="ap-error")
            yield Static("", id="ap-pins")
            with VerticalScroll(id="ap-decisions"):
                yield Static("", id="ap-decisions-text")
            yield Static(
                f"escape closes · g refreshes · refreshed every {self.interval:g} s",
                id="ap-help",
            )

    def on_mount(self) -> None:
        self.query_one("#ap-error", Static).display = False
        self.poll()

    @work(exclusive=True, group="autopilot-view")
    async def poll(self) -> None:
        while True:
            await self.fetch()
            await asyncio.sleep(self.interval)

    def action_refresh(self) -> None:
        self.refresh_once()

    @work(group="autopilot-view-once")
    async def refresh_once(self) -> None:
        await self.fetch()

    async def fetch(self) -> None:
        error = self.query_one("#ap-error", Static)
        try:
            state = await self.client.autopilot()
            pinned = list((state.get("pinned") or {}).keys())
            if pinned:
                entries = (await self.client.history(HISTORY_LIMIT)).get("changes") or []
                self.setters = setters_from(entries, pinned)
        except APIError as exc:
            error.update(f"[b red]{exc.status}: {escape(exc.message)}[/] (showing the last answer)")
            error.display = True
            return
        except ClientError as exc:
            error.update(f"[b red]daemon unreachable: {escape(str(exc))}[/]")
            error.display = True
            return
        error.display = False
        self.state = state
        self.fetches += 1
        self.show()

    def show(self) -> None:
        state = self.state or {}
        self.query_one("#ap-summary", Static).update(summary_text(state))
        self.query_one("#ap-pins", Static).update(pins_text(state, self.setters))
        decisions = state.get("decisions") or []
        self.query_one("#ap-decisions-text", Static).update(decisions_renderable(decisions))

    def action_close(self) -> None:
        self.dismiss(None)
