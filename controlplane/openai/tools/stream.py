"""Streaming: tool-call deltas (a header, then `function.arguments` pieces) as the output
comes, agreeing with the final parse."""

from __future__ import annotations

from typing import Any

from controlplane.openai.tools.auto import parse_auto
from controlplane.openai.tools.common import _JSON_WS, CALL_OPEN, PYTHON_TAG, new_call_id
from controlplane.openai.tools.forced import _CallArrayScanner
from controlplane.openai.tools.request import Tool, ToolRequest


def _header(index: int, name: str) -> dict[str, Any]:
    function = {"name": name, "arguments": ""}
    call = {"index": index, "id": new_call_id(), "type": "function", "function": function}
    return {"tool_calls": [call]}


def _arguments(index: int, piece: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}


def _content(text: str) -> dict[str, Any]:
    return {"content": text}


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
