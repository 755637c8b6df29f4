"""The /v1 request bodies as typed structs (msgspec), decoded and type-checked in one native
pass; controlplane.openai.protocol reads the result.

Why not Litestar's own `data:` injection: Litestar 2 converts request data with msgspec's lax
mode (strict=False), which takes "16" for an integer; the API refuses numbers as strings and
booleans as numbers. So the handler reads the body after its guard (the API key is checked
before the body is read) and decodes it here, strictly.

What msgspec cannot say the way the API does, the hand parser (protocol) still says:
- every error: msgspec's read `Expected int | null, got str - at $.n` and come in document
  order; the API's name the field and its bounds OpenAI's way (`n: must be an integer, got
  str`), in the parser's order. A body msgspec refuses is parsed again by the hand parser,
  which finds the same fault and words it as before (refused bodies only: a rare path).
- the unions and rules across fields: `prompt` (a string, token ids, or a list of either, all
  of one kind), `stop`, `messages` and their content parts, the output constraints (at most
  one), the tools, best_of against n, stream_options only with stream;
- the JSON limit on nesting (MAX_JSON_DEPTH), which msgspec does not bound: checked here on
  the decoded body, the fields this endpoint does not read included (tolerated, then reported
  as ignored by the parser).

Each field's type here must match the type the hand parser checks it against (`_opt` in
protocol): tests/openai/test_request_bodies.py holds them together, so that this pass never
accepts a value the hand parser would refuse.
"""

from __future__ import annotations

from typing import Any

import msgspec

from controlplane import memory
from controlplane.http.body import MAX_JSON_DEPTH

# A value the struct leaves to the hand parser (its shape is a union or a nested schema).
Free = Any


class _Common(msgspec.Struct, kw_only=True):
    """Fields both endpoints read. null is absent, as the hand parser reads it."""

    model: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: str | None = None
    # sampling
    stop: str | list[str] | None = None
    n: int | None = None
    logit_bias: Free = None
    stop_token_ids: list[Any] | None = None
    temperature: float | None = None  # msgspec's float takes integers too, never booleans
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    priority: int | None = None  # vLLM: lower runs sooner (engine.scheduling_policy)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    # output constraints
    response_format: Free = None
    guided_json: Free = None
    guided_regex: Free = None
    guided_choice: Free = None
    guided_grammar: Free = None
    guided_decoding_backend: Free = None
    structured_outputs: Free = None


class CompletionBody(_Common, kw_only=True):
    """POST /v1/completions."""

    prompt: Free = None
    echo: bool | None = None
    suffix: Free = None
    max_tokens: int | None = None
    logprobs: int | None = None  # top N (chat's is a boolean)
    best_of: int | None = None


class ChatBody(_Common, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[Any] | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Free = None
    functions: Free = None
    tool_choice: Free = None
    function_call: Free = None
    parallel_tool_calls: Free = None
    metadata: Free = None
    modalities: Free = None
    service_tier: Free = None
    store: Free = None


class Checked(dict):
    """A body whose read fields msgspec has type-checked against its struct: the hand
    parser's `_opt` skips their type checks (the rules across fields still run)."""

    __slots__ = ()


_JSON = msgspec.json.Decoder()


def decode(raw: bytes, kind: type[CompletionBody] | type[ChatBody]) -> Checked | None:
    """The body of `raw`, its read fields type-checked against `kind`, or None when anything
    is amiss (malformed or hostile JSON, a wrong type, too deep): the hand parser then reads
    the body from scratch and names the fault as it always has.

    The struct validates; the parser reads the decoded object it validated (its rules
    across fields are shared with /v1/responses, whose translated bodies are objects)."""
    memory.note_body(len(raw))  # its parse leaves freed heap: arm the idle trim
    try:
        # msgspec refuses what the hand parser's load_json would (lone surrogates, invalid
        # UTF-8, integers too long to convert) and some it accepts (NaN, 1e400): either way
        # the hand parser decides.
        body = _JSON.decode(raw)
        if type(body) is not dict:
            return None
        msgspec.convert(body, kind)  # strict: no numbers as strings, no booleans as numbers
    except (msgspec.MsgspecError, ValueError, RecursionError):
        # ValueError: UnicodeDecodeError for invalid UTF-8 in a key
        return None
    if _too_deep(raw, body):
        return None
    return Checked(body)


def _too_deep(raw: bytes, body: dict[str, Any]) -> bool:
    """Whether a container sits MAX_JSON_DEPTH levels deep (the body is level 0), as
    http.body.check_json counts; strings need no check here (msgspec refuses lone
    surrogates). A body with fewer brackets than that cannot be (most bodies: skip the walk)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return False
    level = [v for v in body.values() if type(v) is dict or type(v) is list]
    depth = 1
    while level:
        if depth >= MAX_JSON_DEPTH:
            return True
        deeper: list[Any] = []
        for value in level:
            children = value.values() if type(value) is dict else value
            deeper.extend([v for v in children if type(v) is dict or type(v) is list])
        level, depth = deeper, depth + 1
    return False
