"""/admin/autopilot: the SLO autopilot's state, and changes to its [autopilot] settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Controller, Request, get, patch
from litestar.di import NamedDependency

from controlplane.admin.support import source, unprocessable
from controlplane.http.body import load_json, openapi_body
from controlplane.http.errors import APIError
from controlplane.runtime.live_config import ConfigChangeError

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime


def _running(runtime: Runtime) -> Any:
    if runtime.autopilot is None:
        raise APIError(503, "the autopilot is not running yet", type="unavailable")
    return runtime.autopilot


class AutopilotController(Controller):
    path = "/autopilot"

    @get("/", summary="The SLO autopilot: on/off, targets, bounds, recent decisions")
    async def autopilot(self, runtime: NamedDependency[Runtime]) -> dict[str, Any]:
        return _running(runtime).describe()

    @patch(
        "/",
        status_code=200,
        summary="Change [autopilot] settings (all or nothing, audited like PATCH /admin/config)",
        operation_class=openapi_body(
            {"type": "object", "minProperties": 1, "description": '{"enabled": true, ...}'}
        ),
    )
    async def patch_autopilot(
        self, request: Request, runtime: NamedDependency[Runtime]
    ) -> dict[str, Any]:
        # The hand parser stays here, as for PATCH /admin/config: a key given twice is a 422
        # naming it (msgspec keeps the last value silently), and each value is checked
        # against its [autopilot] declaration by the live config, naming the field.
        body = load_json(await request.body(), unique_keys=True)
        if not isinstance(body, dict) or not body:
            raise unprocessable("body", "must be a non-empty JSON object of [autopilot] keys", 400)
        _running(runtime)
        from controlplane.runtime.live_config import check_json_types

        changes = {f"autopilot.{k}": v for k, v in body.items()}
        try:
            check_json_types(changes)
            await runtime.change_config(changes, source(request), request.state.actor)
        except ConfigChangeError as exc:
            raise unprocessable(exc.field, exc.message, exc.status) from None
        return _running(runtime).describe()
