"""The on-call dashboard screen: one daemon's numbers (daemon_feed.py holds them in reactives
and fills them), laid out with every widget bound to them, and what the operator's keys and
`:` commands do. `?` lists the keys from the bindings' own tooltips."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.widgets import DataTable, Footer, Input

from controlplane.tui.commands import COMMANDS, CommandError
from controlplane.tui.commands import parse as parse_command
from controlplane.tui.confirm import ask_first, call_daemon
from controlplane.tui.cost_panel import CostPanel
from controlplane.tui.daemon_feed import DaemonFeedScreen as Feed
from controlplane.tui.header import HeaderBar
from controlplane.tui.help import DASHBOARD_NOTES, HelpScreen, help_rows
from controlplane.tui.palette import DashboardCommands
from controlplane.tui.panels import BatchPanel, KVPanel, LatencyPanel, ThroughputPanel
from controlplane.tui.prompt import PromptBar, PromptInput
from controlplane.tui.signals import DiagnosisBar, SignalsPanel
from controlplane.tui.tables import REQUEST_COLUMNS, ChangesTable, RequestsTable
from controlplane.tui.tune import TuneScreen

COST_WINDOWS = ("5m", "15m", "1h", "6h", "24h")
KEY_OWNERS = "suspend / unsuspend the selected row's API key (asks first; audited)"
LOAD = "drain / resume admitting requests (ask first)"
PANEL_KEYS = "jump to a panel: signals, requests, changes, throughput, batch, KV, latency, cost"
WIDE = 140  # columns from which the detail panels go above the tables


class DashboardScreen(Feed):
    """The dashboard of the daemon at `url` (see DaemonFeedScreen for the arguments)."""

    # The footer shows the keys that lead somewhere; `?` lists every key with a tooltip.
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("f", "app.fleet", "Fleet",
                tooltip="the fleet: every instance on this database, worst first (enter opens one)"),
        Binding("escape", "app.back_to_fleet", "Fleet", show=False,
                tooltip="back to the fleet screen (once it has been opened); closes a prompt"),
        Binding("t", "tune", "Tune",
                tooltip="tune the engine and the server's queue cap (preview before applying)"),
        Binding("slash", "filter", "Filter",
                tooltip="filter the live requests: key:NAME user:NAME state:waiting, or any word"),
        Binding("colon", "command", "Cmd",
                tooltip="command mode: drain, resume, tune, abort-key KEY, suspend KEY, cost 10m, "
                "save... (also in the ctrl+p palette)"),
        Binding("v", "group", "Group", show=False,
                tooltip="group the live requests by API key, then by end user, then not"),
        Binding("a", "abort", "Abort", show=False,
                tooltip="abort the selected live request (asks first)"),
        Binding("A", "abort_key", "Abort key", show=False,
                tooltip="abort every live request of the selected row's API key (asks first, "
                "with a count)"),
        Binding("s", "suspend_key", "Suspend key", show=False, tooltip=KEY_OWNERS),
        Binding("u", "unsuspend_key", "Unsuspend key", show=False, tooltip=KEY_OWNERS),
        Binding("d", "drain", "Drain", show=False, tooltip=LOAD),
        Binding("r", "resume", "Resume", show=False, tooltip=LOAD),
        Binding("dollar_sign", "cost_window", "Cost window", show=False,
                tooltip="the cost panel's window: " + ", ".join(COST_WINDOWS)),
        Binding("K", "keys", "Keys", show=False,
                tooltip="the tenants: every API key's live usage, worst first; create, rotate, "
                "revoke, change limits and budgets"),
        Binding("P", "autopilot_view", "Autopilot view", show=False,
                tooltip="the autopilot's decisions (acted and held) and the pins in force"),
        Binding("p", "autopilot", "Autopilot", show=False,
                tooltip="switch the SLO autopilot on or off (asks first; targets in the tuning "
                "form)"),
        Binding("W", "save_config", "Save config", show=False,
                tooltip="write the live values to the config file, so they survive a restart "
                "(asks first)"),
        Binding("c", "cache_reset", "Reset cache", show=False,
                tooltip="reset the prefix cache: drop every unused cached block (asks first)"),
        Binding("o", "sort", "Sort", show=False,
                tooltip="cycle the sort column (or click a column header)"),
        Binding("ctrl+r", "refresh", "Refresh", show=False, tooltip="refresh everything now"),
        Binding("question_mark", "help", "Help", tooltip="this help"),
        *(Binding(str(i + 1), f"jump({i})", f"Panel {i + 1}", show=False, tooltip=PANEL_KEYS)
          for i in range(8)),
        Binding("tab", "app.focus_next", "Next", show=False,
                tooltip="move focus between the tables"),
        Binding("q", "app.quit", "Quit", tooltip="quit"),
    ]  # fmt: skip
    COMMANDS: ClassVar[set[Any]] = {DashboardCommands}
    # `1`..`8`: the panels in reading order, brought into view (and focused if they take it).
    PANELS = ("#signals", "#requests", "#changes", "#throughput", "#batch", "#kv", "#latency",
              "#cost")  # fmt: skip

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._filter_before = ""  # the filter when `/` opened the prompt (escape restores it)

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        # Above the fold at 80x24: the diagnosis, the signals and the live requests (what an
        # incident is read and acted on from); the detail panels scroll below. Every widget
        # is bound to the reactives it shows and redraws itself when they change.
        yield HeaderBar(id="header").data_bind(
            Feed.url, Feed.stats, Feed.connected, Feed.note, Feed.down_state, Feed.stale_s
        )
        yield DiagnosisBar(id="diagnosis").data_bind(Feed.stats)
        with VerticalScroll(id="main"):
            signals = SignalsPanel(
                "Signals (rates over 10 s, latency over 60 s)", self.history, id="signals"
            )
            yield signals.data_bind(Feed.stats)
            with Horizontal(id="tables"):
                yield RequestsTable(id="requests").data_bind(
                    Feed.live, Feed.model, spend_reports=Feed.spend, spend_window=Feed.spend_window
                )
                yield ChangesTable(id="changes").data_bind(entries=Feed.changes)
            with Grid(id="panels"):
                yield ThroughputPanel("Throughput", self.history, id="throughput").data_bind(
                    Feed.stats
                )
                yield BatchPanel("Batch", id="batch").data_bind(Feed.stats)
                yield KVPanel("KV cache", self.history, id="kv").data_bind(
                    Feed.stats, Feed.block_map
                )
                yield LatencyPanel("Latency", id="latency").data_bind(Feed.stats)
                yield CostPanel("Cost", id="cost").data_bind(
                    Feed.costs, Feed.util, Feed.spend, Feed.spend_window,
                    window=Feed.cost_window, scope=Feed.spend_scope,
                )  # fmt: skip
        # The prompt's row, between the panels and the footer while open.
        yield PromptBar(COMMANDS, id="prompt-bar", classes="-hidden")
        yield Footer()

    @property
    def requests_table(self) -> RequestsTable:
        return self.query_one(RequestsTable)

    def watch_stale_s(self, stale_s: float | None) -> None:
        # Disconnected, the last numbers stay on screen, dimmed, until fresh ones arrive.
        for main in self.query("#main"):
            main.set_class(stale_s is not None, "-stale")

    def fit_width(self, width: int) -> None:
        """Wide, the detail panels go above the tables (everything fits on one screen);
        narrow, the tables come first, right under the signals (above the fold at 80x24)."""
        try:
            main = self.query_one("#main")
            panels, tables = main.query_one("#panels"), main.query_one("#tables")
        except NoMatches:
            return
        wide = width >= WIDE
        first = main.children.index(panels) < main.children.index(tables)
        if wide and not first:
            main.move_child(panels, before=tables)
        elif not wide and first:
            main.move_child(tables, before=panels)

    def action_jump(self, index: int) -> None:
        try:
            main = self.query_one("#main")
            widget = main.query_one(self.PANELS[index])
        except (NoMatches, IndexError):
            return
        main.scroll_to_widget(widget, animate=False, top=True)
        if widget.can_focus:
            widget.focus()

    # -- the prompt: `/` filter, `:` commands ------------------------------------------------
    def open_prompt(self, mode: str, value: str = "") -> None:
        self.query_one(PromptBar).open(mode, value)

    def close_prompt(self, cancel: bool = False) -> None:
        bar = self.query_one(PromptBar)
        if cancel and bar.mode == "filter":
            self.requests_table.set_filter(self._filter_before)
        bar.close()
        self.requests_table.focus()

    def action_filter(self) -> None:
        self._filter_before = self.requests_table.query_text
        self.open_prompt("filter", self._filter_before)

    def action_command(self) -> None:
        self.open_prompt("command")

    @on(PromptInput.Cancelled)
    def _prompt_cancelled(self) -> None:
        self.close_prompt(cancel=True)

    @on(Input.Changed, "#prompt")
    def _prompt_changed(self, event: Input.Changed) -> None:
        if self.query_one(PromptBar).mode == "filter":  # the table follows every keystroke
            self.requests_table.set_filter(event.value)

    @on(Input.Submitted, "#prompt")
    def _prompt_submitted(self, event: Input.Submitted) -> None:
        mode = self.query_one(PromptBar).mode
        self.close_prompt()
        if mode == "command" and event.value.strip():
            self.run_command(event.value)

    def run_command(self, text: str) -> None:
        """A `:` command, from the prompt or the command palette."""
        try:
            cmd = parse_command(text)
        except CommandError as exc:
            self.notify(str(exc), severity="error", timeout=6)
            return
        table = self.requests_table
        simple: dict[str, Callable[[], Any]] = {
            "drain": self.action_drain,
            "resume": self.action_resume,
            "tune": self.action_tune,
            "save": self.action_save_config,
            "autopilot": self.action_autopilot_view,
            "keys": self.action_keys,
            "fleet": self.app.action_fleet,  # type: ignore[attr-defined]
            "help": self.action_help,
            "quit": self.app.exit,
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

    # -- reading -----------------------------------------------------------------------------
    def action_help(self) -> None:
        bindings = [*self.BINDINGS, *RequestsTable.BINDINGS, *self.app.BINDINGS]
        self.app.push_screen(HelpScreen(help_rows(bindings, self.app.get_key_display),
                                        DASHBOARD_NOTES))  # fmt: skip

    def action_sort(self) -> None:
        self.requests_table.cycle_sort()

    @on(DataTable.HeaderSelected, "#requests")
    def _header_selected(self, event: DataTable.HeaderSelected) -> None:
        key = event.column_key.value
        if key in dict(REQUEST_COLUMNS):
            self.requests_table.sort_by(key)

    def action_group(self) -> None:
        if self.requests_table.cycle_group() is not None:
            self.refresh_costs()

    def action_refresh(self) -> None:
        self.load_config()
        self.refresh_once()

    @work(group="refresh")
    async def refresh_once(self) -> None:
        await self.fetch_requests()
        await self.fetch_reports()

    def action_cost_window(self) -> None:
        i = COST_WINDOWS.index(self.cost_window) if self.cost_window in COST_WINDOWS else -1
        self.set_cost_window(COST_WINDOWS[(i + 1) % len(COST_WINDOWS)])

    def set_cost_window(self, window: str) -> None:
        self.cost_window = window
        self.refresh_costs()

    def action_autopilot_view(self) -> None:
        from controlplane.tui.autopilot import AutopilotScreen

        self.app.push_screen(AutopilotScreen(self.client))

    def action_keys(self) -> None:
        from controlplane.tui.tenants import TenantsScreen

        self.app.push_screen(TenantsScreen(self.client))

    # -- changing things ---------------------------------------------------------------------
    def action_tune(self) -> None:
        if not self.fields:
            self.notify("config not loaded yet (is the daemon reachable?)", severity="warning")
            self.load_config()
            return
        form = TuneScreen(
            self.client, self.fields, lambda: self.stats, on_applied=self.config_applied
        )
        self.app.push_screen(form)

    def config_applied(self, answer: dict[str, Any]) -> None:
        """The tuning form's PATCH succeeded: its effective values are the fields now."""
        self.fields = answer.get("fields") or self.fields
        changed = answer.get("changed") or []
        if changed:
            self.notify(
                "applied: " + ", ".join(f"{c['field']} = {c['new']}" for c in changed), timeout=4
            )

    def confirm(self, question: str, call: Callable[[], None]) -> None:
        """Ask first; `call` on yes."""
        ask_first(self, question, call)

    def _confirm_call(self, question: str, method: str, done: str) -> None:
        self.confirm(question, lambda: self.run_call(getattr(self.client, method), done=done))

    @work(group="calls")
    async def run_call(self, fn: Callable[..., Any], *args: Any, done: str) -> None:
        ok, answer = await call_daemon(self, fn, *args)
        if not ok:
            return
        if isinstance(answer, dict) and "state" in answer and self.stats is not None:
            self.stats = {**self.stats, "state": answer["state"]}
        self.notify(done, timeout=3)
        await self.fetch_requests()

    def action_abort(self) -> None:
        rid = self.requests_table.selected_id()
        if rid is None:
            self.notify("no live request selected", severity="warning")
            return
        self.confirm(
            f"Abort request [b]{rid}[/]?",
            lambda: self.run_call(self.client.abort, rid, done=f"aborted {rid}"),
        )

    def action_drain(self) -> None:
        self._confirm_call(
            "Drain: stop admitting new requests (running ones finish)?", "drain", "draining"
        )

    def action_resume(self) -> None:
        self._confirm_call("Resume admitting new requests?", "resume", "resumed")

    def action_cache_reset(self) -> None:
        self._confirm_call(
            "Reset the prefix cache: drop every cached block no request uses?",
            "cache_reset",
            "prefix cache reset",
        )

    def action_save_config(self) -> None:
        self._confirm_call(
            "Write the live values to the daemon's config file, so that they survive a "
            "restart? (comments in the file are kept)",
            "save_config",
            "live values saved to the file",
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
        self.confirm(
            question,
            lambda: self.run_call(
                self.client.patch_autopilot,
                {"enabled": not on},
                done=f"autopilot {'off' if on else 'on'}",
            ),
        )

    # -- acting on a tenant ------------------------------------------------------------------
    def _key_of_selection(self, name: str | None) -> str | None:
        key = name or self.requests_table.selected_group("api_key_name")
        if not key or key == "–":
            self.notify("no API key on the selected row (or name one: :abort-key KEY)",
                        severity="warning")  # fmt: skip
            return None
        return key

    def action_abort_key(self, name: str | None = None) -> None:
        key = self._key_of_selection(name)
        if key is None:
            return
        count = sum(1 for r in self.requests_table.rows_data if r.get("api_key_name") == key)
        question = (
            f"Abort [b]all {count}[/] live request{'s' if count != 1 else ''} of API key "
            f"[b]{key}[/]? (other keys are not touched; the count may have moved by the time "
            "the daemon acts, and it answers with its own)"
        )
        self.confirm(
            question,
            lambda: self.run_call(self.client.abort_key, key, done=f"aborted key {key}'s requests"),
        )

    def action_suspend_key(self, name: str | None = None) -> None:
        key = self._key_of_selection(name)
        if key is None:
            return
        question = (
            f"Suspend API key [b]{key}[/]? Its new requests get 403 until unsuspended; running "
            "ones continue (A aborts them). Audited."
        )
        self.confirm(
            question,
            lambda: self.run_call(self.client.suspend_key, key, done=f"suspended key {key}"),
        )

    def action_unsuspend_key(self, name: str | None = None) -> None:
        key = self._key_of_selection(name)
        if key is None:
            return
        self.confirm(
            f"Serve API key [b]{key}[/] again?",
            lambda: self.run_call(self.client.unsuspend_key, key, done=f"serving key {key} again"),
        )
