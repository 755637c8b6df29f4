"""The on-call dashboard: a Textual app fed by the admin API (SSE for stats, REST for the rest)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, ClassVar

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.widgets import DataTable, Footer

from controlplane.client.admin import AdminClient, APIError, ClientError
from controlplane.tui.fleet import FleetScreen
from controlplane.tui.history import StatsHistory
from controlplane.tui.screens import ConfirmScreen, HelpScreen, TuneScreen
from controlplane.tui.widgets import (
    REQUEST_COLUMNS,
    BatchPanel,
    ChangesTable,
    CostPanel,
    HeaderBar,
    KVPanel,
    LatencyPanel,
    RequestsTable,
    ThroughputPanel,
)

KEYS = [
    ("f", "the fleet: every instance on this database, worst first (enter opens one)"),
    ("escape", "back to the fleet screen (once it has been opened)"),
    ("t", "tune the engine: batch, chunk, preemption, speculation, prefix caching"),
    ("p", "switch the SLO autopilot on or off (asks first; targets in the tuning form)"),
    ("c", "reset the prefix cache: drop every unused cached block (asks first)"),
    ("a", "abort the selected live request (asks first)"),
    ("d", "drain: stop admitting new requests (asks first)"),
    ("r", "resume admitting requests (asks first)"),
    ("o", "cycle the sort column (or click a column header)"),
    ("g", "refresh everything now"),
    ("l", "switch light / dark theme"),
    ("?", "this help"),
    ("tab", "move focus between the tables"),
    ("q", "quit"),
]


class _Gone:
    """Stands in for a dashboard widget that no longer exists (app shutting down)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class DashboardApp(App[None]):
    """`DashboardApp(url, token)`: pass `client_for=` (url -> an object with `AdminClient`'s
    async methods; `client=` for the first URL only) and `clock=` to feed it deterministic data
    in tests. `fleet=True` opens on the fleet screen."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "controlplane"
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (140, "-wide")]
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("f", "fleet", "Fleet"),
        Binding("escape", "back_to_fleet", "Fleet", show=False),
        Binding("t", "tune", "Tune"),
        Binding("a", "abort", "Abort"),
        Binding("d", "drain", "Drain"),
        Binding("r", "resume", "Resume"),
        Binding("c", "cache_reset", "Reset cache", show=False),
        Binding("p", "autopilot", "Autopilot", show=False),
        Binding("o", "sort", "Sort"),
        Binding("g", "refresh", "Refresh", show=False),
        Binding("l", "toggle_theme", "Theme"),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        client: Any = None,
        client_for: Callable[[str], Any] | None = None,
        clock: Callable[[], float] | None = None,
        fleet: bool = False,
        fleet_interval: float = 2.0,
        events_interval: float = 0.5,
        requests_interval: float = 1.0,
        reports_interval: float = 30.0,
        reconnect_max_s: float = 5.0,
    ) -> None:
        super().__init__()
        self.url = self.home_url = url.rstrip("/")
        self._client_for = client_for or (lambda u: AdminClient(u, token))
        # One client per instance URL, kept while the app runs (switching back is instant).
        self._clients: dict[str, Any] = {self.url: client} if client is not None else {}
        self.client = self.client_at(self.url)
        self.fleet_mode = fleet  # escape on the dashboard goes to the fleet screen
        self.fleet_interval = fleet_interval
        self.last_fleet: dict[str, Any] | None = None
        self.clock = clock or time.time
        self.events_interval = events_interval
        self.requests_interval = requests_interval
        self.reports_interval = reports_interval
        self.reconnect_max_s = reconnect_max_s
        self.history = StatsHistory()
        self.stats: dict[str, Any] | None = None
        self.fields: dict[str, Any] = {}
        self.changes: list[dict[str, Any]] = []
        self.costs: dict[str, Any] | None = None
        self.util: dict[str, Any] | None = None
        self.connected = False
        self.down_state = "connecting"
        self.note = ""
        self.stats_received = 0
        self.reconnects = 0
        self.theme = "textual-dark"

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        with VerticalScroll(id="main"):
            with Grid(id="panels"):
                yield ThroughputPanel("Throughput", id="throughput")
                yield BatchPanel("Batch", id="batch")
                yield KVPanel("KV cache", id="kv")
                yield LatencyPanel("Latency", id="latency")
                yield CostPanel("Cost & GPU (last hour)", id="cost")
            with Horizontal(id="tables"):
                yield RequestsTable(id="requests")
                yield ChangesTable(id="changes")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_header()
        self.w(CostPanel).show(None, None)
        self.w(RequestsTable).show([])
        self.stream_events()
        self.poll_requests()
        self.poll_reports()
        self.load_config()
        if self.fleet_mode:
            self.action_fleet()

    async def on_unmount(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))

    def client_at(self, url: str) -> Any:
        url = url.rstrip("/")
        if url not in self._clients:
            self._clients[url] = self._client_for(url)
        return self._clients[url]

    # -- the fleet ---------------------------------------------------------------------------
    def fleet_clients(self) -> list[Any]:
        """Where to read the fleet from: the instance the app started on, then the others the
        last list named, live ones first."""
        urls = [self.home_url, self.url]
        for m in (self.last_fleet or {}).get("instances") or []:
            if m.get("state") in ("serving", "draining", "loading"):
                urls.append(str(m.get("advertise_url")).rstrip("/"))
        return [self.client_at(u) for u in dict.fromkeys(urls)]

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """On the fleet screen the dashboard's own keys (tune, abort, drain...) are off and
        out of the footer: they would act on an instance the screen does not show."""
        on_fleet = isinstance(self.screen, FleetScreen)
        return not on_fleet or action in ("quit", "toggle_theme")

    def action_fleet(self) -> None:
        self.fleet_mode = True
        if not isinstance(self.screen, FleetScreen):
            self.push_screen(FleetScreen(self.fleet_interval))

    def action_back_to_fleet(self) -> None:
        if self.fleet_mode:
            self.action_fleet()

    def open_instance(self, url: str) -> None:
        """Show `url`'s dashboard: leave the fleet screen and follow that daemon instead."""
        if isinstance(self.screen, FleetScreen):
            self.pop_screen()
        url = url.rstrip("/")
        if url == self.url:
            return
        self.url, self.client = url, self.client_at(url)
        self.history.clear()
        self.stats, self.fields, self.changes = None, {}, []
        self.costs = self.util = None
        self.connected, self.down_state, self.note, self.reconnects = False, "connecting", "", 0
        self.refresh_header()
        self.w(ChangesTable).show([])
        self.w(RequestsTable).show([])
        self.w(CostPanel).show(None, None)
        # Exclusive workers: each call replaces the one that followed the previous daemon.
        self.stream_events()
        self.poll_requests()
        self.poll_reports()
        self.load_config()

    def w(self, cls: type[Any]) -> Any:
        """A dashboard widget, whatever modal screen is on top.

        While the app shuts down its widgets are removed before its workers stop: a worker
        that updates one then gets a stand-in whose methods do nothing, instead of crashing.
        Textual removes the children first, so a panel can still be found while its parts are
        gone: once the app stops running, every widget is the stand-in.
        """
        if not self.is_running:
            return _Gone()
        try:
            return self.screen_stack[0].query_one(cls)
        except (NoMatches, IndexError):
            return _Gone()

    def refresh_header(self) -> None:
        self.w(HeaderBar).show(self.url, self.stats, self.connected, self.note, self.down_state)

    # -- data in -----------------------------------------------------------------------------
    @work(exclusive=True, group="events")
    async def stream_events(self) -> None:
        """Follow /admin/events forever; reconnect with backoff when it breaks."""
        delay = 0.25
        while True:
            try:
                async for event, data in self.client.events(self.events_interval):
                    if event == "stats":
                        if not self.connected:
                            self.on_reconnected()
                        delay = 0.25
                        self.apply_stats(data)
                    elif event == "config":
                        self.apply_config_event(data)
                reason = "stream ended"
            except APIError as exc:  # e.g. 401: a wrong token; the daemon is up
                reason = f"API error {exc.status}: {exc.message}"
                self.down_state = "unauthorized" if exc.status in (401, 403) else "api error"
            except ClientError as exc:
                reason = str(exc) or "unreachable"
                self.down_state = "unreachable"
            except Exception as exc:  # never crash the dashboard on a bad payload
                reason = f"{type(exc).__name__}: {exc}"
                self.down_state = "unreachable"
            self.connected = False
            self.reconnects += 1
            self.note = f"reconnecting in {delay:.1f}s ({reason[:70]})"
            self.refresh_header()
            await asyncio.sleep(delay)
            delay = min(self.reconnect_max_s, delay * 2)

    def on_reconnected(self) -> None:
        was_reconnect = self.reconnects > 0
        self.connected = True
        self.note = "reconnected" if was_reconnect else ""
        if was_reconnect:
            self.history.clear()
            self.load_config()
            self.notify("reconnected to the daemon", timeout=3)

    def apply_stats(self, stats: dict[str, Any]) -> None:
        self.stats = stats
        self.stats_received += 1
        self.history.add(stats)
        self.refresh_header()
        self.w(ThroughputPanel).show(stats, self.history)
        self.w(BatchPanel).show(stats)
        self.w(KVPanel).show(stats, self.history)
        self.w(LatencyPanel).show(stats)

    def apply_config_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "autopilot":  # its changes come as config events (with their reasons)
            if self.stats is not None and self.stats.get("autopilot"):
                self.stats = {
                    **self.stats,
                    "autopilot": {**self.stats["autopilot"], "state": event.get("state")},
                }
            self.refresh_header()
            if event.get("state") == "off" and event.get("reason"):
                self.notify(f"autopilot turned itself off: {event['reason']}", severity="warning")
            return
        if kind == "state":
            if self.stats is not None:
                self.stats = {**self.stats, "state": event.get("state")}
            self.refresh_header()
            self.add_changes(
                [
                    {
                        "time": event.get("time") or self.clock(),
                        "source": event.get("source") or "api",
                        "actor": event.get("actor"),
                        "field": "state",
                        "old": None,
                        "new": event.get("state"),
                    }
                ]
            )
            return
        new = [
            {
                "time": event.get("time") or self.clock(),
                "source": event.get("source"),
                "actor": event.get("actor"),
                "field": c.get("field"),
                "old": c.get("old"),
                "new": c.get("new"),
                "reason": c.get("reason"),
            }
            for c in event.get("changes") or []
        ]
        for c in new:
            if c["field"] in self.fields:
                self.fields[c["field"]] = {**self.fields[c["field"]], "value": c["new"]}
        self.add_changes(new)

    def add_changes(self, new: list[dict[str, Any]]) -> None:
        if new:
            self.changes = [*reversed(new), *self.changes][: ChangesTable.MAX_ROWS]
            self.w(ChangesTable).show(self.changes)

    @work(exclusive=True, group="config")
    async def load_config(self) -> None:
        try:
            self.fields = (await self.client.config()).get("fields") or {}
            entries = (await self.client.history(50)).get("changes") or []
        except ClientError:
            return  # the events worker reports the connection state
        self.changes = [
            {
                "time": e.get("time"),
                "source": e.get("source"),
                "actor": e.get("actor"),
                "field": e.get("field"),
                "old": e.get("old_value"),
                "new": e.get("new_value"),
                "reason": e.get("reason"),
            }
            for e in entries
        ]
        self.w(ChangesTable).show(self.changes)

    @work(exclusive=True, group="requests")
    async def poll_requests(self) -> None:
        while True:
            await self.fetch_requests()
            await asyncio.sleep(self.requests_interval)

    async def fetch_requests(self) -> None:
        try:
            live = (await self.client.requests()).get("live") or []
            used, cached = await self.client.block_map()
        except ClientError:
            return
        self.w(RequestsTable).show(live)
        self.w(KVPanel).show_map(used, cached)

    @work(exclusive=True, group="reports")
    async def poll_reports(self) -> None:
        while True:
            await self.fetch_reports()
            await asyncio.sleep(self.reports_interval)

    async def fetch_reports(self) -> None:
        try:
            self.costs = await self.client.costs("1h")
            self.util = await self.client.utilization("1h")
        except ClientError:
            pass
        self.w(CostPanel).show(self.costs, self.util)

    def config_applied(self, answer: dict[str, Any]) -> None:
        """Called by the tuning form after a successful PATCH."""
        self.fields = answer.get("fields") or self.fields
        changed = answer.get("changed") or []
        if changed:
            self.notify(
                "applied: " + ", ".join(f"{c['field']} = {c['new']}" for c in changed), timeout=4
            )

    # -- actions -----------------------------------------------------------------------------
    def action_tune(self) -> None:
        if not self.fields:
            self.notify("config not loaded yet (is the daemon reachable?)", severity="warning")
            self.load_config()
            return
        self.push_screen(TuneScreen(self.client, self.fields))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(KEYS))

    def action_sort(self) -> None:
        self.w(RequestsTable).cycle_sort()

    @on(DataTable.HeaderSelected, "#requests")
    def _header_selected(self, event: DataTable.HeaderSelected) -> None:
        key = event.column_key.value
        if key in dict(REQUEST_COLUMNS):
            self.w(RequestsTable).sort_by(key)

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.theme == "textual-dark" else "textual-dark"

    def action_refresh(self) -> None:
        self.load_config()
        self.refresh_once()

    @work(group="refresh")
    async def refresh_once(self) -> None:
        await self.fetch_requests()
        await self.fetch_reports()

    def action_abort(self) -> None:
        rid = self.w(RequestsTable).selected_id()
        if rid is None:
            self.notify("no live request selected", severity="warning")
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_call(self.client.abort, rid, done=f"aborted {rid}")

        self.push_screen(ConfirmScreen(f"Abort request [b]{rid}[/]?"), answered)

    def action_drain(self) -> None:
        self._confirm_call(
            "Drain: stop admitting new requests (running ones finish)?", "drain", "draining"
        )

    def action_cache_reset(self) -> None:
        self._confirm_call(
            "Reset the prefix cache: drop every cached block no request uses?",
            "cache_reset",
            "prefix cache reset",
        )

    def action_autopilot(self) -> None:
        pilot = (self.stats or {}).get("autopilot")
        if not pilot:
            self.notify("no autopilot state yet (is the daemon reachable?)", severity="warning")
            return
        on = pilot["state"] != "off"
        goals = ", ".join(
            f"{name} p99 ≤ {pilot[key]:g} ms"
            for name, key in (("ITL", "itl_p99_ms"), ("TTFT", "ttft_p99_ms"))
            if pilot.get(key)
        )
        question = (
            "Turn the autopilot [b]off[/]? The knobs keep their current values."
            if on
            else f"Turn the autopilot [b]on[/] ({goals or 'no target set yet: t sets them'})? "
            "It will move max_num_seqs, the token budget and the chunk size by itself."
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_call(
                    self.client.patch_autopilot,
                    {"enabled": not on},
                    done=f"autopilot {'off' if on else 'on'}",
                )

        self.push_screen(ConfirmScreen(question), answered)

    def action_resume(self) -> None:
        self._confirm_call("Resume admitting new requests?", "resume", "resumed")

    def _confirm_call(self, question: str, method: str, done: str) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.run_call(getattr(self.client, method), done=done)

        self.push_screen(ConfirmScreen(question), answered)

    @work(group="calls")
    async def run_call(self, fn: Callable[..., Any], *args: Any, done: str) -> None:
        try:
            answer = await fn(*args)
        except APIError as exc:
            self.notify(f"{exc.status}: {exc.message}", severity="error", timeout=6)
            return
        except ClientError as exc:
            self.notify(f"daemon unreachable: {exc}", severity="error", timeout=6)
            return
        if isinstance(answer, dict) and "state" in answer and self.stats is not None:
            self.stats = {**self.stats, "state": answer["state"]}
            self.refresh_header()
        self.notify(done, timeout=3)
        await self.fetch_requests()
