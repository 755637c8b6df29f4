"""/admin/drain, /admin/resume and /admin/cache/reset: the operator's actions on the daemon's
admission and on the engine's prefix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency

from controlplane.admin.support import source, unprocessable
from controlplane.http.errors import APIError
from controlplane.runtime.live_config import ConfigChangeError

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime


async def _state_change(runtime: Runtime, request: Request, before: str) -> dict[str, Any]:
    """The answer to a drain or resume; a change of state is audited (field `state`)."""
    after = runtime.state
    if after != before:
        await runtime.audit_action(
            "state", str(before), str(after), source(request), request.state.actor
        )
    return {"state": after}


class OperationsController(Controller):
    path = "/"

    @post(
        "/cache/reset",
        status_code=200,
        summary="Drop every cached prefix block no request holds (audited)",
    )
    async def cache_reset(
        self, request: Request, runtime: NamedDependency[Runtime]
    ) -> dict[str, Any]:
        if not runtime.engine.loaded:
            raise APIError(503, "the engine is not loaded yet", type="unavailable", code="loading")
        if not runtime.engine.running:  # before the audit: a dead engine resets nothing
            raise APIError(
                503,
                "the engine's step loop has stopped (state dead): nothing to reset",
                type="unavailable",
                code="engine_dead",
            )
        said = source(request)
        try:
            dropped = await runtime.reset_prefix_cache(said, request.state.actor)
        except ConfigChangeError as exc:
            raise unprocessable(exc.field, exc.message, exc.status) from None
        return {"dropped_blocks": dropped}

    @post("/drain", status_code=200, summary="Stop admitting new requests; running ones finish")
    async def drain(self, request: Request, runtime: NamedDependency[Runtime]) -> dict[str, Any]:
        before = runtime.state
        runtime.drain(request.state.actor)
        return await _state_change(runtime, request, before)

    @post("/resume", status_code=200, summary="Admit new requests again after a drain")
    async def resume(self, request: Request, runtime: NamedDependency[Runtime]) -> dict[str, Any]:
        before = runtime.state
        runtime.resume(request.state.actor)
        return await _state_change(runtime, request, before)
