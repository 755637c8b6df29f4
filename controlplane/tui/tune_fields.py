"""The tuning form's rows and their checks (no Textual): one row per live setting of GET
/admin/config, its range or choices from the same answer, what is typed parsed against them,
and the 10x flag on a number changed too far."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

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


def field_key(name: str) -> str:
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
