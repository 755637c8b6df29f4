"""POST /v1/responses: OpenAI's Responses API, stateless, served by the chat-completions
machinery.

A request is translated into a chat-completions body (`responses_request.translate`):
`instructions` becomes a first system message, `input` messages become chat messages,
`function_call` / `function_call_output` items become an assistant message's `tool_calls` and
`tool` messages, `text.format` becomes `response_format`, the flat function tools become chat's
nested ones and `max_output_tokens` becomes `max_completion_tokens`. That body goes through the
chat parser (`protocol.parse_chat`: sampling, structured outputs, tools), the chat prompt (the
model's chat template), admission and the engine exactly as /v1/chat/completions does, with one
SQL row per response (endpoint "responses", priced like every other row). The output is rendered
as a Response object, or streamed as the Responses API's typed Server-Sent Events.

Nothing is stored: `store: true` is accepted and changes nothing, `previous_response_id` and
`conversation` are 400s (the conversation goes in `input`). Every 400 names the Responses field
(`input[2].type`, `text.format.schema`, `tools[0].parameters`, `max_output_tokens`), also when
the chat machinery found the fault.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from litestar import Request, Response
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from controlplane.http.body import load_json
from controlplane.http.errors import APIError
from controlplane.openai import protocol
from controlplane.openai.flight import EngineFailure
from controlplane.openai.render import FORCED, cut_tool_message, tool_message
from controlplane.openai.responses_request import hex_id, translate
from controlplane.openai.tools import ToolCallStream

if TYPE_CHECKING:
    from controlplane.engine import RequestOutput
    from controlplane.openai.flight import Batch
    from controlplane.openai.serving import InferenceAPI


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    inp, out = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    return {
        "input_tokens": inp,
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + out,
    }


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or hex_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": hex_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass(slots=True)
class _Shell:
    """The Response object around the output: id, times, the echoed request fields."""

    id: str
    model: str
    created_at: int
    echo: dict[str, Any]

    def render(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        echo = {k: v for k, v in self.echo.items() if k != "store"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": protocol.now() if status == "completed" else None,
            "background": False,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "model": self.model,
            "output": output,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "default",
            "store": self.echo["store"],
            **echo,
            "usage": usage,
        }


def _status(reason: str | None) -> str:
    """The Response's status for the output's finish reason: cut by max_output_tokens (or the
    context) is incomplete, aborted (by an operator, or the daemon's shutdown) cancelled."""
    return {"length": "incomplete", "abort": "cancelled", "shutdown": "cancelled"}.get(
        reason, "completed"
    )


def _item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"


def _final_output(
    text: str, reason: str | None, parsed: protocol.ChatRequest
) -> list[dict[str, Any]]:
    """A finished response's output items: the text as a message, and the tool calls parsed
    from it as chat parses them (`tool_message`, `cut_tool_message`)."""
    tools = parsed.tools
    status = _item_status(_status(reason))
    message: dict[str, Any] = {"content": text}
    if tools is not None and tools.choice.mode != "none" and reason == "stop":
        message, _ = tool_message(text, tools)
    elif tools is not None and reason == "length" and tools.choice.mode in FORCED:
        message = cut_tool_message(text, tools)
    output = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append(_message_item(message.get("content") or "", status))
    for call in calls:
        fn = call["function"]
        output.append(_call_item(call["id"], fn["name"], fn["arguments"], status))
    return output


@dataclass(slots=True)
class _EventWriter:
    """The Responses stream's events, numbered, as output items open, grow and close."""

    shell: _Shell
    seq: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)
    open_message: dict[str, Any] | None = None  # the message item taking text, if any
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # chat call index -> item
    closed: set[int] = field(default_factory=set)  # output indices done

    def event(self, kind: str, **fields: Any) -> ServerSentEventMessage:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ServerSentEventMessage(data=json.dumps(payload, separators=(",", ":")), event=kind)

    def lifecycle(self, kind: str, status: str, **extra: Any) -> ServerSentEventMessage:
        return self.event(kind, response=self.shell.render(status, self.output, **extra))

    def _add(self, item: dict[str, Any]) -> list[ServerSentEventMessage]:
        self.output.append(item)
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        return [
            self.event("response.output_item.added", output_index=len(self.output) - 1, item=added)
        ]

    def text(self, piece: str) -> list[ServerSentEventMessage]:
        out = []
        if self.open_message is None:
            self.open_message = _message_item("", "in_progress")
            out += self._add(self.open_message)
            out.append(self._part_event("response.content_part.added", _text_part("")))
        if not piece:
            return out
        part = self.open_message["content"][0]
        part["text"] += piece
        index = self.output.index(self.open_message)
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.open_message["id"],
                output_index=index,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        )
        return out

    def _part_event(self, kind: str, part: dict[str, Any]) -> ServerSentEventMessage:
        assert self.open_message is not None
        index = self.output.index(self.open_message)
        return self.event(
            kind, item_id=self.open_message["id"], output_index=index, content_index=0, part=part
        )

    def close_message(self, status: str) -> list[ServerSentEventMessage]:
        message = self.open_message
        if message is None:
            return []
        index = self.output.index(message)
        part = message["content"][0]
        out = [
            self.event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self._part_event("response.content_part.done", part),
        ]
        message["status"] = status
        out.append(self.event("response.output_item.done", output_index=index, item=message))
        self.open_message = None
        self.closed.add(index)
        return out

    def call(self, index: int, call_id: str, name: str) -> list[ServerSentEventMessage]:
        out = self.close_message("completed")  # text before a call is done
        item = self.calls[index] = _call_item(call_id, name, "", "in_progress")
        return out + self._add(item)

    def arguments(self, index: int, piece: str) -> list[ServerSentEventMessage]:
        item = self.calls[index]
        item["arguments"] += piece
        return [
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self.output.index(item),
                delta=piece,
            )
        ]

    def chat_delta(self, delta: dict[str, Any]) -> list[ServerSentEventMessage]:
        """One chat streaming delta (ToolCallStream's shape) as Responses events."""
        out = []
        if delta.get("content"):
            out += self.text(delta["content"])
        for piece in delta.get("tool_calls") or ():
            fn = piece["function"]
            if "id" in piece:
                out += self.call(piece["index"], piece["id"], fn["name"])
            if fn.get("arguments"):
                out += self.arguments(piece["index"], fn["arguments"])
        return out

    def finish(self, status: str) -> list[ServerSentEventMessage]:
        """Close every item still open (an output with none gets an empty message)."""
        out = [] if self.output else self.text("")
        out += self.close_message(status)
        for item in self.calls.values():
            index = self.output.index(item)
            if index in self.closed:
                continue
            item["status"] = status
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
            out.append(self.event("response.output_item.done", output_index=index, item=item))
            self.closed.add(index)
        return out


