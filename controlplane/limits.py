"""What a setting accepts, declared once on its dataclass field.

A numeric field carries a `Range` and an enumerated one its choices, in the field's metadata
(`bounded(...)`, `one_of(...)`). `check_declared` loops over those declarations for the config
file's sections and the engine's settings alike; GET /admin/config (`config.field_limits`) and
the generated configuration reference show the same declarations. Only rules that relate
several fields (max_num_batched_tokens >= max_num_seqs...) are written by hand beside the loop.

Torch-free and nearly import-free, like controlplane.errors: the engine imports it too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from controlplane.errors import FieldError

RANGE = "range"
CHOICES = "choices"
# A field whose choices match case-insensitively (server.log_level: "INFO" is info).
FOLD_CASE = "fold_case"


@dataclass(frozen=True, slots=True)
class Range:
    """A numeric field's allowed values: [lo, hi], either end open; hi None: no upper limit.
    Integer ends (written `1`, not `1.0`) on a field whose default is an int or None ask for an
    integer; otherwise any number is accepted."""

    lo: float
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    unit: str = ""  # said after the range in the error ("seconds")

    def __contains__(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below

    def describe(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        unit = f" {self.unit}" if self.unit else ""
        return f"in {left}{_num(self.lo)}, {_num(self.hi)}{right}{unit}"


def _num(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def bounded(
    default: Any,
    lo: float,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    unit: str = "",
    metadata: dict[str, Any] | None = None,
) -> Any:
    """A dataclass field whose value must lie in a `Range`."""
    limits = {RANGE: Range(lo, hi, lo_open, hi_open, unit)}
    return field(default=default, metadata={**(metadata or {}), **limits})


def one_of(
    default: Any,
    choices: tuple[Any, ...],
    *,
    fold_case: bool = False,
    metadata: dict[str, Any] | None = None,
) -> Any:
    """A dataclass field whose value must be one of `choices`."""
    limits = {CHOICES: tuple(choices), FOLD_CASE: fold_case}
    return field(default=default, metadata={**(metadata or {}), **limits})


def range_of(f: dataclasses.Field) -> Range | None:
    return f.metadata.get(RANGE)


def choices_of(f: dataclasses.Field) -> tuple[Any, ...] | None:
    return f.metadata.get(CHOICES)


def _default(f: dataclasses.Field) -> Any:
    return None if f.default is dataclasses.MISSING else f.default


def _is_number(value: Any) -> bool:
    # bool is an int subclass; `max_num_seqs = true` is a mistake, not 1.
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_field(f: dataclasses.Field, value: Any, where: str) -> None:
    """`value` against what `f` declares (its range, its choices, a bool default's type);
    FieldError naming `where` and the limit. A field unset by default (None) may stay unset."""
    default = _default(f)
    if value is None and default is None:
        return
    r, choices = range_of(f), choices_of(f)
    if r is not None:
        wants_int = isinstance(r.lo, int) and (default is None or type(default) is int)
        if not _is_number(value) or (wants_int and not isinstance(value, int)):
            kind = "an integer" if wants_int else "a number"
            raise FieldError(where, f"must be {kind} {r.describe()}, got {value!r}")
        if value not in r:
            raise FieldError(where, f"must be {r.describe()}, got {value}")
    elif choices is not None:
        seen = value.lower() if f.metadata.get(FOLD_CASE) and isinstance(value, str) else value
        # True == 1: a bool is never one of an int field's choices.
        if isinstance(value, bool) or seen not in choices:
            listed = ", ".join(map(str, choices))
            raise FieldError(where, f"must be one of {listed}; got {value!r}")
    elif isinstance(default, bool) and not isinstance(value, bool):
        raise FieldError(where, f"must be true or false, got {value!r}")


def check_declared(obj: Any, prefix: str = "", skip: frozenset[str] = frozenset()) -> None:
    """Every field of the dataclass `obj` against its declaration, in field order; the error
    names the field as `<prefix><name>`. `skip`: fields a rule spanning several fields checks
    instead (with a message that names the other field)."""
    for f in dataclasses.fields(obj):
        if f.name not in skip:
            check_field(f, getattr(obj, f.name), f"{prefix}{f.name}")


def declared_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of `cls` that declare a range or choices, by name."""
    return {
        f.name: f
        for f in dataclasses.fields(cls)
        if range_of(f) is not None or choices_of(f) is not None
    }
