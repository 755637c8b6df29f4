"""The on-call dashboard: a Textual app fed by the admin API (SSE for stats, REST for the rest)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.widgets import DataTable, Footer, Input, Static

from controlplane.client.admin import AdminClient, APIError, ClientError
from controlplane.tui.commands import CommandError
from controlplane.tui.commands import parse as parse_command
from controlplane.tui.fleet import FleetScreen
from controlplane.tui.history import StatsHistory
from controlplane.tui.screens import ConfirmScreen, HelpScreen, TuneScreen
from controlplane.tui.signals import DiagnosisBar, SignalsPanel
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
    spend_by,
)

KEYS = [
    ("f", "the fleet: every instance on this database, worst first (enter opens one)"),
    ("escape", "back to the fleet screen (once it has been opened); closes a prompt"),
    ("t", "tune the engine and the server's queue cap (preview before applying)"),
    ("/", "filter the live requests: key:NAME user:NAME state:waiting, or any word"),
    ("v", "group the live requests by API key, then by end user, then not"),
    ("a", "abort the selected live request (asks first)"),
    ("A", "abort every live request of the selected row's API key (asks first, with a count)"),
    ("s / u", "suspend / unsuspend the selected row's API key (asks first; audited)"),
    ("d / r", "drain / resume admitting requests (ask first)"),
    ("$", "the cost panel's window: 5m, 15m, 1h, 6h, 24h"),
    ("P", "the autopilot's decisions (acted and held) and the pins in force"),
    ("p", "switch the SLO autopilot on or off (asks first; targets in the tuning form)"),
    ("W", "write the live values to the config file, so they survive a restart (asks first)"),
    ("c", "reset the prefix cache: drop every unused cached block (asks first)"),
    ("o", "cycle the sort column (or click a column header)"),
    ("j k g G", "down, up, top, bottom in a table (also arrows, Home, End)"),
    (":", "command mode: drain, resume, tune, abort-key KEY, suspend KEY, cost 10m, save..."),
    ("ctrl+r", "refresh everything now"),
    ("l", "switch light / dark theme"),
    ("?", "this help"),
    ("1 .. 8", "jump to a panel: signals, requests, changes, throughput, batch, KV, latency, cost"),
    ("tab", "move focus between the tables"),
    ("q", "quit"),
]
COST_WINDOWS = ("5m", "15m", "1h", "6h", "24h")
HELP_MORE = """[b]Navigation[/]
  The diagnosis line, the signals and the live requests come first; scroll (or tab) for the
  detail panels and the change history. At 140 columns and more everything fits one screen.

[b]Colours[/]
  [green]green[/] within its threshold, [bold yellow]yellow[/] past the warning level,
  [bold reverse red]red[/] past the critical one. The daemon sends its thresholds: the
  [b]\\[alerts][/] section of its config, or, for TTFT / ITL p99, warn at 80% and crit at 100%
  of the autopilot's target when one is set. Dimmed panels and STALE in the header: the
  daemon is not answering and the numbers are the last it sent, as old as the header says.

[b]What the numbers mean[/]
  in / out        requests arriving / finishing per second over the last 10 s; best: the
                  highest completion rate of the last 15 min (in above it: overloaded)
  rej / fail      answered 429 (queue full, limits) or 503 (draining, loading) / ended in an
                  error, per second over 10 s
  queue a/b       requests waiting for the engine / server.max_queue_len (429 beyond it);
                  oldest: how long the oldest of them has waited
  prefill/decode  median step time of steps carrying prompt tokens / of decode-only steps
  TTFT / ITL p99  time to first token and between tokens, 99th percentile over 60 s, and
                  over 10 s in brackets (a fix shows there within seconds)
  SLO             share of the last 60 s's requests that met every target; red: a p99 misses
  trends          the last 15 min, one cell per interval, its highest value
  KV              share of KV-cache blocks in use; spend: list price over the cost window

[b]Fleet order[/]
  worst first: unreachable, then missing their SLO, then the most waiting requests and the
  oldest wait, then the fullest KV cache.