class ResponsesAPI:
    """POST /v1/responses over an InferenceAPI (its admission, prompt, grammar and engine)."""

    def __init__(self, api: InferenceAPI) -> None:
        self.api = api

    async def create(self, request: Request) -> Response:
        api = self.api
        api._check_request_id(request)
        raw = await request.body()
        tr = translate(load_json(raw))
        api._note_ignored(tr.ignored)
        try:
            parsed = protocol.parse_chat(tr.chat)
            structured = parsed.params.structured
            if structured is not None:  # grammar errors name the Responses field
                renamed = replace(structured, field=tr.field(structured.field))
                parsed.params = replace(parsed.params, structured=renamed)
            api._admit(request, parsed.model)
            prompt_ids = await api.chat_prompt(len(raw), parsed.messages, parsed.tools)
            grammar = await api._grammar(parsed)
            keys = api._admit(request, parsed.model)
            api._admit_budget(request)
            await api._admit_limits(request, parsed, [prompt_ids])
            batch = api._start(request, parsed, [prompt_ids], "responses", keys, grammar)
        except APIError as exc:
            raise tr.renamed(exc) from None
        shell = _Shell(batch.id, batch.model, protocol.now(), tr.echo)
        if tr.stream:
            return self._stream(parsed, batch, shell)
        last: RequestOutput | None = None
        try:
            async for _, out in batch:
                last = out
        except EngineFailure as exc:
            raise exc.error from None
        finally:
            batch.abort()  # the handler was cancelled: the request goes with it
        reason = None if last is None else last.finish_reason
        status = _status(reason)
        output = _final_output("" if last is None else last.text, reason, parsed)
        return Response(shell.render(status, output, _usage(batch.usage())))

    def _stream(self, parsed: protocol.ChatRequest, batch: Batch, shell: _Shell) -> Response:
        tools = parsed.tools
        calling = tools is not None and tools.choice.mode != "none"
        writer = _EventWriter(shell)

        async def events() -> AsyncIterator[ServerSentEventMessage]:
            try:
                yield writer.lifecycle("response.created", "in_progress")
                yield writer.lifecycle("response.in_progress", "in_progress")
                stream = ToolCallStream(tools, tools.tools) if calling and tools else None
                reason = None
                async for _, out in batch:
                    deltas = []
                    if stream is None:
                        deltas = [{"content": out.delta_text}] if out.delta_text else []
                    elif out.delta_text:
                        deltas = stream.feed(out.delta_text)
                    if out.finished:
                        reason = out.finish_reason
                        if stream is not None:
                            deltas += stream.finish()[0]
                    for delta in deltas:
                        for event in writer.chat_delta(delta):
                            yield event
                status = _status(reason)
                for event in writer.finish(_item_status(status)):
                    yield event
                # Cut short or cancelled: response.incomplete (there is no cancelled event).
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield writer.lifecycle(kind, status, usage=_usage(batch.usage()))
            except EngineFailure as exc:  # say so in-band, then stop
                error = exc.error
                yield writer.event(
                    "error", code=error.code, message=error.message, param=error.param
                )
                failure = {"code": "server_error", "message": error.message}
                if error.status < 500:
                    failure["code"] = "invalid_prompt"
                yield writer.lifecycle(
                    "response.failed", "failed", usage=_usage(batch.usage()), error=failure
                )
            finally:
                batch.abort()  # a body that stops early aborts; after the end, a no-op

        return ServerSentEvent(events(), headers={"Cache-Control": "no-cache"})
