"""Modal screens: confirmation, the tuning form (docked beside the dashboard), help."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.markup import escape
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from controlplane.client.admin import APIError, ClientError

# The tuning form is built from GET /admin/config: every live field with a scalar value, by
# section in this order (a section a newer daemon adds comes last); numbers as inputs, booleans
# and enumerations as selects. Each field's range and choices come from the same answer.
SECTION_ORDER = ("engine", "autopilot", "server", "jobs", "alerts")
SECTION_NOTES = {
    "engine": "applied at the next step",
    "autopilot": "p99 targets in ms, 0: none",
    "server": "admission and limits",
    "jobs": "background jobs",
    "alerts": "dashboard thresholds",
}
# A number changed by more than this factor either way is flagged and needs a second ctrl+s.
FLAG_RATIO = 10.0
_INT = re.compile(r"[+-]?\d+")


def _key(name: str) -> str:
    """The config field a form row edits (a bare name is an engine knob)."""
    return name if "." in name else f"engine.{name}"


def _dom_id(name: str) -> str:
    return name.replace(".", "-")


def fmt(value: Any) -> str:
    """A setting's value as the form writes it: 2000.0 as 2000, never 2e+06."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return "" if value is None else str(value)


def _kind(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    return {int: "int", float: "float", str: "str"}.get(type(value))


@dataclass(frozen=True, slots=True)
class FormField:
    """One row of the form: `kind` is int, float, bool, choice or text."""

    key: str
    kind: str
    choices: tuple[Any, ...] = ()
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    @property
    def name(self) -> str:
        """engine.max_num_seqs -> max_num_seqs; other sections keep their prefix."""
        return self.key.removeprefix("engine.")

    @property
    def dom(self) -> str:
        return _dom_id(self.name)

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0] if "." in self.key else ""

    @property
    def label(self) -> str:
        return self.key.split(".", 1)[-1]

    @property
    def number(self) -> bool:
        return self.kind in ("int", "float")

    def range_text(self) -> str:
        """The range as shown: [1, 4096], (0, 1), >= 0; empty when the daemon gave none."""
        if self.lo is None:
            return "" if self.hi is None else f"<= {fmt(self.hi)}"
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {fmt(self.lo)}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"{left}{fmt(self.lo)}, {fmt(self.hi)}{right}"

    def within(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or not (value >= self.hi if self.hi_open else value > self.hi)

    def parse(self, text: str) -> tuple[Any, str | None]:
        """The typed text as this field's value, or (None, why not)."""
        if not self.number:
            return text, None
        t = text.strip()
        shown = t if len(t) <= 24 else t[:24] + "…"
        if not t:
            return None, "empty: type a number"
        if self.kind == "int":
            if not _INT.fullmatch(t):
                return None, f"not a whole number: {shown!r}"
            value: float = int(t)
        else:
            try:
                value = float(t)
            except ValueError:
                return None, f"not a number: {shown!r}"
            if not math.isfinite(value):
                return None, f"not a finite number: {shown!r}"
        if not self.within(value):
            return None, f"out of range: must be in {self.range_text()}, got {fmt(value)}"
        return value, None


def form_fields(fields: dict[str, dict[str, Any]]) -> list[FormField]:
    """The form's rows from GET /admin/config's fields: every live one with a scalar value
    (lists such as `prices` are left to the API), grouped by section."""
    rows = []
    for key, f in fields.items():
        if not f.get("live") or isinstance(f.get("value"), list | dict):
            continue
        kind = f.get("type") or _kind(f.get("value"))
        choices = tuple(f.get("choices") or ())
        if kind == "bool":
            choices = (True, False)
        elif kind == "str":
            kind = "choice" if choices else "text"
        elif kind not in ("int", "float"):
            continue
        rows.append(
            FormField(
                key,
                kind,
                choices,
                f.get("min"),
                f.get("max"),
                bool(f.get("min_exclusive")),
                bool(f.get("max_exclusive")),
            )
        )
    order = {s: i for i, s in enumerate(SECTION_ORDER)}
    return sorted(rows, key=lambda r: order.get(r.section, len(order)))  # stable within one


def flag(field: FormField, current: Any, new: Any) -> str | None:
    """The note for a number changed by more than FLAG_RATIO either way ("12x the current
    2000: intended?"); None otherwise."""
    if not field.number or new is None or new == current:
        return None
    if not isinstance(current, int | float) or isinstance(current, bool) or current <= 0:
        return None  # from 0 (none) or unset: no scale to compare with
    ratio = new / current
    if ratio > FLAG_RATIO:
        return f"{_times(ratio)} the current {fmt(current)}: intended?"
    if ratio < 1 / FLAG_RATIO:
        if new <= 0:
            return f"{fmt(new)}, from the current {fmt(current)}: intended?"
        return f"1/{_times(1 / ratio)[:-1]} of the current {fmt(current)}: intended?"
    return None


def _times(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.1f}".rstrip("0").rstrip(".") + "x"


def _n(stats: dict[str, Any] | None, name: str) -> int | None:
    value = (stats or {}).get(name)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def preview(
    key: str, old: Any, new: Any, stats: dict[str, Any] | None, fields: dict[str, Any]
) -> str:
    """One line: what changing `key` from `old` to `new` would do now, from the latest stats
    (what the daemon does with it: controlplane/engine/scheduler.py preempts the running
    sequences above a lowered max_num_seqs at its next step; controlplane/openai/serving.py
    answers 429 to a new request that would wait beyond max_queue_len, and drops no one)."""
    up = isinstance(new, int | float) and isinstance(old, int | float) and new > old
    running, queue = _n(stats, "num_running"), _n(stats, "queue_length")
    n = fmt(new)
    if key == "engine.max_num_seqs":
        return _seqs_line(n, int(new), up, running, queue, stats, fields)
    if key == "engine.max_num_batched_tokens":
        if up:
            return (
                f"raising max_num_batched_tokens to {n} lengthens prefill steps: ITL p99 may rise"
            )
        seqs = _n(stats, "max_num_seqs") or (fields.get("engine.max_num_seqs") or {}).get("value")
        refused = isinstance(seqs, int) and new < seqs
        return f"lowering max_num_batched_tokens to {n}: shorter steps, prompts take more of " + (
            f"them; below max_num_seqs ({seqs}): the daemon will refuse it"
            if refused
            else "them: TTFT may rise"
        )
    if key == "engine.prefill_chunk_size":
        if up:
            return (
                f"raising prefill_chunk_size to {n}: first tokens sooner, but the decode steps "
                "a chunk rides with stall longer: ITL p99 may rise"
            )
        return (
            f"lowering prefill_chunk_size to {n}: smoother decode steps, long prompts take "
            "more steps: TTFT may rise"
        )
    if key == "server.max_queue_len":
        return _queue_line(n, new, up, queue)
    if key in ("autopilot.ttft_p99_ms", "autopilot.itl_p99_ms"):
        metric = "TTFT" if "ttft" in key else "ITL"
        pilot = (stats or {}).get("autopilot") or {}
        off = " (the autopilot is off: p turns it on)" if pilot.get("state") == "off" else ""
        if not new:
            return f"no {metric} p99 target: the autopilot stops aiming at {metric}{off}"
        measured = (stats or {}).get(key.removeprefix("autopilot."))
        if not isinstance(measured, int | float):
            return f"{metric} p99 target {n} ms (no {metric} measured yet){off}"
        verdict = "missed" if measured > new else "met"
        return f"{metric} p99 target {n} ms: {verdict} now ({measured:.0f} ms, last minute){off}"
    if key == "autopilot.enabled":
        if new:
            return "autopilot on: it moves max_num_seqs, the token budget and the chunk size"
        return "autopilot off: the knobs keep their current values"
    if key == "engine.enable_prefix_caching":
        if new:
            return "prefix caching on: requests sharing a prompt prefix reuse its KV blocks"
        rate = (stats or {}).get("prefix_cache_hit_rate")
        now = f" (hit rate now {rate:.0%})" if isinstance(rate, int | float) else ""
        return f"prefix caching off: no new cache hits{now}; blocks in use are not freed"
    if key == "engine.preemption_mode":
        if new == "swap":
            return "swap: a preempted request's KV moves to host memory, not recomputed"
        return "recompute: a preempted request's KV is dropped and recomputed when it resumes"
    if key == "engine.speculative_method":
        return "speculation off" if new == "off" else f"speculation {new}: from the next step"
    if key == "engine.speculative_max_batch_size":
        now = "" if running is None else f" ({running} running now: "
        now += "" if running is None else ("paused)" if running > new else "active)")
        return f"speculation pauses above {n} running sequences{now}"
    if key == "engine.speculative_num_tokens":
        longer = "longer" if up else "shorter"
        return f"{n} draft tokens per step (from {fmt(old)}): {longer} verification steps"
    return f"{key.removeprefix('engine.')} {fmt(old)} -> {n}"


def _seqs_line(
    n: str,
    new: int,
    up: bool,
    running: int | None,
    queue: int | None,
    stats: dict[str, Any] | None,
    fields: dict[str, Any],
) -> str:
    if up:
        start = ""
        if running is not None and queue is not None:
            start = f": up to {min(queue, max(0, new - running))} of the {queue} waiting start"
        kv = (stats or {}).get("kv_usage_perc")
        kv_text = f" (KV cache {kv:.0f}% used)" if isinstance(kv, int | float) else ""
        return f"raising max_num_seqs to {n}{start}; longer steps: ITL p99 may rise{kv_text}"
    mode = (fields.get("engine.preemption_mode") or {}).get("value")
    what = "KV swapped to host" if mode == "swap" else "KV dropped, recomputed later"
    if running is None:
        return f"lowering max_num_seqs to {n} preempts the running requests above {n} ({what})"
    if running > new:
        return (
            f"lowering max_num_seqs to {n} preempts about {running - new} of the {running} "
            f"running requests at the next step ({what})"
        )
    return (
        f"lowering max_num_seqs to {n}: {running} running, none preempted; fewer start per "
        f"step, the queue ({queue or 0}) may grow"
    )


def _queue_line(n: str, new: Any, up: bool, queue: int | None) -> str:
    if new == 0:
        return "max_queue_len 0: every request that finds no free batch slot gets 429"
    if queue is not None and new <= queue:
        op = "<" if new < queue else "="
        return (
            f"max_queue_len {n} {op} queue {queue}: the {queue} waiting stay queued (none is "
            f"dropped); each new request that would wait gets 429 until fewer than {n} wait"
        )
    if up:
        return f"raising max_queue_len to {n}: more requests wait (longer TTFT) instead of a 429"
    now = "" if queue is None else f" (queue now {queue})"
    return f"lowering max_queue_len to {n}{now}: a request that would wait beyond {n} gets 429"


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
    """Change live settings through PATCH /admin/config, docked to the right of the dashboard.

    `fields`: GET /admin/config's fields (the rows, their ranges and choices); `stats`: the
    latest /admin/stats (a dict, or a callable returning the latest; None: the app's `stats`)
    for the preview. Each field is checked as it is typed (a number, within its range); a
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
        preview_interval: float = 1.0,
    ) -> None:
        super().__init__()
        self.client = client
        # A copy: the values the form opened with are what "changed" is measured against, so
        # a knob the autopilot moves meanwhile is not sent back unless the operator typed it.
        self.fields = {k: dict(v) for k, v in fields.items()}
        self._stats = stats
        self.preview_interval = preview_interval
        self.form = form_fields(self.fields)
        self.by_key = {f.key: f for f in self.form}
        self.by_dom = {f.dom: f for f in self.form}
        self.api_errors: dict[str, str] = {}
        self.confirmed: dict[str, Any] = {}  # flagged values a first ctrl+s acknowledged
        self.result: dict[str, Any] | None = None

    # -- data --------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any] | None:
        source = self._stats
        if callable(source):
            source = source()
        elif source is None:
            source = getattr(self.app, "stats", None)
        return source if isinstance(source, dict) else None

    def current(self, name: str) -> Any:
        return (self.fields.get(_key(name)) or {}).get("value")

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
            field = self.by_key.get(param) or self.by_key.get(_key(param)) if param else None
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
        on_applied = getattr(self.app, "config_applied", None)
        if on_applied is not None:
            on_applied(self.result)

    @on(Button.Pressed, "#close")
    def action_close(self) -> None:
        self.dismiss(self.result)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, keys: list[tuple[str, str]], more: str = "") -> None:
        super().__init__()
        self.keys = keys
        self.more = more  # further sections (Rich markup), after the keys

    def compose(self) -> ComposeResult:
        lines = "\n".join(f"  [b]{k:<10}[/] {d}" for k, d in self.keys)
        with VerticalScroll(id="help-box", classes="modal-box"):
            yield Static(f"[b]Keys[/]\n{lines}\n\n{self.more}[dim]escape closes[/]", id="help-text")

    def action_close(self) -> None:
        self.dismiss(None)
