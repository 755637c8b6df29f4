"""OpenAI tool calls: the request fields, the prompt, the constraint and the parsing of the output.

Pure Python (no torch, no engine): the /v1 parser reads a chat request's `tools` with
`parse_tools` and checks the conversation with `validate_history`; the runtime renders it with
`render_messages` (into the model's own template when that reads a `tools` variable, else in
the default format below); `constrained_schema` is the grammar when the request forces a call;
the output becomes `tool_calls` through `parse_constrained` / `parse_auto`, or `ToolCallStream`
when streaming.

The default format (for templates without a `tools` variable, such as SmolLM2's) is the
Hermes / Qwen one that vLLM and llama.cpp also parse, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Llama 3.1 / 3.2 models answer in their own JSON format instead (`{"name": ..., "parameters":
{...}}`, optionally after `<|python_tag|>`), which `parse_auto` reads too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from controlplane.http.errors import invalid

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


# -- The request ------------------------------------------------------------------------------


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


# -- The prompt -------------------------------------------------------------------------------

_JINJA_COMMENT = re.compile(r"\{#.*?#\}", re.S)
_JINJA_TAG = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)
# `tools` as a name of its own: not `custom_tools`, `message.tools` or `tools_in_user_message`.
_TOOLS_NAME = re.compile(r"(?<![\w.])tools(?!\w)")


def has_tools_variable(template_source: str) -> bool:
    """Whether a jinja chat template reads `tools`: only names inside its tags count, not its
    text, comments or string literals (a template that says "tools" to the model but never
    reads the variable would silently drop them)."""
    source = _JINJA_COMMENT.sub("", template_source)
    return any(
        _TOOLS_NAME.search(_STRING_LITERAL.sub("''", tag)) for tag in _JINJA_TAG.findall(source)
    )


def default_system_prompt(tools: list[Tool], parallel: bool) -> str:
    """The system text that offers `tools` to a model whose template has no `tools` variable."""
    listing = "\n".join(_dumps(_describe(t)) for t in tools)
    how_many = (
        "To call several functions at once, write one <tool_call> block for each call."
        if parallel
        else "Call at most one function per reply."
    )
    return (
        "# Tools\n\n"
        "You may call functions to help with the user's request. The functions, as JSON, "
        "one per line:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a function, reply with its name and arguments as JSON in a <tool_call> "
        "block:\n"
        f"{CALL_OPEN}\n"
        '{"name": <function name>, "arguments": <arguments object>}\n'
        f"{CALL_CLOSE}\n"
        f"{how_many} Each result comes back in a {RESPONSE_OPEN} block."
    )


def _describe(tool: Tool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": tool.name}
    if tool.description:
        out["description"] = tool.description
    out["parameters"] = tool.parameters
    return out


def render_messages(
    messages: list[dict[str, Any]], req: ToolRequest | None, template_has_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages to render and the extra chat-template variables. Past calls and results
    are rendered even when `req` offers no tools (choice "none", or no tools): a conversation
    may hold them."""
    offered = req is not None and req.choice.mode != "none"
    if template_has_tools:
        extra = {"tools": [t.to_openai() for t in req.tools]} if offered and req else {}
        return [_with_decoded_arguments(m) for m in messages], extra
    out = [_inline(m) for m in messages]
    if offered and req:
        out = _with_system_text(out, default_system_prompt(req.tools, req.parallel))
    return out, {}


def _decoded(arguments: Any) -> Any:
    """A call's `arguments` JSON text as an object when it is one, else as it came."""
    value = _loads(arguments) if isinstance(arguments, str) else None
    return value if isinstance(value, dict) else arguments