"""


class PromptInput(Input):
    """The one-line prompt under the panels: `/` filters the requests table as you type, `:`
    runs a command on Enter; Escape closes it (a filter edit is undone)."""

    # Shown in the footer while the prompt is open: the way out, not the dashboard's keys.
    BINDINGS: ClassVar[list[Binding]] = [Binding("escape", "cancel", "Close")]

    def action_cancel(self) -> None:
        self.app.close_prompt(cancel=True)  # type: ignore[attr-defined]

    def check_consume_key(self, key: str, character: str | None) -> bool:
        # Textual finds no character for the key named "slash", so the footer went on offering
        # `/ Filter` while `/` was being typed into the prompt.
        return key == "slash" or super().check_consume_key(key, character)


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
    # The footer shows the keys that lead somewhere; `?` lists every key.
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("f", "fleet", "Fleet"),
        Binding("escape", "back_to_fleet", "Fleet", show=False),
        Binding("t", "tune", "Tune"),
        Binding("slash", "filter", "Filter"),
        Binding("colon", "command", "Cmd"),
        Binding("v", "group", "Group", show=False),
        Binding("a", "abort", "Abort", show=False),
        Binding("A", "abort_key", "Abort key", show=False),
        Binding("s", "suspend_key", "Suspend key", show=False),
        Binding("u", "unsuspend_key", "Unsuspend key", show=False),
        Binding("d", "drain", "Drain", show=False),
        Binding("r", "resume", "Resume", show=False),
        Binding("dollar_sign", "cost_window", "Cost window", show=False),
        Binding("P", "autopilot_view", "Autopilot view", show=False),
        Binding("W", "save_config", "Save config", show=False),
        Binding("c", "cache_reset", "Reset cache", show=False),
        Binding("p", "autopilot", "Autopilot", show=False),
        Binding("o", "sort", "Sort", show=False),
        Binding("ctrl+r", "refresh", "Refresh", show=False),
        Binding("l", "toggle_theme", "Theme", show=False),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
        *(Binding(str(i + 1), f"jump({i})", f"Panel {i + 1}", show=False) for i in range(8)),
    ]
    # `1`..`8`: the panels in reading order, brought into view (and focused if they take it).
    PANELS = ("#signals", "#requests", "#changes", "#throughput", "#batch", "#kv", "#latency",
              "#cost")  # fmt: skip

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
        self.last_data_at: float | None = None  # monotonic time of the last stats snapshot
        self.reconnects = 0
        self.theme = "textual-dark"
        self.cost_window = "1h"
        self.cost_scope = "instance"
        self.spend: dict[str, Any] = {}  # group_by -> the cost report over cost_window
        self.prompt_mode = ""  # "filter" or "command" while the prompt is open
        self._filter_before = ""

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        # Above the fold at 80x24: the diagnosis, the signals and the live requests (what an
        # incident is read and acted on from); the detail panels scroll below.
        yield HeaderBar(id="header")
        yield DiagnosisBar(id="diagnosis")
        with VerticalScroll(id="main"):
            yield SignalsPanel("Signals (rates over 10 s, latency over 60 s)", id="signals")
            with Horizontal(id="tables"):
                yield RequestsTable(id="requests")
                yield ChangesTable(id="changes")
            with Grid(id="panels"):
                yield ThroughputPanel("Throughput", id="throughput")
                yield BatchPanel("Batch", id="batch")
                yield KVPanel("KV cache", id="kv")
                yield LatencyPanel("Latency", id="latency")
                yield CostPanel("Cost", id="cost")
        # The prompt's row, between the panels and the footer while open: the mode (`:` or
        # `/`), then what is typed, as in vi or less.
        with Horizontal(id="prompt-bar", classes="-hidden"):
            yield Static(id="prompt-mode")
            yield PromptInput(id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_header()
        self.set_interval(1.0, self._tick_stale)
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

    def on_resize(self) -> None:
        """Wide, the detail panels go above the tables (everything fits on one screen);
        narrow, the tables come first, right under the signals (above the fold at 80x24)."""
        try:
            main = self.screen_stack[0].query_one("#main")
            panels, tables = main.query_one("#panels"), main.query_one("#tables")
        except (NoMatches, IndexError):
            return
        wide = self.size.width >= 140
        first = main.children.index(panels) < main.children.index(tables)
        if wide and not first:
            main.move_child(panels, before=tables)
        elif not wide and first:
            main.move_child(tables, before=panels)

    def _tick_stale(self) -> None:
        if not self.connected and self.last_data_at is not None:
            self.refresh_header()  # the age of the stale numbers

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
        self.last_data_at = None  # the other daemon's numbers are not this one's, stale or not
        self.connected, self.down_state, self.note, self.reconnects = False, "connecting", "", 0
        self.refresh_header()
        self.w(ChangesTable).show([])
        self.w(RequestsTable).show([])
        self.w(CostPanel).show(None, None)
        self.blank_panels()
        # Exclusive workers: each call replaces the one that followed the previous daemon.
        self.stream_events()
        self.poll_requests()
        self.poll_reports()
        self.load_config()

    def blank_panels(self) -> None:
        """Dashes everywhere until this daemon's first snapshot: never another one's numbers."""
        self.w(DiagnosisBar).show(None)
        for panel in (SignalsPanel, ThroughputPanel, KVPanel):
            self.w(panel).show({}, self.history)
        self.w(BatchPanel).show({})
        self.w(LatencyPanel).show({})

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
        stale = None
        if not self.connected and self.last_data_at is not None:
            stale = max(0.0, time.monotonic() - self.last_data_at)
        self.w(HeaderBar).show(
            self.url, self.stats, self.connected, self.note, self.down_state, stale
        )
        # Disconnected, the last numbers stay on screen, dimmed, until fresh ones arrive.
        main = self.screen_stack[0].query("#main") if self.is_running and self.screen_stack else []
        for widget in main:
            widget.set_class(stale is not None, "-stale")

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
        self.last_data_at = time.monotonic()
        self.history.add(stats)
        self.refresh_header()
        self.w(DiagnosisBar).show(stats)
        self.w(SignalsPanel).show(stats, self.history)
        self.w(RequestsTable).model = str(stats.get("model") or "")
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
        # $ per 1M tokens with the GPU's share: the last whole hour, from the hourly rollups
        # (an exact window from the request rows has no GPU cost).
        end = datetime.fromtimestamp(self.clock() // 3600 * 3600, UTC)
        last_hour = ((end - timedelta(hours=1)).isoformat(), end.isoformat())
        try:
            self.costs = await self.client.costs(last_hour[0], until=last_hour[1])
            self.util = await self.client.utilization("1h")
        except ClientError:
            pass
        await self.fetch_costs()

    async def fetch_costs(self) -> None:
        """Spend over the chosen window, grouped three ways; the requests table's grouped view
        shows the same figures per key or user."""
        spend: dict[str, Any] = {}
        try:
            for field in ("api_key", "model", "end_user"):
                spend[field] = await self.client.costs(
                    self.cost_window, group_by=field, scope=self.cost_scope
                )
        except APIError as exc:
            self.notify(f"cost report: {exc.message}", severity="warning", timeout=5)
        except ClientError:
            pass
        if spend:
            self.spend = spend
        table = self.w(RequestsTable)
        table.spend = {
            "api_key_name": spend_by(self.spend.get("api_key"), "api_key"),
            "end_user": spend_by(self.spend.get("end_user"), "end_user"),
        }
        table.spend_window = self.cost_window
        table.show()
        self.w(CostPanel).show(self.costs, self.util, self.spend, self.cost_window, self.cost_scope)

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
        self.push_screen(HelpScreen(KEYS, HELP_MORE))

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

    def action_jump(self, index: int) -> None:
        try:
            main = self.screen_stack[0].query_one("#main")
            widget = main.query_one(self.PANELS[index])
        except (NoMatches, IndexError):
            return
        main.scroll_to_widget(widget, animate=False, top=True)
        if widget.can_focus:
            widget.focus()

    # -- the prompt: `/` filter, `:` commands ------------------------------------------------
    def open_prompt(self, mode: str, value: str = "") -> None:
        prompt = self.query_one("#prompt", PromptInput)
        self.prompt_mode = mode
        prompt.placeholder = (
            "filter: key:NAME user:NAME state:waiting or any word (enter keeps, esc undoes)"
            if mode == "filter"
            else "drain, resume, tune, abort-key KEY, suspend KEY, cost 10m, save, help (enter)"
        )
        prompt.value = value
        self.query_one("#prompt-mode", Static).update("/" if mode == "filter" else ":")
        self.query_one("#prompt-bar").remove_class("-hidden")
        prompt.focus()

    def close_prompt(self, cancel: bool = False) -> None:
        if cancel and self.prompt_mode == "filter":
            self.w(RequestsTable).set_filter(self._filter_before)
        self.prompt_mode = ""
        self.query_one("#prompt-bar").add_class("-hidden")
        self.w(RequestsTable).focus()

    def action_filter(self) -> None:
        self._filter_before = self.w(RequestsTable).query_text
        self.open_prompt("filter", self._filter_before)

    def action_command(self) -> None:
        self.open_prompt("command")

    @on(Input.Changed, "#prompt")
    def _prompt_changed(self, event: Input.Changed) -> None:
        if self.prompt_mode == "filter":  # the table follows every keystroke
            self.w(RequestsTable).set_filter(event.value)

    @on(Input.Submitted, "#prompt")
    def _prompt_submitted(self, event: Input.Submitted) -> None:
        mode = self.prompt_mode
        self.close_prompt()
        if mode == "command" and event.value.strip():
            self.run_command(event.value)

    def run_command(self, text: str) -> None:
        try:
            cmd = parse_command(text)
        except CommandError as exc:
            self.notify(str(exc), severity="error", timeout=6)
            return
        table = self.w(RequestsTable)
        simple = {
            "drain": self.action_drain,
            "resume": self.action_resume,
            "tune": self.action_tune,
            "save": self.action_save_config,
            "autopilot": self.action_autopilot_view,
            "fleet": self.action_fleet,
            "help": self.action_help,
            "quit": self.exit,
        }
        if cmd.name in simple:
            simple[cmd.name]()
        elif cmd.name == "abort-key":
            self.action_abort_key(cmd.arg)
        elif cmd.name == "suspend":
            self.action_suspend_key(cmd.arg)
        elif cmd.name == "unsuspend":
            self.action_unsuspend_key(cmd.arg)
        elif cmd.name == "filter":
            table.set_filter(cmd.arg)
        elif cmd.name == "group":
            table.group_by = {"key": "api_key_name", "user": "end_user"}.get(cmd.arg)
            table.sort_key = "requests" if table.group_by else "age_s"
            table.show()
            self.refresh_costs()
        elif cmd.name == "cost":
            self.set_cost_window(cmd.arg.lower())
        elif cmd.name == "scope":
            self.cost_scope = cmd.arg
            self.refresh_costs()

    # -- acting on a tenant ------------------------------------------------------------------
    def action_group(self) -> None:
        by = self.w(RequestsTable).cycle_group()
        if by is not None:
            self.refresh_costs()

    def _key_of_selection(self, name: str | None) -> str | None:
        key = name or self.w(RequestsTable).selected_group("api_key_name")
        if not key or key == "–":
            self.notify("no API key on the selected row (or name one: :abort-key KEY)",
                        severity="warning")  # fmt: skip
            return None
        return key

    def action_abort_key(self, name: str | None = None) -> None:
        key = self._key_of_selection(name)
        if key is None:
            return
        count = sum(1 for r in self.w(RequestsTable).rows_data if r.get("api_key_name") == key)
        question = (
            f"Abort [b]all {count}[/] live request{'s' if count != 1 else ''} of API key "
            f"[b]{key}[/]? (other keys are not touched; the count may have moved by the time "
            "the daemon acts, and it answers with its own)"
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_call(self.client.abort_key, key, done=f"aborted key {key}'s requests")

        self.push_screen(ConfirmScreen(question), answered)

    def action_suspend_key(self, name: str | None = None) -> None:
        key = self._key_of_selection(name)
        if key is None:
            return
        question = (
            f"Suspend API key [b]{key}[/]? Its new requests get 403 until unsuspended; running "
            "ones continue (A aborts them). Audited."
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_call(self.client.suspend_key, key, done=f"suspended key {key}")

        self.push_screen(ConfirmScreen(question), answered)

    def action_unsuspend_key(self, name: str | None = None) -> None:
        key = self._key_of_selection(name)
        if key is None:
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_call(self.client.unsuspend_key, key, done=f"serving key {key} again")

        self.push_screen(ConfirmScreen(f"Serve API key [b]{key}[/] again?"), answered)

    def action_save_config(self) -> None:
        question = (
            "Write the live values to the daemon's config file, so that they survive a "
            "restart? (comments in the file are kept)"
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_call(self.client.save_config, done="live values saved to the file")

        self.push_screen(ConfirmScreen(question), answered)

    def action_autopilot_view(self) -> None:
        from controlplane.tui.autopilot import AutopilotScreen

        self.push_screen(AutopilotScreen(self.client))

    # -- cost --------------------------------------------------------------------------------
    def action_cost_window(self) -> None:
        i = COST_WINDOWS.index(self.cost_window) if self.cost_window in COST_WINDOWS else -1
        self.set_cost_window(COST_WINDOWS[(i + 1) % len(COST_WINDOWS)])

    def set_cost_window(self, window: str) -> None:
        self.cost_window = window
        self.w(CostPanel).border_title = f"Cost, last {window} ({self.cost_scope})"
        self.refresh_costs()

    @work(exclusive=True, group="costs")
    async def refresh_costs(self) -> None:
        await self.fetch_costs()
