"""/admin/simulate: what a change of the live knobs would do to the traffic this daemon served in
the last minutes, from the simulator (controlplane/planning/whatif.py), before it is applied."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import FromQuery

from controlplane.admin.support import unprocessable
from controlplane.errors import FieldError
from controlplane.http.body import load_json, openapi_body
from controlplane.http.errors import APIError
from controlplane.runtime.live_config import ConfigChangeError, check_json_types, flatten_body
from controlplane.runtime.store_handle import StoreNotOpenError

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime

WINDOW_S = (60.0, 86_400.0)  # the window's allowed length


class SimulateController(Controller):
    path = "/simulate"

    @post(
        "/",
        status_code=200,
        summary="Simulate a change of live settings on the last window of traffic",
        operation_class=openapi_body(
            {
                "type": "object",
                "description": "fields to change, as PATCH /admin/config takes them ({} for none)",
            }
        ),
    )
    async def simulate(
        self,
        request: Request,
        runtime: NamedDependency[Runtime],
        window_s: FromQuery[float] = 900.0,
    ) -> dict[str, Any]:
        from controlplane.planning.window import PlanningError

        body = load_json(await request.body(), unique_keys=True)
        if not isinstance(body, dict):
            raise unprocessable("body", "must be a JSON object of fields to change", 400)
        low, high = WINDOW_S
        if not low <= window_s <= high:
            raise unprocessable("window_s", f"must be in [{low:g}, {high:g}] s, got {window_s:g}")
        if not runtime.engine.loaded:
            raise APIError(503, "the model is still loading", type="unavailable", code="loading")
        try:
            changes = flatten_body(body)
            check_json_types(changes)
            changed, result = await runtime.what_if(changes, window_s)
        except ConfigChangeError as exc:
            raise unprocessable(exc.field, exc.message, exc.status) from None
        except FieldError as exc:  # the engine's own check of the new settings
            raise unprocessable(f"engine.{exc.field}", exc.message) from None
        except PlanningError as exc:
            raise APIError(409, str(exc), type="conflict", code="cannot_simulate") from None
        except StoreNotOpenError:
            raise APIError(
                503, "the store is not open yet", type="unavailable", code="loading"
            ) from None
        cfg = runtime.cfg
        return {
            **result.as_dict(),
            "changed": [{"field": c.field, "old": c.old, "new": c.new} for c in changed],
            "slo": {
                "ttft_p99_ms": cfg.autopilot.ttft_p99_ms,
                "itl_p99_ms": cfg.autopilot.itl_p99_ms,
            },
        }
