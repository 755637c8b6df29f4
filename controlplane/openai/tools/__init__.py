"""OpenAI tool calls, one module a phase: `request`, `prompt`, `forced`, `auto`, `stream` (and
`common`, what they share).

Pure Python (no torch, no engine): the /v1 parser reads a chat request's `tools` with
`parse_tools` and checks the conversation with `validate_history`; the /v1 surface renders it with
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

from controlplane.openai.tools.auto import parse_auto
from controlplane.openai.tools.common import MAX_TOOLS, ToolCall, new_call_id
from controlplane.openai.tools.forced import constrained_schema, parse_constrained
from controlplane.openai.tools.prompt import (
    call_block,
    default_system_prompt,
    has_tools_variable,
    render_messages,
)
from controlplane.openai.tools.request import (
    Tool,
    ToolChoice,
    ToolRequest,
    parse_tools,
    validate_history,
)
from controlplane.openai.tools.stream import ToolCallStream

__all__ = [
    "MAX_TOOLS",
    "Tool",
    "ToolCall",
    "ToolCallStream",
    "ToolChoice",
    "ToolRequest",
    "call_block",
    "constrained_schema",
    "default_system_prompt",
    "has_tools_variable",
    "new_call_id",
    "parse_auto",
    "parse_constrained",
    "parse_tools",
    "render_messages",
    "validate_history",
]
