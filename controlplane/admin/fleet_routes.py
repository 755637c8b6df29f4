"""/admin/fleet: every daemon sharing this database, worst first, with totals and drift."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery

from controlplane.admin.support import read_store

if TYPE_CHECKING:
    from sqlalchemy import Engine as SQLEngine

    from controlplane.runtime.runtime import Runtime


class FleetController(Controller):
    path = "/fleet"

    @get("/", summary="Every daemon sharing this database, worst first")
    async def fleet(
        self, runtime: NamedDependency[Runtime], include_stopped: FromQuery[bool] = False
    ) -> dict[str, Any]:
        from controlplane.fleet.registry import config_drift, members, totals

        age, now = runtime.cfg.fleet.unreachable_after_s, datetime.now(UTC)

        def read(db: SQLEngine) -> dict[str, Any]:
            found = members(db, now=now, unreachable_after_s=age, include_stopped=include_stopped)
            return {
                "instances": [m.to_dict() for m in found],
                "totals": totals(db, found, now=now).to_dict(),
                "config_drift": config_drift(found),
            }

        body = await read_store(runtime, read)
        return {**body, "self": runtime.instance_id, "unreachable_after_s": age}
