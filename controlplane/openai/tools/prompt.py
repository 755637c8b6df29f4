"""The prompt: tools rendered into the model's template (its `tools` variable) or, for
templates without one, into the system message in the default Hermes / Qwen format."""

from __future__ import annotations

import re
from typing import Any

from controlplane.openai.tools.common import (
    CALL_CLOSE,
    CALL_OPEN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    _dumps,
    _loads,
)
from controlplane.openai.tools.request import Tool, ToolRequest

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
