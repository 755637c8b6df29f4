"""The fleet screen: one row per daemon on the shared database (GET /admin/fleet), worst first.

Enter opens the selected instance's dashboard (the app retargets to its admin URL); Escape on
the dashboard comes back here. The list is read through the instance the dashboard was started
on; when that one stops answering, through any other instance the last list named, since the
question at 3 a.m. is exactly which instance went away.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from typing import Any, ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from controlplane.client.admin import ClientError
from controlplane.fleet.order import WORST_FIRST, slo_missed, worst_first_key
from controlplane.tui.closing import StopsWorkersOnClose
from controlplane.tui.header import STATE_STYLE
from controlplane.tui.help import HelpScreen
from controlplane.tui.history import fmt_age, fmt_ms, fmt_num, fmt_usd
from controlplane.tui.tables import MeasuredTable

# (payload key, header); "worst" is controlplane.fleet.order's (WORST_FIRST says it in words),
# the server's order too.
# The figures that say "sick" first, in the order's order (the SLO, the queue, its oldest wait,
# the KV cache): at 80 columns throughput, heartbeat, model and URL are what scrolls off.
FLEET_COLUMNS = (
    ("id", "instance"),
    ("state", "state"),
    ("ttft_p99_ms", "TTFT p99"),
    ("num_waiting", "wait"),
    ("oldest_waiting_s", "oldest wait"),
    ("kv_usage", "KV"),
    ("num_running", "run"),
    ("output_tokens_per_s", "tok/s"),
    ("ttft_p50_s", "TTFT p50"),
    ("heartbeat_age_s", "heartbeat"),
    ("model", "model"),
    ("advertise_url", "url"),
)
# Row colours: a serving row plain, a stopped one (it said goodbye) dim, the others alarming.
ROW_STYLE = {**STATE_STYLE, "serving": "", "stopped": "dim"}
SORT_KEYS = ("worst", *(k for k, _ in FLEET_COLUMNS))
# Bigger is worse for these: sorted descending.
DESCENDING = {
    "num_running",
    "num_waiting",
    "oldest_waiting_s",
    "kv_usage",
    "ttft_p99_ms",
    "ttft_p50_s",
    "heartbeat_age_s",
}
# The mark (and colour) of an instance missing its SLO, in its TTFT p99 cell.
SLO_MISSED = "✗ "
SLO_MISSED_STYLE = "bold red"
# The mark on the instance the dashboard is on.
HERE = "▶ "
FLEET_KEYS = [
    ("enter", "open the selected instance's dashboard (escape there comes back)"),
    ("o", "cycle the sort column (or click a column header); worst first by default"),
    ("worst", WORST_FIRST),  # the default sort, in words
    ("▶", "the instance this dashboard is on"),
    ("✗", "missing its SLO (TTFT p99 cell, red): its minute's p99s are over their targets"),
    ("g", "refresh now"),
    ("escape", "home: the dashboard of the instance the app started on"),
    ("q", "quit"),
]


def _since(iso: str | None) -> str:
    if not iso:
        return ""
    try:
        return datetime.fromisoformat(iso).strftime(" since %H:%M:%SZ")
    except ValueError:
        return ""


def _cell(key: str, m: dict[str, Any]) -> str:
    value = m.get(key)
    if key == "ttft_p99_ms" and slo_missed(m):
        return SLO_MISSED + ("–" if value is None else fmt_ms(value))
    if key == "state" and value == "unreachable":
        return "unreachable" + _since(m.get("unreachable_since"))
    if value is None:
        return "–"
    if key == "kv_usage":
        return f"{value * 100:.0f}%"
    if key == "output_tokens_per_s":
        return fmt_num(value)
    if key == "ttft_p50_s":
        return f"{value * 1000:.0f} ms"
    if key == "ttft_p99_ms":
        return fmt_ms(value)
    if key == "oldest_waiting_s":
        return fmt_age(value)
    if key == "heartbeat_age_s":
        return f"{value:.0f}s ago"
    return str(value)


def totals_line(body: dict[str, Any]) -> Text:
    t = body.get("totals") or {}
    line = Text()
    line.append(" Fleet ", style="bold reverse")
    line.append(f" {t.get('instances', 0)} instances  ")
    line.append(f"{t.get('serving', 0)} serving", style="green")
    if t.get("unreachable"):
        line.append(f"  {t['unreachable']} unreachable", style="bold red")
    line.append("   tok/s ", style="dim")
    line.append(fmt_num(t.get("output_tokens_per_s")))
    line.append("  req/s ", style="dim")
    req_s = t.get("requests_per_s")
    line.append("–" if req_s is None else f"{req_s:.2f}")
    line.append("  cost/h ", style="dim")
    line.append(f"{fmt_usd(t.get('gpu_cost_per_hour_usd'))} GPU")
    line.append(f", {fmt_usd(t.get('list_cost_per_hour_usd'))} list", style="dim")
    return line


def drift_text(drift: dict[str, Any]) -> Text:
    if not drift:
        return Text("Config drift: none (every live instance has the same live settings)", "dim")
    out = Text()
    out.append("Config drift", style="bold yellow")
    for key, d in drift.items():
        odd = ", ".join(f"{i} = {v!r}" for i, v in d["instances"].items())
        out.append(f"\n  {key}: most have {d['majority']!r}; ")
        out.append(odd, style="yellow")
    return out


class FleetTable(MeasuredTable):
    """The instances; sortable by column (click a header or press `o`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.sort_key = "worst"
        self.rows_data: list[dict[str, Any]] = []

    def on_mount(self) -> None:
        for key, label in FLEET_COLUMNS:
            self.add_column(label, key=key)

    def here(self) -> str | None:
        """The advertise URL of the instance the dashboard is on."""
        dashboard = getattr(self.app, "dashboard", None)
        return str(dashboard.url).rstrip("/") if dashboard is not None else None

    def show(self, instances: list[dict[str, Any]]) -> None:
        self.rows_data = list(instances)
        selected = self.selected_url()
        here = self.here()
        self.clear()
        for m in self._sorted():
            style = ROW_STYLE.get(str(m.get("state")), "")
            cells = [Text(_cell(k, m), style=style) for k, _ in FLEET_COLUMNS]
            if slo_missed(m):
                p99 = [k for k, _ in FLEET_COLUMNS].index("ttft_p99_ms")
                cells[p99] = Text(cells[p99].plain, style=SLO_MISSED_STYLE)
            if here is not None and str(m.get("advertise_url") or "").rstrip("/") == here:
                cells[0] = Text(HERE, style="bold") + cells[0]
            self.add_row(*cells, key=str(m.get("id")))
        if selected is not None:
            for i, m in enumerate(self._sorted()):
                if m.get("advertise_url") == selected:
                    self.move_cursor(row=i, animate=False)
        self.border_title = f"Instances ({len(instances)})  sort: {self.sort_key}"

    def _sorted(self) -> list[dict[str, Any]]:
        if self.sort_key == "worst":
            # The server sends this order; sorted here too, so an older server's list reads
            # the same way.
            return sorted(self.rows_data, key=worst_first_key)

        def key(m: dict[str, Any]) -> tuple:
            v = m.get(self.sort_key)
            number = isinstance(v, int | float)
            return (v is None, -v if number and self.sort_key in DESCENDING else 0, str(v or ""))

        return sorted(self.rows_data, key=key)

    def sort_by(self, key: str) -> None:
        self.sort_key = "worst" if key == self.sort_key else key  # a second click: back to worst
        self.show(self.rows_data)

    def cycle_sort(self) -> None:
        self.sort_key = SORT_KEYS[(SORT_KEYS.index(self.sort_key) + 1) % len(SORT_KEYS)]
        self.show(self.rows_data)

    def selected_url(self) -> str | None:
        rows = self._sorted()
        if not rows or not 0 <= self.cursor_row < len(rows):
            return None
        return rows[self.cursor_row].get("advertise_url")


class FleetScreen(StopsWorkersOnClose, Screen[None]):
    """Polls the fleet every `interval` seconds through the app's `fleet_clients()`."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape", "back", "Dashboard"),
        Binding("o", "sort", "Sort"),
        Binding("g", "refresh", "Refresh"),
        Binding("question_mark", "help", "Help"),
        Binding("q", "app.quit", "Quit"),
    ]

    def __init__(self, interval: float = 2.0) -> None:
        super().__init__()
        self.interval = interval
        self.polls = 0

    def compose(self) -> ComposeResult:
        yield Static(Text(" Fleet  loading…", style="bold"), id="fleet-totals")
        yield FleetTable(id="fleet-table")
        yield Static("", id="fleet-drift")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(FleetTable).focus()
        self.poll()

    @work(exclusive=True, group="fleet")
    async def poll(self) -> None:
        while True:
            await self.fetch()
            await asyncio.sleep(self.interval)

    async def fetch(self) -> None:
        """The list through the first instance that answers; a line saying so if none does."""
        errors = []
        for client in self.app.fleet_clients():
            try:
                body = await client.fleet()
            except ClientError as exc:
                errors.append(f"{getattr(client, 'url', '?')}: {exc}")
                continue
            self.app.last_fleet = body
            self.polls += 1
            self._show(body)
            return
        line = Text(" Fleet ", style="bold reverse")
        line.append(f"  no instance answers: {'; '.join(errors)[:200]}", style="bold red")
        with contextlib.suppress(NoMatches):
            self.query_one("#fleet-totals", Static).update(line)

    def _show(self, body: dict[str, Any]) -> None:
        # An answer can arrive while the app shuts down, its widgets removed before its workers
        # stop (closing the screen alone cancels them first: tui/closing.py).
        with contextlib.suppress(NoMatches):
            self.query_one("#fleet-totals", Static).update(totals_line(body))
            self.query_one(FleetTable).show(body.get("instances") or [])
            self.query_one("#fleet-drift", Static).update(drift_text(body.get("config_drift")))

    @on(DataTable.RowSelected, "#fleet-table")
    def _open(self, event: DataTable.RowSelected) -> None:
        url = self.query_one(FleetTable).selected_url()
        if url:
            self.app.open_instance(url)

    @on(DataTable.HeaderSelected, "#fleet-table")
    def _header(self, event: DataTable.HeaderSelected) -> None:
        self.query_one(FleetTable).sort_by(str(event.column_key.value))

    def action_back(self) -> None:
        """Escape returns home: to the dashboard of the instance the app started on (from
        another instance's dashboard, escape leads here first, so home is two escapes away)."""
        app: Any = self.app
        home = getattr(app, "home_url", None)
        if home is not None and app.dashboard.url != home:
            app.open_instance(home)  # pops this screen too
        else:
            app.pop_screen()

    def action_sort(self) -> None:
        self.query_one(FleetTable).cycle_sort()

    def action_refresh(self) -> None:
        self.run_worker(self.fetch(), group="fleet-once")

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(FLEET_KEYS))
