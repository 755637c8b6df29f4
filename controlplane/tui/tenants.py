"""The tenants screen (`K`, `:keys`): every API key with its live usage (GET /admin/keys,
refreshed every few seconds), worst first, and the keys' management: create and rotate (the
secret shown once, in a dialog the operator must dismiss), revoke (asks first), change limits,
budget and priority class (PATCH). Every change is audited with source `tui`.

The order is the admin API's own (controlplane.tenants.usage.sort_key, imported: one
definition): "worst" puts first the keys refused most in the last minute, then the largest
share of the engine's tokens, then the most of their budget used.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

from rich.markup import escape
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, DataTable, Footer, Input, Label, Static

from controlplane.client.admin import APIError, ClientError
from controlplane.tenants.usage import SORTS, sort_key
from controlplane.tui.closing import StopsWorkersOnClose
from controlplane.tui.confirm import ask_first, call_daemon
from controlplane.tui.help import HelpScreen, help_rows
from controlplane.tui.history import fmt_usd
from controlplane.tui.tables import MeasuredTable

# (column key, header); a column's key is the sort it takes when its header is clicked (None:
# not sortable).
KEY_COLUMNS: tuple[tuple[str, str, str | None], ...] = (
    ("name", "key", "name"),
    ("owner", "owner", None),
    ("state", "state", None),
    ("rpm", "req/min", "requests_per_minute"),
    ("tpm", "tok/min", "tokens_per_minute"),
    ("share", "share", "share"),
    ("spend", "spend / budget", "use"),
    ("throttled", "throttled", "throttled"),
    ("in_flight", "in flight", "in_flight"),
    ("class", "class", None),
)
STATE_STYLE = {"revoked": "dim", "expired": "dim", "suspended": "bold yellow"}
BUDGET_STYLE = {"soft_threshold": "bold yellow", "exhausted": "bold reverse red"}
# The fields the form edits, in its order: (field, label, kind). kind: int, float, or a tuple
# of the allowed words. Empty: null (the [limits] default, no budget, the default period).
FORM_FIELDS: tuple[tuple[str, str, Any], ...] = (
    ("owner", "owner", "text"),
    ("requests_per_minute", "requests / minute", "int"),
    ("tokens_per_minute", "tokens / minute", "int"),
    ("max_concurrent", "concurrent requests", "int"),
    ("max_tokens_per_request", "tokens / request", "int"),
    ("budget_usd", "budget (USD)", "float"),
    ("budget_period", "budget period", ("day", "month")),
    ("budget_action", "at the budget", ("reject", "deprioritize")),
    ("priority_class", "priority class (0-9)", "int"),
)
WORST = (
    "worst first: most refused (429, 403) in the last minute, then the largest share of the "
    "engine's tokens, then the most of its budget used"
)
TENANTS_NOTES = f"""[b]Columns[/] (this daemon's figures, over a sliding minute)
  req/min, tok/min  requests admitted and tokens (prompt at admission + completion at the
                    end) in the last 60 s
  share             the key's tokens / every key's tokens in that minute
  spend / budget    this period's spend at list price against the key's budget
  throttled         refused since the daemon started (rate limits, budget, queue, suspended);
                    in red, how many in the last minute
  class             the priority class its requests are scheduled in (0 first)

[b]Order[/]
  {WORST}.
  Click a header or press o for another; name sorts A to Z, every figure highest first.

"""


def _usage(k: dict[str, Any]) -> dict[str, Any]:
    return k.get("usage") or {}


def _budget_cell(k: dict[str, Any]) -> Text:
    b = k.get("budget") or {}
    if b.get("budget_usd") is None:
        return Text("–", style="dim")
    period = b.get("budget_period") or "month"
    text = f"{fmt_usd(b.get('spend_usd') or 0)} / {fmt_usd(b['budget_usd'])} {period}"
    return Text(text, style=BUDGET_STYLE.get(str(b.get("state")), ""))


def _throttled_cell(k: dict[str, Any]) -> Text:
    u = _usage(k)
    total, now = u.get("throttled_total") or 0, u.get("throttled_last_minute") or 0
    out = Text(str(total), style="" if total else "dim")
    if now:
        out.append(f" ({now}/min)", style="bold red")
    return out


def cells(k: dict[str, Any]) -> list[Text]:
    """One key's row, in KEY_COLUMNS' order."""
    u = _usage(k)
    state = "suspended" if k.get("suspended") else str(k.get("state") or k.get("source"))
    share = u.get("share")
    return [
        Text(str(k.get("name")), style="bold"),
        Text(str(k.get("owner") or "–")),
        Text(state, style=STATE_STYLE.get(state, "")),
        Text(str(u.get("requests_per_minute", 0))),
        Text(str(u.get("tokens_per_minute", 0))),
        Text("–" if share is None else f"{share:.0%}"),
        _budget_cell(k),
        _throttled_cell(k),
        Text(str(u.get("in_flight", 0))),
        Text(str(k.get("priority_class", 0))),
    ]


class KeysTable(MeasuredTable):
    """The keys, sorted by `sort` (a name of controlplane.tenants.usage.SORTS)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.sort = "worst"
        self.rows_data: list[dict[str, Any]] = []

    def on_mount(self) -> None:
        for key, label, _ in KEY_COLUMNS:
            self.add_column(label, key=key)

    def show(self, keys: list[dict[str, Any]] | None = None) -> None:
        """Redraw (with `keys` when given); the cursor stays on the key it was on."""
        selected = self.selected()
        if keys is not None:
            self.rows_data = list(keys)
        self.clear()
        rows = self.sorted_rows()
        for k in rows:
            self.add_row(*cells(k), key=str(k.get("name")))
        names = [str(k.get("name")) for k in rows]
        if selected is not None and selected.get("name") in names:
            self.move_cursor(row=names.index(str(selected["name"])), animate=False)
        self.border_title = f"API keys ({len(rows)})  sort: {self.sort}"

    def sorted_rows(self) -> list[dict[str, Any]]:
        return sorted(self.rows_data, key=sort_key(self.sort))

    def selected(self) -> dict[str, Any] | None:
        rows = self.sorted_rows()
        if not rows or not 0 <= self.cursor_row < len(rows):
            return None
        return rows[self.cursor_row]

    def sort_by(self, sort: str) -> None:
        self.sort = "worst" if sort == self.sort else sort  # a second click: worst again
        self.show()

    def cycle_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        self.show()


class SecretScreen(ModalScreen[None]):
    """A new secret, shown this once: it stays until the operator dismisses it (the button,
    or enter on it); escape does not close it, so a stray key cannot lose the secret. `c`
    copies it to the clipboard (where the terminal allows it)."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("c", "copy", "Copy")]

    def __init__(self, name: str, secret: str, what: str) -> None:
        super().__init__()
        self.key_name, self.secret, self.what = name, secret, what

    def compose(self) -> ComposeResult:
        with Vertical(id="secret-box", classes="modal-box"):
            yield Static(
                f"[b]{escape(self.what)}: {escape(self.key_name)}[/]\n"
                "Copy the secret now: it is shown this once, the daemon keeps only its hash.",
                id="secret-about",
            )
            yield Static(Text(self.secret, style="bold"), id="secret-value")
            with Horizontal(classes="buttons"):
                yield Button("I have copied it (enter)", variant="primary", id="secret-done")
            yield Static("[dim]c copies it to the clipboard[/]", id="secret-help")

    def on_mount(self) -> None:
        self.query_one("#secret-done", Button).focus()

    @on(Button.Pressed, "#secret-done")
    def _done(self) -> None:
        self.dismiss(None)

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.secret)
        self.notify("secret copied to the clipboard", timeout=3)


def form_body(
    values: dict[str, str], current: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The PATCH / POST body from the form's texts (field -> text): (body, errors by field).
    `current`: the key's values (an edit sends only what changed); None: a new key (sends what
    is filled in). An empty text is null: the [limits] default, no budget, the default."""
    body: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for field, _, kind in FORM_FIELDS:
        text = values.get(field, "").strip()
        value: Any = None
        if text and kind == "int":
            try:
                value = int(text)
            except ValueError:
                errors[field] = f"{field}: a whole number, or empty for the default"
                continue
        elif text and kind == "float":
            try:
                value = float(text)
            except ValueError:
                errors[field] = f"{field}: a number, or empty for none"
                continue
        elif text and isinstance(kind, tuple):
            if text not in kind:
                errors[field] = f"{field}: one of {', '.join(kind)}, or empty"
                continue
            value = text
        elif text:
            value = text
        if current is None:
            if value is not None:
                body[field] = value
        elif value != current.get(field):
            body[field] = value
    return body, errors


def key_fields(k: dict[str, Any]) -> dict[str, Any]:
    """A table key's editable values, flat (GET /admin/keys nests limits and budget)."""
    b = k.get("budget") or {}
    return {
        "owner": k.get("owner"),
        **(k.get("limits") or {}),
        "budget_usd": b.get("budget_usd"),
        "budget_period": b.get("budget_period"),
        "budget_action": b.get("budget_action"),
        "priority_class": k.get("priority_class"),
    }


def _text(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:g}" if isinstance(value, float) else str(value)


class KeyFormScreen(StopsWorkersOnClose, ModalScreen[dict[str, Any] | None]):
    """Create a key (`key` None: a name and its fields) or change one (its fields, filled in):
    ctrl+s or enter sends it (only the fields changed, for an edit); the admin API's error shows
    under the form and the form stays open; success dismisses with the API's answer (a new
    key's includes its secret). Escape cancels."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("ctrl+s", "submit", "Save"),
        Binding("escape", "cancel", "Cancel"),
    ]

    def __init__(self, client: Any, key: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.client = client
        self.key = key
        self.current = key_fields(key) if key is not None else None

    def compose(self) -> ComposeResult:
        title = "New API key" if self.key is None else f"Change API key {self.key['name']}"
        with VerticalScroll(id="key-form-box", classes="modal-box"):
            yield Static(f"[b]{escape(title)}[/]  [dim]empty: the default[/]", id="key-form-title")
            if self.key is None:
                with Horizontal(classes="key-form-row"):
                    yield Label("name", classes="key-form-label")
                    yield Input(id="kf-name", placeholder="letters, digits, . _ : @ -")
            for field, label, kind in FORM_FIELDS:
                with Horizontal(classes="key-form-row"):
                    yield Label(label, classes="key-form-label")
                    hint = " | ".join(kind) if isinstance(kind, tuple) else ""
                    value = _text((self.current or {}).get(field))
                    yield Input(value, id=f"kf-{field}", placeholder=hint)
            yield Static("", id="key-form-error")
            yield Static("[dim]ctrl+s or enter saves · escape cancels[/]", id="key-form-help")

    def on_mount(self) -> None:
        self.query(Input).first().focus()

    def values(self) -> dict[str, str]:
        return {f: self.query_one(f"#kf-{f}", Input).value for f, _, _ in FORM_FIELDS}

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self.action_submit()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_submit(self) -> None:
        body, errors = form_body(self.values(), self.current)
        error = self.query_one("#key-form-error", Static)
        if errors:
            error.update("[b red]" + escape("; ".join(errors.values())) + "[/] (nothing sent)")
            return
        if self.key is None:
            body["name"] = self.query_one("#kf-name", Input).value.strip()
        elif not body:
            error.update("[b yellow]nothing changed[/]")
            return
        self.send(body)

    @work(exclusive=True, group="key-form")
    async def send(self, body: dict[str, Any]) -> None:
        error = self.query_one("#key-form-error", Static)
        try:
            if self.key is None:
                answer = await self.client.create_key(body)
            else:
                answer = await self.client.update_key(self.key["name"], body)
        except APIError as exc:
            error.update(f"[b red]{exc.status}: {escape(exc.message)}[/]")
            return
        except ClientError as exc:
            error.update(f"[b red]daemon unreachable: {escape(str(exc))}[/]")
            return
        self.dismiss(answer)


class TenantsScreen(StopsWorkersOnClose, Screen[None]):
    """`TenantsScreen(client)`: GET /admin/keys every `interval` seconds, and the keys'
    management through the same client."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape", "back", "Dashboard", tooltip="back to the dashboard"),
        Binding("n", "create", "New key",
                tooltip="create an API key (its secret is shown once)"),
        Binding("e", "edit", "Change",
                tooltip="change the selected key's limits, budget, priority class, owner"),
        Binding("R", "rotate", "Rotate",
                tooltip="a new secret for the selected key, shown once; the old one stops "
                "(asks first)"),
        Binding("x", "revoke", "Revoke",
                tooltip="revoke the selected key on every daemon sharing the database (asks "
                "first)"),
        Binding("o", "sort", "Sort", tooltip="cycle the order (or click a column header); "
                "worst first by default"),
        Binding("g", "refresh", "Refresh", show=False, tooltip="refresh now"),
        Binding("question_mark", "help", "Help", tooltip="this help"),
        Binding("q", "app.quit", "Quit", show=False, tooltip="quit"),
    ]  # fmt: skip

    def __init__(self, client: Any, interval: float = 2.0) -> None:
        super().__init__()
        self.client = client
        self.interval = interval
        self.fetches = 0

    def compose(self) -> ComposeResult:
        yield Static(Text(" Tenants  loading…", style="bold"), id="keys-summary")
        yield Static("", id="keys-error")
        yield KeysTable(id="keys-table")
        yield Footer()

    @property
    def table(self) -> KeysTable:
        return self.query_one(KeysTable)

    def on_mount(self) -> None:
        self.query_one("#keys-error", Static).display = False
        self.table.focus()
        self.poll()

    @work(exclusive=True, group="tenants")
    async def poll(self) -> None:
        while True:
            await self.fetch()
            await asyncio.sleep(self.interval)

    async def fetch(self) -> None:
        try:
            body = await self.client.keys()
        except (APIError, ClientError) as exc:
            self._error(exc)
            return
        self.fetches += 1
        # An answer can arrive while the app shuts down, its widgets removed before its workers
        # stop (closing the screen alone cancels them first: tui/closing.py).
        with contextlib.suppress(NoMatches):
            self.query_one("#keys-error", Static).display = False
            self.table.show(body.get("keys") or [])
            self.query_one("#keys-summary", Static).update(self._summary(body))

    def _error(self, exc: Exception) -> None:
        what = f"{exc.status}: {exc.message}" if isinstance(exc, APIError) else f"{exc}"
        with contextlib.suppress(NoMatches):
            error = self.query_one("#keys-error", Static)
            error.update(f"[b red]{escape(what)}[/] (showing the last answer)")
            error.display = True

    def _summary(self, body: dict[str, Any]) -> Text:
        keys = body.get("keys") or []
        line = Text(" Tenants ", style="bold reverse")
        refused = sum(_usage(k).get("throttled_last_minute") or 0 for k in keys)
        flight = sum(_usage(k).get("in_flight") or 0 for k in keys)
        line.append(f"  {len(keys)} keys   in flight {flight}   ")
        line.append(f"refused in the last minute {refused}", style="bold red" if refused else "")
        line.append(f"   refreshed every {self.interval:g} s", style="dim")
        return line

    @on(DataTable.HeaderSelected, "#keys-table")
    def _header(self, event: DataTable.HeaderSelected) -> None:
        sort = {k: s for k, _, s in KEY_COLUMNS}.get(str(event.column_key.value))
        if sort is not None:
            self.table.sort_by(sort)

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_sort(self) -> None:
        self.table.cycle_sort()

    def action_refresh(self) -> None:
        self.run_worker(self.fetch(), group="tenants-once")

    def action_help(self) -> None:
        rows = help_rows(self.BINDINGS, self.app.get_key_display)
        self.app.push_screen(HelpScreen(rows, TENANTS_NOTES))

    # -- managing keys ----------------------------------------------------------------------
    def _table_key(self) -> dict[str, Any] | None:
        """The selected key, when it is one of the table's (the others are read-only here)."""
        k = self.table.selected()
        if k is None:
            self.notify("no key selected", severity="warning")
            return None
        if k.get("source") != "table":
            where = "the config file's" if k.get("source") == "config" else "not a key"
            self.notify(f"{k['name']} is {where}: not managed here", severity="warning")
            return None
        return k

    def action_create(self) -> None:
        def made(answer: dict[str, Any] | None) -> None:
            if answer is not None:
                self._after_change()
                self.app.push_screen(SecretScreen(answer["name"], answer["secret"], "New key"))

        self.app.push_screen(KeyFormScreen(self.client), made)

    def action_edit(self) -> None:
        k = self._table_key()
        if k is None:
            return

        def changed(answer: dict[str, Any] | None) -> None:
            if answer is not None:
                self.notify(f"changed key {answer['name']}", timeout=3)
                self._after_change()

        self.app.push_screen(KeyFormScreen(self.client, k), changed)

    def action_rotate(self) -> None:
        k = self._table_key()
        if k is None:
            return
        name = str(k["name"])
        ask_first(
            self,
            f"Rotate API key [b]{escape(name)}[/]? Its current secret stops working at once "
            "(on the other daemons within server.key_refresh_s); the new one is shown once.",
            lambda: self.call(self.client.rotate_key, name, then=self._show_rotated),
        )

    def _show_rotated(self, answer: dict[str, Any]) -> None:
        self.app.push_screen(SecretScreen(answer["name"], answer["secret"], "Rotated key"))

    def action_revoke(self) -> None:
        k = self._table_key()
        if k is None:
            return
        name = str(k["name"])
        if k.get("state") == "revoked":
            self.notify(f"{name} is revoked already", severity="warning")
            return
        ask_first(
            self,
            f"Revoke API key [b]{escape(name)}[/]? It stops on every daemon sharing the "
            "database (here at once, elsewhere within server.key_refresh_s); cannot be undone. "
            "Audited.",
            lambda: self.call(
                self.client.revoke_key,
                name,
                then=lambda _: self.notify(f"revoked key {name}", timeout=3),
            ),
        )

    @work(group="tenants-calls")
    async def call(
        self, fn: Callable[..., Any], *args: Any, then: Callable[[dict[str, Any]], None]
    ) -> None:
        ok, answer = await call_daemon(self, fn, *args)
        if not ok:
            return
        then(answer)
        await self.fetch()

    def _after_change(self) -> None:
        self.action_refresh()
