"""The request: `tools`, `tool_choice`, `parallel_tool_calls` and the legacy `functions` /
`function_call`, read and checked (400s naming the field), and the conversation's calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane.http.errors import invalid
from controlplane.openai.tools.common import (
    _CHOICE_MODES,
    MAX_TOOLS,
    NAME_RE,
    _empty_parameters,
    _show,
)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str  # "" when absent
    parameters: dict[str, Any]  # {"type": "object", "properties": {}} when absent

    def to_openai(self) -> dict[str, Any]:
        """The request's shape, which is what HF chat templates read from `tools`."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # for "named"


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: list[Tool]
    choice: ToolChoice
    parallel: bool  # parallel_tool_calls, default True
    # The deprecated `functions` / `function_call` fields: the answer holds at most one call
    # (their response shape, `message.function_call`, has room for one), so `parallel` is False.
    legacy: bool = False

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    @property
    def schema_field(self) -> str:
        """The field an error of the forced call's grammar names: the named function's
        parameters, or the whole list (with `required`, any tool's schema may be at fault)."""
        listed = "functions" if self.legacy else "tools"
        if self.choice.mode != "named":
            return listed
        i = next(i for i, t in enumerate(self.tools) if t.name == self.choice.name)
        return f"{listed}[{i}].parameters" if self.legacy else f"{listed}[{i}].function.parameters"


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The tools of a chat request body (`tools`, `tool_choice`, `parallel_tool_calls`, or the
    deprecated `functions` / `function_call`); None when it offers none. APIError 400 naming
    the field for anything malformed."""
    tools, legacy = _read_tools(body)
    choice = _read_choice(body, tools, "functions" if legacy else "tools")
    parallel = _read_parallel(body) and not legacy
    if not tools:
        return None
    return ToolRequest(tools, choice, parallel, legacy)


def _read_tools(body: dict[str, Any]) -> tuple[list[Tool], bool]:
    tools, functions = body.get("tools"), body.get("functions")
    if tools is not None and functions is not None:
        raise invalid("functions", "cannot be combined with tools (it is their deprecated form)")
    if functions is not None:
        return _function_list("functions", functions, wrapped=False), True
    if tools is not None:
        return _function_list("tools", tools, wrapped=True), False
    return [], False


def _function_list(field_name: str, value: Any, *, wrapped: bool) -> list[Tool]:
    """`wrapped`: entries are {"type": "function", "function": {...}} (tools), else the
    function objects themselves (functions)."""
    if not isinstance(value, list):
        raise invalid(field_name, f"must be an array, got {type(value).__name__}")
    if len(value) > MAX_TOOLS:
        raise invalid(field_name, f"has {len(value)} entries; the limit is {MAX_TOOLS}")
    out: list[Tool] = []
    first_at: dict[str, int] = {}
    for i, entry in enumerate(value):
        where = f"{field_name}[{i}]"
        if wrapped:
            entry, where = _unwrap(entry, where), f"{where}.function"
        tool = _function(entry, where)
        if tool.name in first_at:
            raise invalid(
                f"{where}.name",
                f"{tool.name!r} is already the name of {field_name}[{first_at[tool.name]}]; "
                "function names must be unique",
            )
        first_at[tool.name] = i
        out.append(tool)
    return out


def _unwrap(entry: Any, where: str) -> Any:
    if not isinstance(entry, dict):
        raise invalid(where, 'must be an object {"type": "function", "function": {...}}')
    if entry.get("type") != "function":
        raise invalid(
            f"{where}.type",
            f"must be 'function' (the only tool type), got {_show(entry.get('type'))}",
        )
    return entry.get("function")


def _function(fn: Any, where: str) -> Tool:
    if not isinstance(fn, dict):
        raise invalid(where, 'must be a function object {"name": ..., "parameters": {...}}')
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise invalid(
            f"{where}.name",
            f"must be 1 to 64 characters among a-z, A-Z, 0-9, _ and -, got {_show(name)}",
        )
    description = fn.get("description")
    if description is None:
        description = ""
    elif not isinstance(description, str):
        raise invalid(f"{where}.description", f"must be a string, got {type(description).__name__}")
    return Tool(name, description, _parameters(fn.get("parameters"), f"{where}.parameters"))


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return _empty_parameters()
    if not isinstance(value, dict):
        raise invalid(where, f"must be a JSON object (a JSON schema), got {type(value).__name__}")
    # The arguments are an object (OpenAI's rule too): a schema of another type could never
    # be met by a call.
    if value.get("type", "object") != "object":
        raise invalid(f"{where}.type", f"must be 'object', got {_show(value.get('type'))}")
    return value


def _read_choice(body: dict[str, Any], tools: list[Tool], tools_field: str) -> ToolChoice:
    choice, call = body.get("tool_choice"), body.get("function_call")
    if choice is not None and call is not None:
        raise invalid("function_call", "cannot be combined with tool_choice")
    if choice is not None:
        field_name, parsed = "tool_choice", _tool_choice(choice)
    elif call is not None:
        field_name, parsed = "function_call", _function_call(call)
    else:
        return ToolChoice("auto" if tools else "none")
    _check_choice(parsed, field_name, tools, tools_field)
    return parsed


def _tool_choice(value: Any) -> ToolChoice:
    if isinstance(value, str) and value in _CHOICE_MODES:
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return ToolChoice("named", fn["name"])
    raise invalid(
        "tool_choice",
        "must be 'none', 'auto', 'required' or "
        f'{{"type": "function", "function": {{"name": ...}}}}, got {_show(value)}',
    )


def _function_call(value: Any) -> ToolChoice:
    if value in ("none", "auto"):
        return ToolChoice(value)
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return ToolChoice("named", value["name"])
    raise invalid(
        "function_call", f"must be 'none', 'auto' or {{\"name\": ...}}, got {_show(value)}"
    )


def _check_choice(choice: ToolChoice, field_name: str, tools: list[Tool], tools_field: str) -> None:
    """A choice that forces a call needs the tools it names."""
    if choice.mode == "required" and not tools:
        raise invalid(field_name, f"is 'required' but the request has no {tools_field}")
    if choice.mode != "named" or choice.name in {t.name for t in tools}:
        return
    if not tools:
        raise invalid(
            field_name, f"names the function {choice.name!r} but the request has no {tools_field}"
        )
    known = ", ".join(t.name for t in tools)
    raise invalid(
        field_name,
        f"names the function {choice.name!r}, which is not in {tools_field} (known: {known})",
    )


def _read_parallel(body: dict[str, Any]) -> bool:
    value = body.get("parallel_tool_calls")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise invalid("parallel_tool_calls", f"must be a boolean, got {_show(value)}")
    return value


def validate_history(messages: list[dict[str, Any]]) -> None:
    """400 for past tool calls and results that are not in OpenAI's shape (messages already
    parsed: each a dict with a role)."""
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise invalid(
                f"{where}.tool_call_id", "is required in a tool message (the id of the call)"
            )
        calls = message.get("tool_calls")
        if role == "assistant" and calls is not None:
            _check_calls(calls, f"{where}.tool_calls")


def _check_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise invalid(where, f"must be an array of tool calls, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise invalid(at, 'must be an object {"id", "type": "function", "function"}')
        if not isinstance(call.get("id"), str):
            raise invalid(f"{at}.id", "must be a string (the call's id)")
        if call.get("type") != "function":
            raise invalid(f"{at}.type", f"must be 'function', got {_show(call.get('type'))}")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"{at}.function", 'must be an object {"name", "arguments"}')
        for key in ("name", "arguments"):
            if not isinstance(fn.get(key), str):
                raise invalid(f"{at}.function.{key}", f"must be a string, got {_show(fn.get(key))}")
