"""The /admin router: one Litestar controller per topic, all behind the admin token guard
(checked before any body is read), the runtime and the /v1 API's record of finished requests
injected as dependencies; and /metrics (controlplane.admin.stats_routes).

    config_routes     GET/PATCH /admin/config, POST /admin/config/save, GET /admin/config/history
    request_routes    GET /admin/requests, POST /admin/requests/{request_id}/abort
    key_routes        POST /admin/keys/{name}/abort, /suspend, /unsuspend
    api_key_routes    GET/POST /admin/keys, PATCH /admin/keys/{name}, POST .../rotate, /revoke
    operation_routes  POST /admin/drain, /admin/resume, /admin/cache/reset
    autopilot_routes  GET/PATCH /admin/autopilot
    fleet_routes      GET /admin/fleet
    cost_routes       GET /admin/costs, /admin/utilization
    stats_routes      GET /admin/stats (and GET /metrics, outside /admin)
    simulate_routes   POST /admin/simulate (a change's effect on recent traffic, simulated)
    event_routes      GET /admin/events (Server-Sent Events)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from litestar import Router
from litestar.di import Provide

from controlplane.admin.api_key_routes import ApiKeysController
from controlplane.admin.autopilot_routes import AutopilotController
from controlplane.admin.config_routes import ConfigController
from controlplane.admin.cost_routes import CostsController
from controlplane.admin.event_routes import EventsController
from controlplane.admin.fleet_routes import FleetController
from controlplane.admin.key_routes import KeysController
from controlplane.admin.operation_routes import OperationsController
from controlplane.admin.request_routes import RequestsController
from controlplane.admin.simulate_routes import SimulateController
from controlplane.admin.stats_routes import StatsController, metrics_handler
from controlplane.admin.support import FinishedLookup
from controlplane.http.auth import fleet_answers

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime

__all__ = ["admin_router", "metrics_handler"]


def admin_router(runtime: Runtime, finished: Callable[[str], str | None] | None = None) -> Router:
    """`finished(request_id)`: how a recently finished request ended (None: unknown), so that
    aborting it answers 409 rather than 404."""
    lookup = FinishedLookup(finished)
    return Router(
        path="/admin",
        route_handlers=[
            ConfigController,
            StatsController,
            EventsController,
            RequestsController,
            KeysController,
            ApiKeysController,
            OperationsController,
            AutopilotController,
            FleetController,
            CostsController,
            SimulateController,
        ],
        dependencies={
            # The same objects for every request: no per-request construction, no thread.
            "runtime": Provide(lambda: runtime, use_cache=True, sync_to_thread=False),
            "finished": Provide(lambda: lookup, use_cache=True, sync_to_thread=False),
        },
        # The controllers' annotations name the runtime's class only for type checkers (the
        # admin package imports no daemon internals at import time): resolve them here.
        signature_namespace={"Runtime": type(runtime), "FinishedLookup": FinishedLookup},
        guards=[runtime.admin_auth.fleet_guard(runtime.instance_id)],
        middleware=[fleet_answers],
        tags=["admin"],
    )
