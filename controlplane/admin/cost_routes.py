"""/admin/costs and /admin/utilization: the reports `controlplane report` prints, over a
window of the request rows or the hourly rollups."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery, QueryParameter

from controlplane.admin.support import read_store, unprocessable
from controlplane.common import parse_group_by, parse_report_time
from controlplane.errors import FieldError

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime


def _window(
    since: str | None, until: str | None, group_by: str, allowed: tuple[str, ...]
) -> tuple[datetime, datetime, list[str]]:
    now = datetime.now(UTC)  # one "now" for both bounds: "24h" is exactly 24 hours
    try:
        start = parse_report_time("since", since or "24h", now=now)
        end = parse_report_time("until", until, now=now) if until else now
        keys = parse_group_by(group_by, allowed)
    except FieldError as exc:
        raise unprocessable(exc.field, exc.message) from None
    if start >= end:
        raise unprocessable(
            "since", f"must be before until ({start.isoformat()} >= {end.isoformat()})"
        )
    return start, end, keys


class CostsController(Controller):
    path = "/"

    @get(
        "/costs",
        summary="Cost report (same numbers as `controlplane report cost`): exact windows of "
        "1 minute to 24 hours from the request rows, longer ones from the hourly rollups",
    )
    async def costs(
        self,
        runtime: NamedDependency[Runtime],
        since: FromQuery[str | None] = None,
        until: FromQuery[str | None] = None,
        group_by: FromQuery[str] = "day,model,api_key",
        # `scope` is litestar's name for the ASGI scope: the query parameter gets another.
        where: Annotated[str, QueryParameter(name="scope")] = "fleet",
    ) -> dict[str, Any]:
        from controlplane.accounting.reports import COST_GROUPS, cost_report, cost_window

        start, end, keys = _window(since, until, group_by, COST_GROUPS)
        if where not in ("fleet", "instance"):
            raise unprocessable("scope", f"must be fleet or instance, got {where!r}")
        try:
            cost_window(start, end, keys)  # a bad window is a 422 naming since / group_by
        except FieldError as exc:
            raise unprocessable(exc.field, exc.message) from None
        report = await read_store(
            runtime,
            cost_report,
            since=start,
            until=end,
            group_by=keys,
            source="auto",
            instance_id=runtime.instance_id if where == "instance" else None,
        )
        return report.to_dict()

    @get(
        "/utilization",
        summary="Utilization report (same numbers as `controlplane report utilization`)",
    )
    async def utilization(
        self,
        runtime: NamedDependency[Runtime],
        since: FromQuery[str | None] = None,
        until: FromQuery[str | None] = None,
        group_by: FromQuery[str] = "hour",
    ) -> dict[str, Any]:
        from controlplane.accounting.reports import utilization_report

        start, end, keys = _window(since, until, group_by, ("day", "hour", "instance"))
        report = await read_store(
            runtime, utilization_report, since=start, until=end, group_by=keys
        )
        return report.to_dict()
