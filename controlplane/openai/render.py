"""Rendering /v1 responses: the OpenAI envelope of a choice or chunk, SSE framing, tool calls
as a message and as streamed chunks (and the legacy function_call form)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from controlplane.openai import protocol
from controlplane.openai.tools import (
    ToolCallStream,
    ToolRequest,
    parse_auto,
    parse_constrained,
)

if TYPE_CHECKING:
    from controlplane.engine import RequestOutput
    from controlplane.openai.flight import Batch


log = logging.getLogger("controlplane.api")


def sse(payload: dict[str, Any]) -> str:
    """One SSE `data:` payload; Litestar's ServerSentEvent does the framing."""
    return json.dumps(payload, separators=(",", ":"))


def envelope(
    batch: Batch, obj: str, created: int, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """The OpenAI response / chunk shape around choices (none: the usage-only last chunk)."""
    return {
        "id": batch.id,
        "object": obj,
        "created": created,
        "model": batch.model,
        "choices": choices,
        **extra,
    }


def structured_type(parsed: protocol.OpenAIRequest) -> str:
    """What constrained a request (its rows' `structured`, the metrics' `type` label)."""
    out = parsed.structured
    assert out is not None
    tools = parsed.tools if isinstance(parsed, protocol.ChatRequest) else None
    forced = tools is not None and tools.choice.mode in ("required", "named")
    return "tools" if forced else out.kind  # a forced call is the request's only constraint


def tool_message(text: str, tools: ToolRequest) -> tuple[dict[str, Any], str]:
    """A finished chat choice's message and finish reason when tools were offered: tool calls
    parsed from the text (constrained: always, unless cut short; auto: in the formats the
    README lists), or the text itself. Never raises: a malformed call is text."""
    if tools.choice.mode in ("named", "required"):
        calls = parse_constrained(text, tools) or []
        content = None
    else:
        content, calls = parse_auto(text, tools.tools)
    if not calls:
        return {"role": "assistant", "content": text}, "stop"
    if tools.legacy:  # `functions` asked: the deprecated shape, one call
        call = calls[0].to_openai()["function"]
        return {"role": "assistant", "content": content, "function_call": call}, "function_call"
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [c.to_openai() for c in calls],
    }
    return message, "tool_calls"


# tool_choice modes that constrain the output to the call (its grammar).
FORCED = ("required", "named")


def cut_tool_message(text: str, tools: ToolRequest) -> dict[str, Any]:
    """A forced call's message when max_tokens cut it (finish_reason stays "length"): the
    calls as far as they got, each with its partial `arguments`, exactly what streaming sent
    (the same scanner reads the text); no call yet (cut inside the first name): content null."""
    stream = ToolCallStream(tools, tools.tools)
    deltas = stream.feed(text) if text else []
    deltas += stream.finish()[0]
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for piece in delta.get("tool_calls", ()):
            fn = piece["function"]
            if "id" in piece:  # a call's header
                calls.append({"id": piece["id"], "type": "function", "function": dict(fn)})
            else:
                calls[piece["index"]]["function"]["arguments"] += fn["arguments"]
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if calls and tools.legacy:
        message["function_call"] = calls[0]["function"]
    elif calls:
        message["tool_calls"] = calls
    return message


def _legacy_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A tool-call delta in the deprecated `function_call` shape (one call: index 0)."""
    calls = delta.get("tool_calls")
    if not calls:
        return delta
    fn = calls[0]["function"]
    return {"function_call": {k: v for k, v in fn.items() if k in ("name", "arguments")}}


def tool_chunks(
    streams: dict[int, ToolCallStream],
    index: int,
    out: RequestOutput,
    tools: ToolRequest,
    logprobs: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """One output of a streamed chat choice with tools: its deltas in OpenAI's shape (tool-call
    headers, then argument pieces; or content)."""
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = ToolCallStream(tools, tools.tools)
    deltas = stream.feed(out.delta_text) if out.delta_text else []
    reason = None
    if out.finished:
        rest, called = stream.finish()
        deltas += rest
        called_reason = "function_call" if tools.legacy else "tool_calls"
        reason = called_reason if called and out.finish_reason == "stop" else out.finish_reason
    if tools.legacy:
        deltas = [_legacy_delta(d) for d in deltas]
    chunks = [{"delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if logprobs is not None and chunks:
        chunks[0]["logprobs"] = logprobs
    if out.finished:
        chunks.append({"delta": {}, "logprobs": None, "finish_reason": reason})
    return chunks


def model_list(name: str, created: float, max_model_len: int | None) -> dict[str, Any]:
    """GET /v1/models: the one served model (none while its name is unknown)."""
    data = []
    if name:
        data.append(
            {
                "id": name,
                "object": "model",
                "created": int(created),
                "owned_by": "controlplane",
                "max_model_len": max_model_len,
            }
        )
    return {"object": "list", "data": data}
