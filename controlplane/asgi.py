"""The daemon's whole HTTP surface as one Litestar app: the /v1 routes (controlplane.openai),
the /admin and /metrics routes (controlplane.admin), the health probes, the X-Request-Id hook
and the error handlers every route shares. Built by the daemon, over its runtime."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from litestar import Litestar, Response, get
from litestar.exceptions import HTTPException

from controlplane.admin.routes import admin_router, metrics_handler
from controlplane.http.errors import (
    APIError,
    body_too_large,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
)
from controlplane.http.request_id import request_id
from controlplane.openai.routes import v1_routes
from controlplane.telemetry.http import HttpMetricsMiddleware

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime


def _health_body(runtime: Runtime, **fields: Any) -> dict[str, Any]:
    """A probe's answer; with the cause (`error`) once the step loop has died."""
    if (death := runtime.engine.death) is not None:
        fields["error"] = death
    return fields


def create_app(runtime: Runtime) -> Litestar:
    """The HTTP app over `runtime` (its only view of the daemon and the engine)."""
    max_body = runtime.cfg.server.max_body_bytes
    v1, api = v1_routes(runtime)

    @get("/health", summary="Readiness: 200 only while the engine is loaded and stepping")
    async def health() -> Response:
        body = _health_body(
            runtime,
            status=runtime.reported_state,
            model=runtime.model_name or None,
            uptime_s=round(time.time() - runtime.started_at, 3),
        )
        return Response(body, status_code=200 if runtime.healthy else 503)

    # Probes for orchestrators (deploy/kubernetes.yaml). Liveness fails only when restarting
    # helps (the step loop died); readiness fails whenever requests would get 503.
    @get("/health/live", summary="Liveness: 200 while the step loop runs (or the model loads)")
    async def health_live() -> Response:
        alive = runtime.alive
        body = _health_body(runtime, status="alive" if alive else "dead", state=runtime.state)
        return Response(body, status_code=200 if alive else 503)

    @get("/health/ready", summary="Readiness: 200 only when loaded and admitting requests")
    async def health_ready() -> Response:
        body = _health_body(runtime, status=runtime.reported_state)
        return Response(body, status_code=200 if runtime.healthy else 503)

    async def add_request_id(message: Any, scope: Any) -> None:
        """Every /v1 response carries X-Request-Id (errors and unknown routes included): the
        client's, or the one generated for the request (see controlplane.http.request_id)."""
        if message["type"] == "http.response.start" and scope.get("path", "").startswith("/v1/"):
            value = request_id(scope).value.encode("ascii")
            message["headers"] = [*message.get("headers", ()), (b"x-request-id", value)]

    app = Litestar(
        route_handlers=[
            *v1,
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
        on_shutdown=[api.limits.close],  # the rate limiter's Redis connections
        debug=False,
        logging_config=None,  # the daemon configured logging (text or JSON); keep it
    )
    # HTTP metrics around the router itself, inside the app's exception handling: Litestar's
    # `middleware=` runs only for matched routes, and the router's 404 / 405 must count too.
    app.asgi_handler = HttpMetricsMiddleware(app.asgi_handler, runtime.http_metrics)
    return app
