"""/admin/stats (engine and queue statistics, the KV block map on request) and /metrics (the
Prometheus exposition, outside /admin: its token is optional, server.metrics_require_token)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Controller, Response, get
from litestar.di import NamedDependency
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromQuery

from controlplane.admin.support import unprocessable

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime


class StatsController(Controller):
    path = "/stats"

    @get("/", summary="Engine and queue statistics (10 s window)")
    async def stats(
        self, runtime: NamedDependency[Runtime], block_map: FromQuery[int | None] = None
    ) -> dict[str, Any]:
        body = runtime.stats_payload()
        if block_map is not None:
            if not 8 <= block_map <= 1024:
                raise unprocessable("block_map", f"must be in [8, 1024] buckets, got {block_map}")
            body["kv_block_map"], body["kv_block_map_cached"] = runtime.engine.kv_block_map(
                block_map
            )
        return body


def metrics_handler(runtime: Runtime) -> HTTPRouteHandler:
    """GET /metrics over `runtime`: outside the /admin router (its own guard, or none)."""
    guards = [runtime.admin_auth.guard] if runtime.cfg.server.metrics_require_token else []

    @get(
        "/metrics",
        guards=guards,
        summary="Prometheus exposition (vLLM names, controlplane: prefix)",
    )
    async def metrics() -> Response:
        runtime.pump_metrics()
        payload, content_type = runtime.metrics.render()
        return Response(payload, media_type=content_type)

    return metrics
