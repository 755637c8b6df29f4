"""The Responses API's request side: its JSON schema (the OpenAPI document's, and the fields
it knows) and `translate`, which turns a Responses body into a chat-completions body
(controlplane.openai.responses serves it)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controlplane.http.errors import APIError, invalid
from controlplane.openai import protocol

if TYPE_CHECKING:
    pass


_NUMBER = {"type": "number"}
_INT = {"type": "integer"}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
}
# The request body as documented (OpenAPI, schemathesis); `translate` decides, naming fields.
RESPONSES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "description": "the served model's id (GET /v1/models)"},
        "input": {
            "description": "a user message's text, or a list of items: messages "
            "({role: user | system | developer | assistant, content: text or input_text / "
            "output_text parts}), function_call and function_call_output items",
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "type": {"enum": ["message", "function_call", "function_call_output"]},
                            "role": {"enum": ["user", "system", "developer", "assistant"]},
                            "content": {
                                "oneOf": [
                                    {"type": "string"},
                                    {"type": "array", "items": _TEXT_PART},
                                ]
                            },
                            "call_id": {"type": "string"},
                            "name": {"type": "string"},
                            "arguments": {"type": "string"},
                            "output": {"type": "string"},
                        },
                    },
                },
            ],
        },
        "instructions": {"type": "string", "description": "a system message before the input"},
        "max_output_tokens": _INT,
        "temperature": _NUMBER,
        "top_p": _NUMBER,
        "user": {"type": "string", "maxLength": protocol.MAX_USER_CHARS},
        "stream": {"type": "boolean"},
        "store": {"type": "boolean", "description": "accepted; nothing is ever stored"},
        "previous_response_id": {
            "type": "string",
            "description": "not supported (stateless server): a 400; send the conversation",
        },
        "conversation": {"description": "not supported (stateless server): a 400"},
        "background": {"type": "boolean", "description": "only false is supported"},
        "text": {
            "type": "object",
            "description": "format: text, json_object, or json_schema {name, schema, strict}",
            "properties": {"format": {"type": "object"}},
        },
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"enum": ["function"]},
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "parameters": {"type": "object"},
                    "strict": {"type": "boolean"},
                },
            },
        },
        "tool_choice": {
            "description": 'none, auto, required, or {"type": "function", "name": ...}',
        },
        "parallel_tool_calls": {"type": "boolean"},
        "metadata": {"type": "object", "description": "echoed in the response, not stored"},
        "truncation": {"enum": ["auto", "disabled"], "description": "accepted, never truncates"},
        # vLLM-style sampling extras, read as chat reads them.
        "seed": _INT,
        "top_k": _INT,
        "min_p": _NUMBER,
        "repetition_penalty": _NUMBER,
        "presence_penalty": _NUMBER,
        "frequency_penalty": _NUMBER,
        "cache_salt": {"type": "string", "minLength": 1},
        "priority": _INT,
    },
}
RESPONSES_FIELDS = frozenset(RESPONSES_SCHEMA["properties"])
# Fields passed to the chat parser unchanged (same name, same meaning, same errors).
_PASSED = (
    "model",
    "temperature",
    "top_p",
    "user",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "cache_salt",
    "priority",
    "parallel_tool_calls",
)
_ROLES = ("user", "system", "developer", "assistant")
_ITEM_TYPES = ("message", "function_call", "function_call_output")
_PART_TYPES = ("input_text", "output_text")
_SHOW_CHARS = 80


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."


def hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class Translation:
    """A Responses request as a chat-completions body, and what maps back."""

    chat: dict[str, Any]  # the chat-completions body
    origins: list[str]  # for each chat message, the Responses field it came from
    echo: dict[str, Any]  # request fields the Response object repeats
    ignored: tuple[str, ...] = ()
    stream: bool = False

    def field(self, name: str) -> str:
        """The Responses field a chat field name stands for (errors name it)."""
        m = re.fullmatch(r"messages\[(\d+)\](.*)", name)
        if m is not None:
            k, rest = int(m.group(1)), m.group(2)
            origin = self.origins[k] if k < len(self.origins) else "input"
            return (
                origin + rest
                if rest.startswith(".content") and origin != "instructions"
                else origin
            )
        m = re.fullmatch(r"tools\[(\d+)\]\.function(.*)", name)
        if m is not None:
            return f"tools[{m.group(1)}]{m.group(2)}"
        if name.startswith("response_format"):
            rest = name.removeprefix("response_format").removeprefix(".json_schema")
            return "text.format" + rest
        return {
            "messages": "input",
            "prompt": "input",
            "max_tokens": "max_output_tokens",
            "max_completion_tokens": "max_output_tokens",
        }.get(name, name)

    def renamed(self, exc: APIError) -> APIError:
        """`exc` naming the Responses field instead of the chat one."""
        if exc.param is None or (new := self.field(exc.param)) == exc.param:
            return exc
        message = exc.message
        if message.startswith(f"{exc.param}: "):
            message = f"{new}: {message[len(exc.param) + 2 :]}"
        return APIError(
            exc.status, message, type=exc.type, param=new, code=exc.code, headers=exc.headers
        )


def _string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid(name, f"must be a string, got {type(value).__name__}")
    return value


def _text(content: Any, where: str, key: str = "content") -> str:
    """A message's content (or an output's): a string, or input_text / output_text parts,
    joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(
            f"{where}.{key}",
            f"must be a string or an array of input_text parts, got {type(content).__name__}",
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{key}[{j}]"
        if not isinstance(part, dict):
            raise invalid(at, 'must be an object {"type": "input_text", "text": ...}')
        if part.get("type") not in _PART_TYPES:
            raise invalid(
                f"{at}.type",
                f"must be input_text or output_text (only text is supported), "
                f"got {_show(part.get('type'))}",
            )
        if not isinstance(part.get("text"), str):
            raise invalid(f"{at}.text", f"must be a string, got {_show(part.get('text'))}")
        texts.append(part["text"])
    return "".join(texts)


def _required_string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{where}.{key}", f"is required (a string), got {_show(value)}")
    return value


def _messages(value: Any, instructions: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """`instructions` and `input` as chat messages, with the field each came from."""
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        origins.append("input")
        return messages, origins
    if not isinstance(value, list) or not value:
        raise invalid("input", "is required: a string or a non-empty array of input items")
    calls: dict[str, str] = {}  # call_id -> where its function_call item is
    previous_calls: list[dict[str, Any]] | None = None  # the last message's tool_calls, if last
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f"must be an object (an input item), got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in _ITEM_TYPES:
            raise invalid(
                f"{where}.type",
                f"must be one of {', '.join(_ITEM_TYPES)} (this server supports no other "
                f"item type), got {_show(kind)}",
            )
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid(
                    f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {_show(role)}"
                )
            text = _text(item.get("content"), where)
            # developer messages are system messages to a model without a developer role.
            messages.append({"role": "system" if role == "developer" else role, "content": text})
            origins.append(where)
            previous_calls = None
            if role == "assistant":
                previous_calls = messages[-1].setdefault("tool_calls", [])
            continue
        call_id = _required_string(item, "call_id", where)
        if kind == "function_call":
            name = _required_string(item, "name", where)
            arguments = _required_string(item, "arguments", where)
            if call_id in calls:
                raise invalid(f"{where}.call_id", f"repeats the call_id of {calls[call_id]}")
            calls[call_id] = where
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            if previous_calls is None:  # calls in a row are one assistant turn
                messages.append({"role": "assistant", "content": None, "tool_calls": []})
                origins.append(where)
                previous_calls = messages[-1]["tool_calls"]
            previous_calls.append(call)
            continue
        # function_call_output
        if call_id not in calls:
            raise invalid(
                f"{where}.call_id",
                f"{call_id!r} is the call_id of no function_call item before it in input "
                "(this server is stateless: send the call along with its output)",
            )
        output = item.get("output")
        if isinstance(output, list):  # input_text parts
            output = _text(output, where, "output")
        elif not isinstance(output, str):
            raise invalid(f"{where}.output", f"must be a string, got {_show(output)}")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        origins.append(where)
        previous_calls = None
    for m in messages:  # an assistant message without calls keeps no empty list
        if m.get("tool_calls") == []:
            del m["tool_calls"]
    return messages, origins


def _response_format(text: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`text` as chat's `response_format`, and the `text` the Response echoes."""
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise invalid("text", f'must be an object {{"format": ...}}, got {type(text).__name__}')
    fmt = text.get("format")
    echo = {k: v for k, v in text.items() if k == "verbosity"}
    if fmt is None:
        return None, {"format": {"type": "text"}, **echo}
    if not isinstance(fmt, dict):
        raise invalid("text.format", "must be an object with a `type`")
    kind = fmt.get("type")
    if kind == "text":
        return None, {"format": {"type": "text"}, **echo}
    if kind == "json_object":
        return {"type": "json_object"}, {"format": {"type": "json_object"}, **echo}
    if kind != "json_schema":
        raise invalid(
            "text.format.type", f"must be text, json_object or json_schema, got {_show(kind)}"
        )
    name = fmt.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("text.format.name", f"is required (a non-empty string), got {_show(name)}")
    if "schema" not in fmt:
        raise invalid("text.format.schema", "is required (a JSON schema)")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("text.format.strict", f"must be a boolean, got {_show(strict)}")
    description = fmt.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid("text.format.description", f"must be a string, got {_show(description)}")
    spec = {"name": name, "schema": fmt["schema"], "strict": strict}
    out = {"type": "json_schema", **spec, "strict": bool(strict)}
    if description is not None:
        out["description"] = description
    return {"type": "json_schema", "json_schema": spec}, {"format": out, **echo}


def _tools(value: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """The flat Responses function tools as chat's nested ones, and their echo."""
    if value is None:
        return None, []
    if not isinstance(value, list):
        raise invalid("tools", f"must be an array, got {type(value).__name__}")
    chat, echo = [], []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(where, 'must be an object {"type": "function", "name": ...}')
        if tool.get("type") != "function":
            raise invalid(
                f"{where}.type",
                f"must be 'function' (the only tool type this server runs), "
                f"got {_show(tool.get('type'))}",
            )
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"{where}.strict", f"must be a boolean, got {_show(strict)}")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        chat.append({"type": "function", "function": fn})
        echo.append(
            {
                "type": "function",
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": True if strict is None else strict,
            }
        )
    return chat, echo


def _tool_choice(value: Any) -> tuple[Any, Any]:
    """`tool_choice` in chat's shape, and its echo."""
    if value is None:
        return None, "auto"
    if value in ("none", "auto", "required"):
        return value, value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if isinstance(name, str):
            return {"type": "function", "function": {"name": name}}, {
                "type": "function",
                "name": name,
            }
    raise invalid(
        "tool_choice",
        f"must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"name\": ...}}, "
        f"got {_show(value)}",
    )


def translate(body: Any) -> Translation:
    """A Responses request body as a chat-completions body (400 naming the Responses field for
    anything malformed or unsupported)."""
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise invalid(
            "previous_response_id",
            "responses are not stored (stateless server); send the conversation in input",
        )
    if body.get("conversation") is not None:
        raise invalid(
            "conversation",
            "conversations are not stored (stateless server); send the conversation in input",
        )
    if body.get("prompt") is not None:
        raise invalid("prompt", "prompt templates are not supported; send instructions and input")
    for name in ("store", "background", "stream"):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise invalid(name, f"must be a boolean, got {_show(value)}")
    if body.get("background"):
        raise invalid("background", "background responses are not supported (stateless server)")
    truncation = body.get("truncation")
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise invalid("truncation", f"must be 'auto' or 'disabled', got {_show(truncation)}")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata", f"must be an object, got {type(metadata).__name__}")
    instructions = _string(body, "instructions")
    if "input" not in body:
        raise invalid("input", "is required: a string or an array of input items")
    messages, origins = _messages(body.get("input"), instructions)
    response_format, text_echo = _response_format(body.get("text"))
    tools, tools_echo = _tools(body.get("tools"))
    choice, choice_echo = _tool_choice(body.get("tool_choice"))
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if body.get(k) is not None}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if response_format is not None:
        chat["response_format"] = response_format
    if tools is not None:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "text": text_echo,
        "tool_choice": choice_echo,
        "tools": tools_echo,
        "truncation": truncation or "disabled",
        "user": body.get("user"),
        "store": bool(body.get("store", False)),
    }
    ignored = tuple(k for k in body if k not in RESPONSES_FIELDS)
    return Translation(chat, origins, echo, ignored, bool(body.get("stream")))


# -- the response ---------------------------------------------------------------------------
