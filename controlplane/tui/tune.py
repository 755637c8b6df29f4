"""The tuning form: live settings changed through PATCH /admin/config, checked as typed, with a
preview of the effect, docked beside the dashboard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from rich.markup import escape
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import Button, Input, Label, Select, Static

from controlplane.client.admin import APIError, ClientError
from controlplane.tui.closing import StopsWorkersOnClose
from controlplane.tui.tune_fields import SECTION_NOTES, FormField, field_key, flag, fmt, form_fields
from controlplane.tui.tune_preview import preview, simulation_lines


class TuneScreen(StopsWorkersOnClose, ModalScreen[dict[str, Any] | None]):
    """Change live settings through PATCH /admin/config, docked to the right of the dashboard.

    `fields`: GET /admin/config's fields (the rows, their ranges and choices); `stats`: the
    latest /admin/stats (a dict, or a callable returning the latest) for the preview;
    `on_applied`: called with the answer after each successful PATCH (the form stays open). Each field is checked as it is typed (a number, within its range); a
    number changed more than 10x either way is flagged and needs a second ctrl+s. Only the
    fields the operator changed are sent; the API validates again (all or nothing) and its
    error appears next to the field it names. Success shows the new effective values and the
    form stays open (Escape closes it)."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape", "close", "Close"),
        Binding("ctrl+s", "apply", "Apply"),
    ]
    FULL_WIDTH_BELOW = 100  # columns: narrower terminals get the form across the whole width

    def __init__(
        self,
        client: Any,
        fields: dict[str, Any],
        stats: dict[str, Any] | Callable[[], dict[str, Any] | None] | None = None,
        *,
        on_applied: Callable[[dict[str, Any]], None] | None = None,
        preview_interval: float = 1.0,
        simulate_after: float = 0.6,
        simulate_window_s: float = 900.0,
    ) -> None:
        super().__init__()
        self.client = client
        self.on_applied = on_applied
        # A copy: the values the form opened with are what "changed" is measured against, so
        # a knob the autopilot moves meanwhile is not sent back unless the operator typed it.
        self.fields = {k: dict(v) for k, v in fields.items()}
        self._stats = stats
        self.preview_interval = preview_interval
        # The simulator runs once typing pauses this long (each run simulates the window twice
        # in the daemon: not at every keystroke), on the last `simulate_window_s` of traffic.
        self.simulate_after = simulate_after
        self.simulate_window_s = simulate_window_s
        self._sim_timer: Timer | None = None
        self.form = form_fields(self.fields)
        self.by_key = {f.key: f for f in self.form}
        self.by_dom = {f.dom: f for f in self.form}
        self.api_errors: dict[str, str] = {}
        self.confirmed: dict[str, Any] = {}  # flagged values a first ctrl+s acknowledged
        self.result: dict[str, Any] | None = None

    # -- data --------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any] | None:
        source = self._stats() if callable(self._stats) else self._stats
        return source if isinstance(source, dict) else None

    def current(self, name: str) -> Any:
        return (self.fields.get(field_key(name)) or {}).get("value")

    def typed(self, field: FormField) -> tuple[Any, str | None]:
        """(value, error) of what the row holds now."""
        widget = self.query_one(f"#in-{field.dom}")
        if isinstance(widget, Select):
            value = widget.value
            if not isinstance(value, str):  # nothing selected: unchanged
                return self.current(field.key), None
            return (value == "on" if field.kind == "bool" else value), None
        assert isinstance(widget, Input)
        if field.number and not widget.value.strip() and self.current(field.key) is None:
            return None, None  # unset and left empty
        return field.parse(widget.value)

    def changes(self) -> dict[str, Any]:
        """The valid values that differ from the ones the form opened with (dotted keys)."""
        body: dict[str, Any] = {}
        for field in self.form:
            value, error = self.typed(field)
            if error is None and value != self.current(field.key):
                body[field.key] = value
        return body

    def errors(self) -> dict[str, str]:
        return {f.key: e for f in self.form if (e := self.typed(f)[1]) is not None}

    def flags(self) -> dict[str, str]:
        """The changed numbers flagged as more than 10x away from the current value."""
        out = {}
        for key, value in self.changes().items():
            text = flag(self.by_key[key], self.current(key), value)
            if text is not None:
                out[key] = text
        return out

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Vertical(id="tune-box"):
            yield Static(
                "[b]Tune[/] the live settings · ctrl+s applies · esc closes", id="tune-title"
            )
            with VerticalScroll(id="tune-form"):
                section = None
                for field in self.form:
                    if field.section != section:
                        section = field.section
                        note = SECTION_NOTES.get(section, "")
                        yield Static(
                            f"[b]{section or 'other'}[/]" + (f" [dim]({note})[/]" if note else ""),
                            classes="tune-section",
                        )
                    with Horizontal(classes="tune-row"):
                        yield Label(field.label, classes="field-label")
                        yield self._editor(field)
                        yield Static(field.range_text(), classes="field-range")
                    yield Static("", id=f"err-{field.dom}", classes="field-error")
            yield Static("", id="tune-preview")
            yield Static("", id="tune-sim")  # shown once the simulator has something to say
            yield Static("", id="tune-status")
            with Horizontal(classes="buttons"):
                yield Button("Apply (ctrl+s)", variant="primary", id="apply", compact=True)
                yield Button("Close (esc)", id="close", compact=True)

    def _editor(self, field: FormField) -> Input | Select:
        value = self.current(field.key)
        if field.kind in ("bool", "choice"):
            shown = [fmt(c) for c in field.choices]
            options = [(c, c) for c in shown]
            if value is not None and fmt(value) in shown:
                return Select(
                    options, value=fmt(value), allow_blank=False, id=f"in-{field.dom}", compact=True
                )
            return Select(options, id=f"in-{field.dom}", compact=True)  # unknown: unchanged
        return Input(value=fmt(value), id=f"in-{field.dom}", compact=True)

    def on_mount(self) -> None:
        self._fit(self.app.size.width)
        for field in self.form:
            self._note(field)
        self.show_preview()
        self._show_simulation("")
        self.set_interval(self.preview_interval, self.show_preview)  # follows the stats
        first = next((f for f in self.form if f.number), None)
        if first is not None:
            widget = self.query_one(f"#in-{first.dom}", Input)
            widget.focus()
            widget.select_all()  # typing replaces the current value

    def on_resize(self, event: events.Resize) -> None:
        self._fit(event.size.width)

    def _fit(self, width: int) -> None:
        self.set_class(width < self.FULL_WIDTH_BELOW, "-full")

    # -- as typed ----------------------------------------------------------------------------
    def _note(self, field: FormField) -> None:
        """The row's note: its error, else the API's error, else its 10x flag, else nothing."""
        value, error = self.typed(field)
        api = self.api_errors.get(field.key)
        flagged = None if error else flag(field, self.current(field.key), value)
        note = self.query_one(f"#err-{field.dom}", Static)
        if error:
            note.update(f"[b red]{escape(error)}[/]")
        elif api:
            note.update(f"[b red]{escape(api)}[/]")
        elif flagged:
            again = " (ctrl+s again applies)" if self.confirmed.get(field.key) == value else ""
            note.update(f"[b yellow]{escape(flagged)}{again}[/]")
        else:
            note.update("")
        note.display = bool(error or api or flagged)
        widget = self.query_one(f"#in-{field.dom}")
        widget.set_class(bool(error or api), "-error")
        widget.set_class(bool(flagged) and not (error or api), "-flagged")

    def show_preview(self) -> None:
        stats = self.stats
        lines = [
            preview(key, self.current(key), value, stats, self.fields)
            for key, value in self.changes().items()
        ]
        text = "\n".join(f"• {escape(line)}" for line in lines)
        self.query_one("#tune-preview", Static).update(
            text or "[dim]preview: type a new value to see its effect here[/]"
        )

    def _edited(self, widget_id: str | None) -> None:
        field = self.by_dom.get((widget_id or "").removeprefix("in-"))
        if field is None:
            return
        self.api_errors.pop(field.key, None)
        self._note(field)
        self.show_preview()
        # The prediction on screen was for other values: gone at once, asked again once
        # typing pauses.
        self.workers.cancel_group(self, "simulate")
        self._show_simulation("")
        if self._sim_timer is not None:
            self._sim_timer.stop()
        self._sim_timer = self.set_timer(self.simulate_after, self._ask_simulator)

    def _show_simulation(self, text: str) -> None:
        sim = self.query_one("#tune-sim", Static)
        sim.update(text)
        sim.display = bool(text)  # no empty line between the preview and the status

    def _ask_simulator(self) -> None:
        body = self.changes()
        if not body or self.errors():
            return
        self._show_simulation("[dim]simulating the change on the last window of traffic…[/]")
        self.simulate(body)

    @work(exclusive=True, group="simulate")
    async def simulate(self, body: dict[str, Any]) -> None:
        """The simulator's prediction for `body` (a later edit cancels this one)."""
        try:
            answer = await self.client.simulate(body, self.simulate_window_s)
        except APIError as exc:
            # 409: nothing to simulate yet (no traffic, too few steps); 422: a refused value
            # (its row says so once applied); the form works without the simulator either way.
            self._show_simulation(f"[dim]simulator: {escape(exc.message)}[/]")
            return
        except ClientError as exc:
            self._show_simulation(f"[dim]simulator unreachable: {escape(str(exc))}[/]")
            return
        lines = simulation_lines(answer, self.simulate_window_s)
        self._show_simulation("\n".join([f"[b]{escape(lines[0])}[/]", *map(escape, lines[1:])]))

    @on(Input.Changed)
    def _input_changed(self, event: Input.Changed) -> None:
        self._edited(event.input.id)

    @on(Select.Changed)
    def _select_changed(self, event: Select.Changed) -> None:
        self._edited(event.select.id)

    # -- applying ----------------------------------------------------------------------------
    @on(Input.Submitted)
    @on(Button.Pressed, "#apply")
    def action_apply(self) -> None:
        status = self.query_one("#tune-status", Static)
        errors = self.errors()
        if errors:
            for key in errors:
                self._note(self.by_key[key])
            names = ", ".join(self.by_key[k].name for k in errors)
            status.update(f"[b red]not applied: fix {names} first[/]")
            return
        body = self.changes()
        if not body:
            status.update("[dim]nothing changed[/]")
            return
        flagged = self.flags()
        pending = {k: v for k, v in body.items() if k in flagged and self.confirmed.get(k) != v}
        if pending:
            self.confirmed.update(pending)
            for key in pending:
                self._note(self.by_key[key])
            names = ", ".join(self.by_key[k].name for k in pending)
            status.update(
                f"[b yellow]not applied: {names} changed more than 10x; check it, then ctrl+s "
                "again to apply[/]"
            )
            return
        status.update("applying…")
        self.apply(body)

    @work(exclusive=True, group="tune")
    async def apply(self, body: dict[str, Any]) -> None:
        status = self.query_one("#tune-status", Static)
        try:
            answer = await self.client.patch_config(body)
        except APIError as exc:
            param = exc.param or ""
            field = self.by_key.get(param) or self.by_key.get(field_key(param)) if param else None
            if field is not None:
                self.api_errors[field.key] = exc.message
                self._note(field)
                status.update(f"[red]rejected ({exc.status}): see {field.name}; nothing changed[/]")
            else:
                status.update(f"[b red]rejected ({exc.status}): {escape(exc.message)}[/]")
            return
        except ClientError as exc:
            status.update(f"[b red]daemon unreachable: {escape(str(exc))}[/]")
            return
        for key, entry in (answer.get("fields") or {}).items():  # ranges kept: GET sends them
            self.fields[key] = {**self.fields.get(key, {}), **entry}
        self.confirmed.clear()
        self.api_errors.clear()
        self.result = {**answer, "fields": {k: dict(v) for k, v in self.fields.items()}}
        effective = ", ".join(f"{self.by_key[k].name} = {fmt(self.current(k))}" for k in body)
        status.update(f"[b green]applied[/]: now {escape(effective)}")
        for field in self.form:
            self._note(field)
        self.show_preview()
        if self.on_applied is not None:
            self.on_applied(self.result)

    @on(Button.Pressed, "#close")
    def action_close(self) -> None:
        self.dismiss(self.result)
