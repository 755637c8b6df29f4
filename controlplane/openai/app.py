"""The Litestar app: the /v1 routes, /health probes and the X-Request-Id hook, with the admin
router mounted (the daemon's whole HTTP surface)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException

from controlplane.http.body import openapi_body
from controlplane.http.errors import (
    APIError,
    body_too_large,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
)
from controlplane.http.request_id import request_id
from controlplane.openai import schema

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime


from controlplane.openai.render import model_list
from controlplane.openai.serving import InferenceAPI

log = logging.getLogger("controlplane.api")


def create_app(runtime: Runtime) -> Litestar:
    """The HTTP app over `runtime` (its only view of the daemon and the engine)."""
    api = InferenceAPI(runtime)
    max_body = runtime.cfg.server.max_body_bytes

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
        return await api.completions(request)

    @post(
        "/v1/chat/completions",
        status_code=200,
        summary="OpenAI chat completions",
        guards=[api_key],
        operation_class=openapi_body(schema.CHAT_SCHEMA),
    )
    async def chat_completions(request: Request) -> Response:
        return await api.chat(request)

    @get("/v1/models", summary="Served models", guards=[api_key])
    async def models() -> dict[str, Any]:
        return model_list(runtime.model_name, runtime.started_at, runtime.engine.max_model_len)

    @get("/health", summary="Readiness: 200 only while the engine is loaded and stepping")
    async def health() -> Response:
        d = runtime
        body = {
            "status": d.reported_state,
            "model": d.model_name or None,
            "uptime_s": round(time.time() - d.started_at, 3),
        }
        return Response(body, status_code=200 if d.healthy else 503)

    # Probes for orchestrators (deploy/kubernetes.yaml). Liveness fails only when restarting
    # helps (the step loop died); readiness fails whenever requests would get 503.
    @get("/health/live", summary="Liveness: 200 while the step loop runs (or the model loads)")
    async def health_live() -> Response:
        alive = runtime.alive
        body = {"status": "alive" if alive else "dead", "state": runtime.state}
        return Response(body, status_code=200 if alive else 503)

    @get("/health/ready", summary="Readiness: 200 only when loaded and admitting requests")
    async def health_ready() -> Response:
        d = runtime
        body = {"status": d.reported_state}
        return Response(body, status_code=200 if d.healthy else 503)

    from controlplane.admin.routes import admin_router, metrics_handler

    async def add_request_id(message: Any, scope: Any) -> None:
        """Every /v1 response carries X-Request-Id (errors and unknown routes included): the
        client's, or the one generated for the request (see controlplane.http.request_id)."""
        if message["type"] == "http.response.start" and scope.get("path", "").startswith("/v1/"):
            value = request_id(scope).value.encode("ascii")
            message["headers"] = [*message.get("headers", ()), (b"x-request-id", value)]

    return Litestar(
        route_handlers=[
            completions,
            chat_completions,
            models,
            health,
            health_live,
            health_ready,
            admin_router(runtime, finished=api.recently_finished.get),
            metrics_handler(runtime),
        ],
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: handle_http_exception,
            413: lambda request, _: handle_api_error(request, body_too_large(max_body)),
            Exception: handle_unexpected,
        },
        request_max_body_size=max_body,
        before_send=[add_request_id],
        debug=False,
        logging_config=None,  # the daemon configured logging (text or JSON); keep it
    )
