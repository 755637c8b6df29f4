"""What every phase of tool calling shares: limits, the JSON helpers, ToolCall."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 128
NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: what starts a tool call (optional for JSON calls)
_JSON_WS = " \t\r\n"  # JSON's whitespace (str.strip's default also strips other spaces)
_CHOICE_MODES = ("none", "auto", "required")
_SHOW_CHARS = 80  # how much of a bad value an error message quotes


def _empty_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


def _show(value: Any) -> str:
    """A bad value, quoted in an error message: shortened, since it is hostile input."""
    text = repr(value)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."


def _loads(text: str) -> Any:
    """json.loads, or None for text that is not JSON (the output was cut short, or the model
    wrote something else). RecursionError: a model can nest deeper than Python's limit."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class ToolCall:
    id: str  # "call_" + 24 hex chars
    name: str
    arguments: str  # JSON text

    @classmethod
    def new(cls, name: str, arguments: str) -> ToolCall:
        return cls(new_call_id(), name, arguments)

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}
