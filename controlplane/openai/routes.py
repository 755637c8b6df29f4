"""The /v1 routes: completions, chat completions and models, each behind the API-key guard
(checked before the body is read, once), served by `serving.InferenceAPI`; vLLM's POST
/tokenize and /detokenize (controlplane.openai.tokenize) behind the same guard, and its GET
/version (no key, like /health)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath

from controlplane import __version__
from controlplane.http.body import openapi_body
from controlplane.http.errors import APIError
from controlplane.openai import schema
from controlplane.openai.render import model_list
from controlplane.openai.responses import ResponsesAPI
from controlplane.openai.responses_request import RESPONSES_SCHEMA
from controlplane.openai.serving import RATELIMIT_HEADERS, InferenceAPI
from controlplane.openai.tokenize import tokenize_routes

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

    from controlplane.runtime.runtime import Runtime


def ratelimit_headers(api: InferenceAPI) -> Any:
    """Middleware of the guarded routes: every response of a key with rate limits carries
    OpenAI's x-ratelimit-* headers (errors included): the ones its admission computed, else the
    key's counters as they stand (nothing taken)."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            async def send_with(message: Message) -> None:
                if message["type"] == "http.response.start":
                    state = scope.get("state") or {}
                    key = state.get("api_key")
                    extra = state.get(RATELIMIT_HEADERS)
                    if extra is None and key is not None:
                        extra = await api.limits.peek(key[0])
                    if extra:
                        have = {k.lower() for k, _ in message.get("headers", ())}
                        message["headers"] = [
                            *message.get("headers", ()),
                            *(
                                (k.encode("latin-1"), v.encode("latin-1"))
                                for k, v in extra.items()
                                if k.lower().encode("latin-1") not in have
                            ),
                        ]
                await send(message)

            await app(scope, receive, send_with)

        return wrapped

    return middleware


def v1_routes(runtime: Runtime) -> tuple[list[HTTPRouteHandler | Router], InferenceAPI]:
    """The /v1 route handlers over `runtime` (the guarded ones in one router, under the rate-
    limit headers' middleware), and the API serving them (whose `recently_finished` the admin
    API's abort reads)."""
    api = InferenceAPI(runtime)

    def api_key(connection: ASGIConnection, _: Any) -> None:
        """Guard of every /v1 route: the key is checked before the body is read, once."""
        connection.state.api_key = api.authenticate(connection)

    @post(
        "/v1/completions",
        status_code=200,
        summary="OpenAI completions",
        guards=[api_key],
        operation_class=openapi_body(schema.COMPLETION_SCHEMA),
    )
    async def completions(request: Request) -> Response:
        return await api.serve(request, api.completions)

    @post(
        "/v1/chat/completions",
        status_code=200,
        summary="OpenAI chat completions",
        guards=[api_key],
        operation_class=openapi_body(schema.CHAT_SCHEMA),
    )
    async def chat_completions(request: Request) -> Response:
        return await api.serve(request, api.chat)

    responses = ResponsesAPI(api)

    @post(
        "/v1/responses",
        status_code=200,
        summary="OpenAI Responses (stateless: nothing is stored)",
        guards=[api_key],
        operation_class=openapi_body(RESPONSES_SCHEMA),
    )
    async def create_response(request: Request) -> Response:
        return await api.serve(request, responses.create)

    @get("/v1/models", summary="Served models", guards=[api_key])
    async def models() -> dict[str, Any]:
        return model_list(runtime.model_name, runtime.started_at, runtime.engine.max_model_len)

    @get("/v1/models/{model:path}", summary="One served model", guards=[api_key])
    async def model(model: FromPath[str]) -> dict[str, Any]:
        model = model.removeprefix("/")  # ids may hold a "/" (org/name)
        listed = model_list(runtime.model_name, runtime.started_at, runtime.engine.max_model_len)
        found = [m for m in listed["data"] if m["id"] == model]
        if not found:
            raise APIError(
                404,
                f"The model '{model}' does not exist",
                param="model",
                code="model_not_found",
            )
        return found[0]

    @get("/version", summary="The server's version (vLLM's shape); no API key needed")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    tokenizer = tokenize_routes(api, [api_key])
    guarded = [completions, chat_completions, create_response, models, model, *tokenizer]
    router = Router("/", route_handlers=guarded, middleware=[ratelimit_headers(api)])
    return [router, version], api
