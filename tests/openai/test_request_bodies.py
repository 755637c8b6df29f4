"""The typed structs' pass (controlplane.openai.bodies) against the hand parser: for every
body, valid or not, both give the same request or the same error (status, message, field);
the structs type each field as the hand parser checks it; ordinary bodies take the struct's
pass (so the comparison is not between the hand parser and itself)."""

from __future__ import annotations

import ast
import itertools
import json
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from controlplane.http.body import load_json
from controlplane.http.errors import APIError
from controlplane.openai import bodies, protocol

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ],
}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "Once upon a time"}
FULL_CHAT = {
    **CHAT,
    "max_tokens": 32,
    "temperature": 0.7,
    "top_p": 1,
    "top_k": 40,
    "min_p": 0.05,
    "seed": 7,
    "n": 2,
    "stop": ["\n\n"],
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "logprobs": True,
    "top_logprobs": 3,
    "presence_penalty": 0.5,
    "frequency_penalty": 0,
    "repetition_penalty": 1.1,
    "user": "u-1",
    "cache_salt": "s",
    "skip_special_tokens": False,
    "ignore_eos": False,
    "stop_token_ids": [2],
    "response_format": {"type": "json_object"},
    "metadata": {"a": "b"},
    "some_future_field": {"x": [1, 2, {"y": None}]},
}
FULL_COMPLETION = {
    **COMPLETION,
    "prompt": ["a", "b"],
    "max_tokens": 0,
    "echo": True,
    "logprobs": 2,
    "prompt_logprobs": 1,
    "best_of": 3,
    "n": 2,
    "temperature": 1,
    "guided_regex": "[a-z]+",
    "suffix": "",
    "unknown": 1,
}
TOOLS_CHAT = {
    **CHAT,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
}
# Values of every JSON kind, and the edge cases of each.
VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 2, 10**30, 1.0, 0.5, -0.0, "", "x", "16", [], ["x"], [1],
    [[1]], [""], {}, {"type": "text"}, {"include_usage": 1}, {"include_usage": True},
]  # fmt: skip


def _outcome(parse, body: Any) -> tuple[str, Any]:
    try:
        return "ok", parse(body)
    except APIError as exc:
        return "error", (exc.status, exc.message, exc.param)


def _same(raw: bytes, kind: type, parse) -> bool:
    """Both passes agree on `raw`; True when the struct's pass took it."""
    typed = bodies.decode(raw, kind)
    try:
        hand = _outcome(parse, load_json(raw))
    except APIError as exc:  # the JSON itself is refused: the struct's pass must refuse it too
        assert typed is None, raw
        hand = ("error", (exc.status, exc.message, exc.param))
    if typed is None:
        return False
    assert _outcome(parse, typed) == hand, raw
    return True


def _cases(base: dict[str, Any], fields: frozenset[str]) -> list[dict[str, Any]]:
    out = [base]
    for name in sorted(fields):
        out.extend({**base, name: v} for v in VALUES)
    # Two faults at once: the error named is the hand parser's first, not the document's.
    for a, b in itertools.combinations(["n", "temperature", "stream", "model", "user"], 2):
        out.append({**base, b: "bad", a: "bad"})
        out.append({**base, a: [], b: True})
    return out


@pytest.mark.parametrize(
    ("kind", "parse", "base"),
    [
        (bodies.ChatBody, protocol.parse_chat, CHAT),
        (bodies.ChatBody, protocol.parse_chat, FULL_CHAT),
        (bodies.ChatBody, protocol.parse_chat, TOOLS_CHAT),
        (bodies.CompletionBody, protocol.parse_completion, COMPLETION),
        (bodies.CompletionBody, protocol.parse_completion, FULL_COMPLETION),
    ],
)
def test_the_struct_pass_and_the_hand_parser_agree(kind, parse, base):
    fields = frozenset(f for f in kind.__struct_fields__)
    typed = sum(_same(json.dumps(b).encode(), kind, parse) for b in _cases(base, fields))
    # The struct's pass took the valid bodies and every well-typed variation.
    assert _same(json.dumps(base).encode(), kind, parse)
    assert typed > len(fields)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": "\\udc00"}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": NaN}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": '
        + b"9" * 5000
        + b"}",
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": '
        + b"[" * 40
        + b"]" * 40
        + b"}",
        b'{"model": "m", "messages": [{"role": "user", "content": "hi", "deep": '
        + b"[" * 31
        + b"]" * 31
        + b"}]}",
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1, "n": "2"}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
        b"[1, 2]",
        b'"text"',
        b"",
        b"\xff",
        b'{"model": "m"} trailing',
    ],
)
def test_hostile_bodies_get_the_hand_parsers_error(raw):
    assert not _same(raw, bodies.ChatBody, protocol.parse_chat)


def test_nesting_just_under_the_limit_takes_the_struct_pass():
    deep = {**CHAT, "x": json.loads("[" * 31 + "]" * 31)}
    assert _same(json.dumps(deep).encode(), bodies.ChatBody, protocol.parse_chat)
    deeper = {**CHAT, "x": json.loads("[" * 32 + "]" * 32)}
    assert not _same(json.dumps(deeper).encode(), bodies.ChatBody, protocol.parse_chat)


# What `_opt(body, name, types, ...)` checks, as the struct must type it.
_STRUCT_TYPE = {
    ("int",): int | None,
    ("bool",): bool | None,
    ("str",): str | None,
    ("dict",): dict[str, Any] | None,
    ("list",): list[Any] | None,
    ("int", "float"): float | None,
}


def _opt_calls() -> dict[str, set[tuple[str, ...]]]:
    """Every field protocol.py reads with `_opt`, and the types it checks (the names of its
    `num` tuple resolved)."""
    tree = ast.parse(Path(protocol.__file__).read_text())
    found: dict[str, set[tuple[str, ...]]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_opt"):
            continue
        name, types = node.args[1], node.args[2]
        if not isinstance(name, ast.Constant):
            continue
        if isinstance(types, ast.Name) and types.id == "num":
            names = ("int", "float")
        else:
            names = tuple(e.id for e in types.elts)
        found.setdefault(name.value, set()).add(names)
    return found


def test_every_field_the_hand_parser_type_checks_is_typed_the_same_in_its_structs():
    calls = _opt_calls()
    assert {"n", "temperature", "stream", "max_tokens", "logprobs", "user"} <= set(calls)
    for kind in (bodies.ChatBody, bodies.CompletionBody):
        hints = typing.get_type_hints(kind)
        for name, checks in calls.items():
            if name not in hints:
                continue
            # `logprobs` is an integer in completions and a boolean in chat: the struct's
            # type must be one of the parser's checks for the field, never wider.
            assert hints[name] in {_STRUCT_TYPE[c] for c in checks}, (kind.__name__, name)


def test_the_structs_refuse_numbers_as_strings_and_booleans_as_numbers():
    chat = msgspec.json.Decoder(bodies.ChatBody)
    for field, value in [("n", "2"), ("n", True), ("temperature", "0.5"), ("temperature", False)]:
        with pytest.raises(msgspec.ValidationError):
            chat.decode(json.dumps({**CHAT, field: value}).encode())


def test_each_struct_declares_every_field_its_endpoint_reads():
    # A field read but missing from its struct would reach the parser untyped on the
    # struct's pass (its `_opt` skips the type check there).
    from controlplane.openai import schema

    assert set(bodies.ChatBody.__struct_fields__) == schema.CHAT_FIELDS
    assert set(bodies.CompletionBody.__struct_fields__) == schema.COMPLETION_FIELDS
