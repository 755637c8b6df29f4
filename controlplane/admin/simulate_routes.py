"""/admin/simulate: what a change of the live knobs would do to the traffic this daemon served in
the last minutes, from the simulator (controlplane/planning/whatif.py), before it is applied."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import FromQuery

from controlplane.admin.support import read_store, unprocessable
from controlplane.errors import FieldError
from controlplane.http.body import load_json, openapi_body
from controlplane.http.errors import APIError
from controlplane.runtime.live_config import ConfigChangeError, check_json_types, flatten_body

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime

WINDOW_S = (60.0, 86_400.0)  # the window's allowed length
# Rows a window may hold here: the simulation runs twice in the daemon (a worker thread), at
# about 2 ms a request on a 2-core CPU (docs/benchmarks.md#simulator-accuracy).
MAX_ROWS = 20_000


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
        from controlplane.planning.summary import Slo
        from controlplane.planning.whatif import live_cost_model, proposed_settings, what_if
        from controlplane.planning.window import PlanningError, read_window

        body = load_json(await request.body(), unique_keys=True)
        if not isinstance(body, dict):
            raise unprocessable("body", "must be a JSON object of fields to change", 400)
        low, high = WINDOW_S
        if not low <= window_s <= high:
            raise unprocessable("window_s", f"must be in [{low:g}, {high:g}] s, got {window_s:g}")
        try:
            changes = flatten_body(body)
            check_json_types(changes)
            changed = runtime.check_config(changes, "api")
        except ConfigChangeError as exc:
            raise unprocessable(exc.field, exc.message, exc.status) from None
        aeng = runtime.engine.aengine
        if aeng is None:
            raise APIError(503, "the model is still loading", type="unavailable", code="loading")
        engine = aeng.engine
        now_settings = engine.settings
        try:
            proposed_settings(now_settings, changes)
        except FieldError as exc:
            raise unprocessable(f"engine.{exc.field}", exc.message) from None
        cfg = runtime.cfg
        until = datetime.now(UTC)
        try:
            cost = live_cost_model(engine, runtime.engine.recent_steps())
            window = await read_store(
                runtime,
                read_window,
                until - timedelta(seconds=window_s),
                until,
                model=runtime.model_name,
                max_rows=MAX_ROWS,
            )
            result = await asyncio.to_thread(
                what_if,
                window,
                now_settings,
                changes,
                cost,
                engine.model_config.vocab_size,
                engine.max_model_len,
                Slo(cfg.autopilot.ttft_p99_ms, cfg.autopilot.itl_p99_ms),
                cfg.jobs.gpu_hourly_usd * max(1, cfg.jobs.num_gpus),
            )
        except PlanningError as exc:
            raise APIError(409, str(exc), type="conflict", code="cannot_simulate") from None
        return {
            **result.as_dict(),
            "changed": [{"field": c.field, "old": c.old, "new": c.new} for c in changed],
            "slo": {
                "ttft_p99_ms": cfg.autopilot.ttft_p99_ms,
                "itl_p99_ms": cfg.autopilot.itl_p99_ms,
            },
        }
