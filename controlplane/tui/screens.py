"""Modal screens: confirmation, the tuning form, help."""

from __future__ import annotations

from typing import Any, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from controlplane.client.admin import APIError, ClientError

# The live settings the form edits: numbers as text inputs, the rest as choices. A bare name is
# an engine knob (engine.<name>); the autopilot's targets are in milliseconds (0: none).
TUNABLE = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "prefill_chunk_size",
    "speculative_num_tokens",
    "speculative_max_batch_size",
    "autopilot.ttft_p99_ms",
    "autopilot.itl_p99_ms",
)
CHOICES: dict[str, tuple[str, ...]] = {
    "preemption_mode": ("recompute", "swap"),
    "speculative_method": ("off", "ngram", "draft"),
    "enable_prefix_caching": ("on", "off"),
}


def _key(name: str) -> str:
    """The config field a form row edits."""
    return name if "." in name else f"engine.{name}"


def _dom_id(name: str) -> str:
    return name.replace(".", "-")


def _number(raw: str) -> Any:
    """An input's text as an int or float; the text itself when neither (the API says why)."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def _choice(value: Any) -> Any:
    """A setting's value as the form shows it (booleans as on / off: Textual's blank Select
    value is False, so a boolean option value would read as "nothing selected")."""
    return ("on" if value else "off") if isinstance(value, bool) else value


class ConfirmScreen(ModalScreen[bool]):
    """Yes / no. Dismisses with True on yes."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box", classes="modal-box"):
            yield Static(self.question, id="confirm-question")
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


class TuneScreen(ModalScreen[dict[str, Any] | None]):
    """Change the live engine knobs through PATCH /admin/config.

    Only fields whose value differs from the current one are sent; the API validates (all or
    nothing). Its error appears next to the field it names; success shows the new effective
    values and the form stays open (Escape closes it)."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape", "close", "Close"),
        Binding("ctrl+s", "apply", "Apply"),
    ]

    def __init__(self, client: Any, fields: dict[str, Any]) -> None:
        super().__init__()
        self.client = client
        self.fields = fields
        self.result: dict[str, Any] | None = None

    def current(self, name: str) -> Any:
        return (self.fields.get(_key(name)) or {}).get("value")

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="tune-box", classes="modal-box"):
            yield Static(
                "[b]Tune the engine[/] (live, applied at the next step) and the autopilot's "
                "p99 targets in ms (0: none)",
                id="tune-title",
            )
            with Grid(id="tune-grid"):
                for name in TUNABLE:
                    yield Label(name, classes="field-label")
                    yield Input(
                        value="" if self.current(name) is None else f"{self.current(name):g}",
                        id=f"in-{_dom_id(name)}",
                    )
                    yield Static("", id=f"err-{_dom_id(name)}", classes="field-error")
                for name, choices in CHOICES.items():
                    yield Label(name, classes="field-label")
                    value = _choice(self.current(name))
                    options = [(c, c) for c in choices]
                    if value in choices:
                        yield Select(options, value=value, allow_blank=False, id=f"in-{name}")
                    else:  # unknown to this form (a newer daemon): left unchanged
                        yield Select(options, id=f"in-{name}")
                    yield Static("", id=f"err-{name}", classes="field-error")
            yield Static("", id="tune-status")
            with Horizontal(classes="buttons"):
                yield Button("Apply (ctrl+s)", variant="primary", id="apply")
                yield Button("Close (esc)", id="close")

    def on_mount(self) -> None:
        first = self.query_one(f"#in-{_dom_id(TUNABLE[0])}", Input)
        first.focus()
        first.select_all()  # typing replaces the current value

    def changes(self) -> dict[str, Any]:
        body: dict[str, Any] = {}
        for name in TUNABLE:
            value = _number(self.query_one(f"#in-{_dom_id(name)}", Input).value.strip())
            if value != self.current(name):
                body[_key(name)] = value
        for name in CHOICES:
            value = self.query_one(f"#in-{name}", Select).value
            if isinstance(value, str) and value != _choice(self.current(name)):
                on_off = isinstance(self.current(name), bool)
                body[_key(name)] = value == "on" if on_off else value
        return body

    @on(Input.Submitted)
    @on(Button.Pressed, "#apply")
    def action_apply(self) -> None:
        for err in self.query(".field-error"):
            err.update("")
        body = self.changes()
        status = self.query_one("#tune-status", Static)
        if not body:
            status.update("[dim]nothing changed[/]")
            return
        status.update("applying…")
        self.apply(body)

    @work(exclusive=True, group="tune")
    async def apply(self, body: dict[str, Any]) -> None:
        status = self.query_one("#tune-status", Static)
        try:
            answer = await self.client.patch_config(body)
        except APIError as exc:
            name = (exc.param or "").removeprefix("engine.")
            target = self.query(f"#err-{_dom_id(name)}") if name else None
            if target:
                target.first(Static).update(f"[b red]{exc.message}[/]")
                status.update(f"[red]rejected ({exc.status}), nothing changed[/]")
            else:
                status.update(f"[b red]rejected ({exc.status}): {exc.message}[/]")
            return
        except ClientError as exc:
            status.update(f"[b red]daemon unreachable: {exc}[/]")
            return
        self.fields = answer.get("fields") or self.fields
        self.result = answer
        effective = ", ".join(f"{k.removeprefix('engine.')} = {self.current(k)}" for k in body)
        status.update(f"[b green]applied[/]: now {effective}")
        on_applied = getattr(self.app, "config_applied", None)
        if on_applied is not None:
            on_applied(answer)

    @on(Button.Pressed, "#close")
    def action_close(self) -> None:
        self.dismiss(self.result)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        lines = "\n".join(f"  [b]{k:<10}[/] {d}" for k, d in self.keys)
        with VerticalScroll(id="help-box", classes="modal-box"):
            yield Static(f"[b]Keys[/]\n{lines}\n\n[dim]escape closes[/]", id="help-text")

    def action_close(self) -> None:
        self.dismiss(None)