def _with_decoded_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """HF templates write `tool_call.arguments | tojson`: they expect an object, not the JSON
    text that OpenAI's API carries."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    decoded = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            call = {**call, "function": {**fn, "arguments": _decoded(fn.get("arguments"))}}
        decoded.append(call)
    return {**message, "tool_calls": decoded}


def call_block(name: str, arguments: Any) -> str:
    """One call in the default format (`arguments`: JSON text or an object)."""
    return f"{CALL_OPEN}\n{_dumps({'name': name, 'arguments': _decoded(arguments)})}\n{CALL_CLOSE}"


def _inline(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its calls or its result written into its content in the default format
    (a template without `tools` knows nothing of `tool_calls`)."""
    role, content = message.get("role"), message.get("content", "")
    if role == "tool":
        return {**message, "content": f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"}
    calls = message.get("tool_calls")
    if role != "assistant" or not calls:
        return message
    blocks = "\n".join(call_block(c["function"]["name"], c["function"]["arguments"]) for c in calls)
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = f"{content}\n{blocks}" if content.strip() else blocks
    return out


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` after the first system message's own (the tools come after the instructions, as
    in Hermes and Qwen templates), or as a new system message first."""
    for i, message in enumerate(messages):
        if message.get("role") == "system":
            content = message.get("content", "")
            merged = f"{content}\n\n{text}" if content.strip() else text
            return [*messages[:i], {**message, "content": merged}, *messages[i + 1 :]]
    return [{"role": "system", "content": text}, *messages]


# -- The constraint ---------------------------------------------------------------------------


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


# -- The output -------------------------------------------------------------------------------


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


# -- Streaming --------------------------------------------------------------------------------


def _header(index: int, name: str) -> dict[str, Any]:
    function = {"name": name, "arguments": ""}
    call = {"index": index, "id": new_call_id(), "type": "function", "function": function}
    return {"tool_calls": [call]}


def _arguments(index: int, piece: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}


def _content(text: str) -> dict[str, Any]:
    return {"content": text}


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


class ToolCallStream:
    """Turns a stream of text deltas into OpenAI chat streaming deltas: the first delta of a
    call is {"tool_calls": [{"index", "id", "type": "function", "function": {"name",
    "arguments": ""}}]}, later ones {"tool_calls": [{"index", "function": {"arguments":
    piece}}]}; text is {"content": ...}. The argument pieces of a call add up to the arguments
    `parse_constrained` / `parse_auto` give for the whole text."""

    def __init__(self, req: ToolRequest, tools_known: list[Tool]) -> None:
        mode = req.choice.mode
        if mode == "named":
            self._impl: _Stream = _NamedStream(req.choice.name or "")
        elif mode == "required":
            self._impl = _RequiredStream()
        elif mode == "auto":
            self._impl = _AutoStream(tools_known)
        else:
            self._impl = _TextStream()

    def feed(self, delta: str) -> list[dict[str, Any]]:
        return self._impl.feed(delta)

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The deltas still held back, and whether any tool call was emitted."""
        return self._impl.finish()


class _Stream:
    def feed(self, delta: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        raise NotImplementedError


class _TextStream(_Stream):
    """tool_choice "none": the text as it comes."""

    def feed(self, delta: str) -> list[dict[str, Any]]:
        return [_content(delta)] if delta else []

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        return [], False


class _NamedStream(_Stream):
    """The whole output is the arguments. Whitespace around it is dropped (as
    `parse_constrained` strips it): leading at once, trailing held until more text follows."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False  # the header is out
        self._seen_text = False  # a non-space character is out
        self._held = ""

    def feed(self, delta: str) -> list[dict[str, Any]]:
        out = [] if self._started else [_header(0, self._name)]
        self._started = True
        text = self._held + delta
        if not self._seen_text:
            text = text.lstrip(_JSON_WS)
            self._seen_text = bool(text)
        piece = text.rstrip(_JSON_WS)
        self._held = text[len(piece) :]
        if piece:
            out.append(_arguments(0, piece))
        return out

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        return [], self._started


class _RequiredStream(_Stream):
    def __init__(self) -> None:
        self._scanner = _CallArrayScanner()
        self._any = False

    def feed(self, delta: str) -> list[dict[str, Any]]:
        out = []
        for kind, index, text in self._scanner.feed(delta):
            out.append(_header(index, text) if kind == "call" else _arguments(index, text))
            self._any = True
        return out

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        return [], self._any


class _AutoStream(_Stream):
    """Text streams out as content, except what could start a call: a suffix that may be the
    start of "<tool_call>", and at the start of the output (after whitespace) a "{" or
    "<|python_tag|>" (Llama's calls are the whole output). From a call marker on, everything
    is buffered and parsed with `parse_auto` at the end."""

    def __init__(self, tools: list[Tool]) -> None:
        self._tools = tools
        self._state = "start"  # "start" (only whitespace so far), "text" or "buffer"
        self._held: list[str] = []  # held back (start, text) or buffered (buffer)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._held.append(delta)
        if self._state == "buffer":
            return []
        if self._state == "start":
            head = "".join(self._held).lstrip()
            if not head or CALL_OPEN.startswith(head) or PYTHON_TAG.startswith(head):
                return []  # could still become a call
            if head.startswith(("{", CALL_OPEN, PYTHON_TAG)):
                self._state = "buffer"
                return []
            self._state = "text"
        return self._text()

    def _text(self) -> list[dict[str, Any]]:
        text = "".join(self._held)
        at = text.find(CALL_OPEN)
        if at >= 0:
            self._state, self._held = "buffer", [text[at:]]
            return [_content(text[:at])] if at else []
        keep = _marker_start_len(text, CALL_OPEN)
        self._held = [text[len(text) - keep :]] if keep else []
        out = text[: len(text) - keep]
        return [_content(out)] if out else []

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        text = "".join(self._held)
        self._held = []
        if self._state != "buffer":
            return ([_content(text)] if text else []), False
        content, calls = parse_auto(text, self._tools)
        if not calls:
            return ([_content(text)] if text else []), False
        out = [_content(content)] if content else []
        for i, call in enumerate(calls):
            out += [_header(i, call.name), _arguments(i, call.arguments)]
        return out, True


def _marker_start_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
