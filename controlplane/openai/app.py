"""The /v1 routes: completions, chat completions and models, each behind the API-key guard
(checked before the body is read, once), served by `serving.InferenceAPI`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.handlers import HTTPRouteHandler

from controlplane.http.body import openapi_body
from controlplane.openai import schema
from controlplane.openai.render import model_list
from controlplane.openai.serving import InferenceAPI

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime


def v1_routes(runtime: Runtime) -> tuple[list[HTTPRouteHandler], InferenceAPI]:
    """The /v1 route handlers over `runtime`, and the API serving them (whose
    `recently_finished` the admin API's abort reads)."""
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

    @get("/v1/models", summary="Served models", guards=[api_key])
    async def models() -> dict[str, Any]:
        return model_list(runtime.model_name, runtime.started_at, runtime.engine.max_model_len)

    return [completions, chat_completions, models], api
