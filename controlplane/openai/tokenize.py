"""vLLM's tokenizer endpoints, `POST /tokenize` and `POST /detokenize`, in its request and
response shapes, behind the /v1 API-key guard.

- tokenize: `{"model"?, "prompt", "add_special_tokens"?: true, "return_token_strs"?: false}`,
  or `{"model"?, "messages", "add_generation_prompt"?: true, "continue_final_message"?: false,
  "add_special_tokens"?: false, "tools"?, "return_token_strs"?: false}`: the messages go through
  the very path /v1/chat/completions renders them by (`InferenceAPI.chat_prompt`), so `count`
  is the `prompt_tokens` a chat completion of the same messages reports. Answers `{"count",
  "max_model_len", "tokens"}` (and `"token_strs"`, the vocabulary's strings, when asked).
- detokenize: `{"model"?, "tokens"}` -> `{"prompt"}` (special tokens included, as vLLM).
- `GET /tokenizer_info`: the special tokens' text (`eos_token`, `bos_token`, `pad_token`... as
  the model's tokenizer config names them), `chat_template`, `model_max_length`: with the two
  above, what a client needs to tokenize through the server (lm-evaluation-harness's
  `tokenizer_backend=remote` runs with no local tokenizer and no model hub).

Neither is a generation request: nothing is queued, counted in the traffic or recorded.

Their input has a bound of its own, tied to the model's context (`input_limit`): tokenizing
costs many times the body in memory (the token ids, their strings, the tokenizer's own
encoding; docs/benchmarks.md has the figures), and the body limit an operator raises for long
prompts must not let one request take gigabytes. A `prompt` longer than the limit in
characters, a `tokens` list longer than it in ids, or a `messages` body longer than it in bytes
is a 400 naming the field and the limit, before anything is tokenized. Parsing, tokenizing and
the answer's JSON run in a worker thread once the input is large (as a prompt's tokenization
does), and a large one arms the idle memory trim (controlplane.memory), as an engine
request does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from litestar import MediaType, Request, Response, get, post
from litestar.handlers import HTTPRouteHandler

from controlplane import memory
from controlplane.http.body import load_json, openapi_body
from controlplane.http.errors import APIError, invalid, unavailable
from controlplane.openai import protocol
from controlplane.openai.serving import OFF_LOOP_CHARS
from controlplane.openai.tools import parse_tools

if TYPE_CHECKING:
    from controlplane.openai.serving import InferenceAPI

TOKENIZE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "vLLM's tokenize request: `prompt` (text) or `messages` (a chat)",
    "properties": {
        "model": {"type": "string", "description": "the served model's id (optional)"},
        "prompt": {"type": "string"},
        "messages": {"type": "array", "items": {"type": "object"}},
        "add_special_tokens": {"type": "boolean"},
        "add_generation_prompt": {"type": "boolean"},
        "continue_final_message": {"type": "boolean"},
        "return_token_strs": {"type": "boolean"},
        "tools": {"type": "array", "items": {"type": "object"}},
    },
}
DETOKENIZE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["tokens"],
    "properties": {
        "model": {"type": "string", "description": "the served model's id (optional)"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
    },
}


# The input limit per token of the context window (max_model_len): room to count or split a
# text several contexts long (English runs about 4 characters a token), not an unbounded one.
LIMIT_PER_CONTEXT_TOKEN = 16
# Bytes of JSON one character or token id of the input can take (a character escaped as a
# UTF-16 surrogate pair `\\ud83d\\ude00`; an id of 10 digits and `, `), and room for the other
# fields: a body larger than this cannot hold an admitted input, and is refused unparsed.
_JSON_BYTES_PER_UNIT = 12
_JSON_OTHER_FIELDS = 64 * 1024


def input_limit(max_model_len: int) -> int:
    """The most characters of `prompt`, ids of `tokens` or bytes of a `messages` body that
    /tokenize and /detokenize take."""
    return LIMIT_PER_CONTEXT_TOKEN * max_model_len


def _limit_text(max_model_len: int) -> str:
    limit = input_limit(max_model_len)
    return f"{limit} ({LIMIT_PER_CONTEXT_TOKEN} x max_model_len {max_model_len})"


def _check_size(raw: bytes, api: InferenceAPI) -> None:
    """Refuse, unparsed, a body too large to hold an admitted input."""
    memory.note_body(len(raw))  # refused unparsed or not
    mml = api.runtime.engine.max_model_len
    cap = _JSON_BYTES_PER_UNIT * input_limit(mml) + _JSON_OTHER_FIELDS
    if len(raw) > cap:
        raise invalid(
            "body",
            f"is {len(raw)} bytes, more than any admitted input takes ({cap}): "
            f"/tokenize and /detokenize read at most {_limit_text(mml)} characters or token ids",
        )


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"must be a boolean, got {type(value).__name__}")
    return value


def _body(raw: bytes, api: InferenceAPI) -> dict[str, Any]:
    """The JSON object, its model checked (optional, as in vLLM: the served one)."""
    body = load_json(raw)
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    rt = api.runtime
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "must be a string (see GET /v1/models)")
    if model and model != rt.model_name:
        raise APIError(
            404,
            f"the model `{model}` does not exist; this server serves `{rt.model_name}`",
            param="model",
            code="model_not_found",
        )
    return body


async def _parsed(raw: bytes, api: InferenceAPI) -> dict[str, Any]:
    """The body, parsed in a worker thread when it is large (a long token list takes seconds
    to walk)."""
    rt = api.runtime
    if not rt.engine.loaded:
        raise unavailable(f"server is {rt.state}; retry later")
    _check_size(raw, api)
    return await api._off_loop(len(raw), _body, raw, api)


def _json(answer: dict[str, Any]) -> Response[bytes]:
    return Response(msgspec.json.encode(answer), media_type=MediaType.JSON)


async def tokenize(api: InferenceAPI, request: Request) -> Response[bytes]:
    raw = await request.body()
    body = await _parsed(raw, api)
    engine = api.runtime.engine
    mml = engine.max_model_len
    limit = input_limit(mml)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise invalid("prompt", "give either `prompt` (a string) or `messages` (a chat), not both")
    strs = _flag(body, "return_token_strs", False)
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise invalid("prompt", f"must be a string, got {type(prompt).__name__}")
        if len(prompt) > limit:
            raise invalid(
                "prompt",
                f"is {len(prompt)} characters; /tokenize takes at most {_limit_text(mml)}",
            )
        special = _flag(body, "add_special_tokens", True)
        size = len(prompt)

        def ids_of() -> list[int]:
            return engine.encode(prompt, special)

    else:
        if len(raw) > limit:
            raise invalid(
                "messages",
                f"the body is {len(raw)} bytes; /tokenize takes a chat of at most "
                f"{_limit_text(mml)} bytes",
            )
        messages = protocol.parse_messages(body)
        tools = parse_tools(body)
        generation = _flag(body, "add_generation_prompt", True)
        cont = _flag(body, "continue_final_message", False)
        if cont and generation:
            raise invalid(
                "continue_final_message",
                "cannot be true together with add_generation_prompt (true by default)",
            )
        chat = await api.chat_prompt(len(raw), messages, tools, generation, cont)
        if _flag(body, "add_special_tokens", False):  # on top of the template's own
            chat = [*engine.encode("", True), *chat]
        size = len(raw)

        def ids_of() -> list[int]:
            return chat

    def answer() -> Response[bytes]:
        # In one worker call: the ids, their strings and the JSON text (the ids as a Python
        # list take 36 bytes each; the answer is built and dropped here, not on the loop).
        ids = ids_of()
        out: dict[str, Any] = {"count": len(ids), "max_model_len": mml, "tokens": ids}
        if strs:
            out["token_strs"] = engine.token_strs(ids)
        return _json(out)

    try:
        return await api._off_loop(size, answer)
    finally:
        _note(size)


async def detokenize(api: InferenceAPI, request: Request) -> Response[bytes]:
    raw = await request.body()
    body = await _parsed(raw, api)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise invalid("tokens", "is required: an array of token ids")
    engine = api.runtime.engine
    mml = engine.max_model_len
    if len(tokens) > input_limit(mml):
        raise invalid(
            "tokens", f"has {len(tokens)} ids; /detokenize takes at most {_limit_text(mml)}"
        )
    vocab = engine.vocab_size

    def text() -> Response[bytes]:
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or isinstance(t, bool):
                raise invalid("tokens", f"must be an array of token ids; tokens[{i}] is {t!r}")
            if not 0 <= t < vocab:
                raise invalid(
                    "tokens",
                    f"token ids must be in [0, {vocab}) (the model's vocabulary); "
                    f"tokens[{i}] is {t}",
                )
        return _json({"prompt": engine.detokenize(tokens)})

    try:
        return await api._off_loop(len(tokens), text)
    finally:
        _note(len(tokens))


def _note(size: int) -> None:
    """A large input leaves freed C heap behind (the tokenizer's encoding, the lists): the
    idle trim gives it back, as after engine work."""
    if size >= OFF_LOOP_CHARS:
        memory.note_large_work()


def tokenize_routes(api: InferenceAPI, guards: list[Any]) -> list[HTTPRouteHandler]:
    """The two routes, behind `guards` (the /v1 API-key guard)."""

    @post(
        "/tokenize",
        status_code=200,
        summary="vLLM: a prompt's or a chat's token ids",
        guards=guards,
        operation_class=openapi_body(TOKENIZE_SCHEMA),
    )
    async def tokenize_route(request: Request) -> Response[bytes]:
        return await tokenize(api, request)

    @post(
        "/detokenize",
        status_code=200,
        summary="vLLM: the text of token ids",
        guards=guards,
        operation_class=openapi_body(DETOKENIZE_SCHEMA),
    )
    async def detokenize_route(request: Request) -> Response[bytes]:
        return await detokenize(api, request)

    @get("/tokenizer_info", summary="vLLM: the tokenizer's special tokens and chat template",
         guards=guards)  # fmt: skip
    async def tokenizer_info_route() -> dict[str, Any]:
        return api.runtime.engine.tokenizer_info()

    return [tokenize_route, detokenize_route, tokenizer_info_route]
