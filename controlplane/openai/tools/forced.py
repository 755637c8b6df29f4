"""Forced calls (`tool_choice` required or named): the schema that constrains the output, and
the calls read back from it by the incremental scanner that streaming uses too (so a
streamed call and the final parse agree)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controlplane.openai.tools.common import _JSON_WS, ToolCall, _loads
from controlplane.openai.tools.request import ToolRequest


def constrained_schema(req: ToolRequest) -> dict[str, Any] | None:
    """The JSON schema the output must match when the request forces a call; None for "auto"
    and "none". Named: the arguments themselves (vLLM does the same); required: an array of
    {"name", "arguments"} objects, name first (the grammar keeps the properties' order, which
    the streaming scanner relies on only for latency, not correctness)."""
    if req.choice.mode == "named":
        tool = req.tool(req.choice.name or "")
        return None if tool is None else _object_schema(tool.parameters)
    if req.choice.mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _object_schema(t.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in req.tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    if not req.parallel:
        schema["maxItems"] = 1
    schema["items"] = {"anyOf": calls}
    return schema


def _object_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """`parameters` with "type": "object" made explicit: a schema without a type (`{}`) would
    let the model answer a number, which is no call."""
    return parameters if "type" in parameters else {**parameters, "type": "object"}


def parse_constrained(text: str, req: ToolRequest) -> list[ToolCall] | None:
    """The calls in an output constrained by `constrained_schema`; None when it does not parse
    (cut short by max_tokens: the caller returns it as content, finish_reason "length"), and
    for modes without a constraint. The arguments are the output's own text (not re-encoded),
    so that they equal what `ToolCallStream` streamed."""
    if req.choice.mode == "named":
        arguments = text.strip(_JSON_WS)
        if req.choice.name is None or not isinstance(_loads(arguments), dict):
            return None
        return [ToolCall.new(req.choice.name, arguments)]
    if req.choice.mode != "required" or not _is_call_array(_loads(text), req):
        return None
    scanner = _CallArrayScanner()
    scanner.feed(text)
    return [ToolCall.new(c.name or "", "".join(c.arguments)) for c in scanner.calls]


def _is_call_array(value: Any, req: ToolRequest) -> bool:
    if not isinstance(value, list) or not value or (len(value) > 1 and not req.parallel):
        return False
    known = {t.name for t in req.tools}
    return all(
        isinstance(c, dict)
        and c.keys() == {"name", "arguments"}
        and c["name"] in known
        and isinstance(c["arguments"], dict)
        for c in value
    )


@dataclass(slots=True)
class _PartialCall:
    name: str | None = None
    name_chars: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)  # all of it, as it came
    unsent: list[str] = field(default_factory=list)  # what came before the name was known


class _CallArrayScanner:
    """An incremental scanner of `[{"name": "...", "arguments": {...}}, ...]`: each character
    is looked at once, tracking string / escape state and bracket depth, so a long output costs
    no re-parsing. It reports a call when its name string is complete and the raw text of its
    arguments value as it arrives (arguments seen before the name wait for it). Characters out
    of place are skipped: the grammar rules them out, and the final check is json.loads."""

    def __init__(self) -> None:
        self.calls: list[_PartialCall] = []
        self._level = 0  # 0: before the array, 1: in it, 2: in a call object, 3: after it
        self._slot = "key"  # in a call object: "key", "colon", "value" or "after"
        self._key = ""  # the key whose value is being read
        self._key_chars: list[str] | None = None  # a key string being read (with its quotes)
        self._value: str | None = None  # the value being read: "string", "nested" or "bare"
        self._depth = 0  # brackets open in a nested value
        self._in_string = False
        self._escape = False
        self._events: list[tuple[str, int, list[str]]] = []

    def feed(self, text: str) -> list[tuple[str, int, str]]:
        """Events for `text`: ("call", index, name) and ("arguments", index, piece)."""
        for c in text:
            self._char(c)
        events, self._events = self._events, []
        return [(kind, i, "".join(parts)) for kind, i, parts in events]

    def _char(self, c: str) -> None:
        if self._value is not None and self._value_char(c):
            return
        if self._key_chars is not None:
            self._key_char(c)
        elif c in _JSON_WS:
            pass
        elif self._level == 0 and c == "[":
            self._level = 1
        elif self._level == 1:
            self._array_char(c)
        elif self._level == 2:
            self._object_char(c)

    def _array_char(self, c: str) -> None:
        if c == "{":
            self._level, self._slot = 2, "key"
            self.calls.append(_PartialCall())
        elif c == "]":
            self._level = 3

    def _object_char(self, c: str) -> None:
        if self._slot == "key" and c == '"':
            self._key_chars = [c]
        elif self._slot in ("key", "after") and c in ",}":
            self._slot = "key"
            if c == "}":
                self._level = 1
        elif self._slot == "colon" and c == ":":
            self._slot = "value"
        elif self._slot == "value":
            self._value = "string" if c == '"' else "nested" if c in "{[" else "bare"
            self._depth = 0
            self._value_char(c)

    def _key_char(self, c: str) -> None:
        assert self._key_chars is not None
        self._key_chars.append(c)
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            key = _loads("".join(self._key_chars))
            self._key = key if isinstance(key, str) else ""
            self._key_chars, self._slot = None, "colon"

    def _value_char(self, c: str) -> bool:
        """`c` as part of the value being read; False when it ends a bare value (a number,
        true, false or null) and belongs to the object around it."""
        if self._value == "bare":
            if c in _JSON_WS or c in ",}":
                self._end_value()
                return False
            self._take(c)
            return True
        self._take(c)
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._value == "string":
                    self._end_value()
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value()
        return True

    def _take(self, c: str) -> None:
        call = self.calls[-1]
        if self._key == "name":
            call.name_chars.append(c)
        elif self._key == "arguments":
            call.arguments.append(c)
            if call.name is None:
                call.unsent.append(c)
            else:
                self._send_arguments(len(self.calls) - 1, c)

    def _end_value(self) -> None:
        self._value, self._slot = None, "after"
        call = self.calls[-1]
        if self._key != "name" or call.name is not None:
            return
        name = _loads("".join(call.name_chars))
        if isinstance(name, str):
            call.name = name
            index = len(self.calls) - 1
            self._events.append(("call", index, [name]))
            if call.unsent:
                self._send_arguments(index, "".join(call.unsent))
                call.unsent.clear()

    def _send_arguments(self, index: int, piece: str) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "arguments" and last[1] == index:
            last[2].append(piece)
        else:
            self._events.append(("arguments", index, [piece]))
