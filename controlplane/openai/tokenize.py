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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Request, get, post
from litestar.handlers import HTTPRouteHandler

from controlplane.http.body import load_json, openapi_body
from controlplane.http.errors import APIError, invalid, unavailable
from controlplane.openai import protocol
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
    if not rt.engine.loaded:
        raise unavailable(f"server is {rt.state}; retry later")
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


async def tokenize(api: InferenceAPI, request: Request) -> dict[str, Any]:
    raw = await request.body()
    body = _body(raw, api)
    engine = api.runtime.engine
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise invalid("prompt", "give either `prompt` (a string) or `messages` (a chat), not both")
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise invalid("prompt", f"must be a string, got {type(prompt).__name__}")
        special = _flag(body, "add_special_tokens", True)
        ids = await api._off_loop(len(prompt), engine.encode, prompt, special)
    else:
        messages = protocol.parse_messages(body)
        tools = parse_tools(body)
        generation = _flag(body, "add_generation_prompt", True)
        cont = _flag(body, "continue_final_message", False)
        if cont and generation:
            raise invalid(
                "continue_final_message",
                "cannot be true together with add_generation_prompt (true by default)",
            )
        ids = await api.chat_prompt(len(raw), messages, tools, generation, cont)
        if _flag(body, "add_special_tokens", False):  # on top of the template's own
            ids = [*engine.encode("", True), *ids]
    answer: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": engine.max_model_len,
        "tokens": ids,
    }
    if _flag(body, "return_token_strs", False):
        answer["token_strs"] = engine.token_strs(ids)
    return answer


async def detokenize(api: InferenceAPI, request: Request) -> dict[str, Any]:
    body = _body(await request.body(), api)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise invalid("tokens", "is required: an array of token ids")
    vocab = api.runtime.engine.vocab_size
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool):
            raise invalid("tokens", f"must be an array of token ids; tokens[{i}] is {t!r}")
        if not 0 <= t < vocab:
            raise invalid(
                "tokens",
                f"token ids must be in [0, {vocab}) (the model's vocabulary); tokens[{i}] is {t}",
            )
    prompt = await api._off_loop(len(tokens), api.runtime.engine.detokenize, tokens)
    return {"prompt": prompt}


def tokenize_routes(api: InferenceAPI, guards: list[Any]) -> list[HTTPRouteHandler]:
    """The two routes, behind `guards` (the /v1 API-key guard)."""

    @post(
        "/tokenize",
        status_code=200,
        summary="vLLM: a prompt's or a chat's token ids",
        guards=guards,
        operation_class=openapi_body(TOKENIZE_SCHEMA),
    )
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return await tokenize(api, request)

    @post(
        "/detokenize",
        status_code=200,
        summary="vLLM: the text of token ids",
        guards=guards,
        operation_class=openapi_body(DETOKENIZE_SCHEMA),
    )
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return await detokenize(api, request)

    @get("/tokenizer_info", summary="vLLM: the tokenizer's special tokens and chat template",
         guards=guards)  # fmt: skip
    async def tokenizer_info_route() -> dict[str, Any]:
        return api.runtime.engine.tokenizer_info()

    return [tokenize_route, detokenize_route, tokenizer_info_route]
