"""Auto-parsed calls (`tool_choice` auto): `<tool_call>` blocks and Llama 3.x JSON calls found
in free output; malformed output stays content."""

from __future__ import annotations

import json
from typing import Any

from controlplane.openai.tools.common import (
    _JSON_WS,
    CALL_CLOSE,
    CALL_OPEN,
    PYTHON_TAG,
    ToolCall,
    _dumps,
    _loads,
)
from controlplane.openai.tools.request import Tool


def parse_auto(text: str, tools: list[Tool]) -> tuple[str | None, list[ToolCall]]:
    """The content and the calls of an unconstrained output, in the formats this server
    documents: <tool_call> blocks (the default format), or Llama 3.x JSON calls as the whole
    output. Anything malformed, or a function not in `tools`, gives (text, []): the model
    answered in text after all, and the client sees what it wrote. Never raises."""
    known = {t.name for t in tools}
    if CALL_OPEN in text:
        found = _parse_blocks(text, known)
    elif text.strip().startswith(("{", PYTHON_TAG)):
        found = _parse_llama(text, known)
    else:
        found = None
    return found if found is not None else (text, [])


def _parse_blocks(text: str, known: set[str]) -> tuple[str | None, list[ToolCall]] | None:
    outside: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        body_at = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_at)
        # An unclosed last block: the model ended its turn right after the JSON.
        body, pos = (
            (text[body_at:], len(text)) if end < 0 else (text[body_at:end], end + len(CALL_CLOSE))
        )
        found = _calls_in_block(body, known)
        if found is None:
            return None
        calls.extend(found)
    outside.append(text[pos:])
    return "".join(outside).strip() or None, calls


def _calls_in_block(body: str, known: set[str]) -> list[ToolCall] | None:
    value = _loads(body)
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, known) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _call(item: Any, known: set[str]) -> ToolCall | None:
    """One {"name", "arguments"} object (Llama's key is "parameters"); arguments an object or
    JSON text holding one, or absent for a function without parameters."""
    if not isinstance(item, dict) or item.get("name") not in known:
        return None
    key = "arguments" if "arguments" in item else "parameters"
    arguments = item.get(key, {})
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall.new(item["name"], _dumps(arguments))


def _parse_llama(text: str, known: set[str]) -> tuple[str | None, list[ToolCall]] | None:
    """Llama 3.1 / 3.2: the whole output is one call, or several separated by ";"."""
    body = text.strip().removeprefix(PYTHON_TAG)
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = _skip_ws(body, 0)
    while pos < len(body):
        try:
            item, pos = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return None
        call = _call(item, known)
        if call is None:
            return None
        calls.append(call)
        pos = _skip_ws(body, pos)
        if pos < len(body):
            if body[pos] != ";":
                return None
            pos = _skip_ws(body, pos + 1)
    return (None, calls) if calls else None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _JSON_WS:
        pos += 1
    return pos
