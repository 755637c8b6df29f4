"""/admin/requests: running and waiting requests (live) with finished ones (SQL), and the
abort of one request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery

from controlplane.admin.support import (
    FinishedLookup,
    read_store,
    source,
    time_param,
    unprocessable,
)
from controlplane.errors import FieldError
from controlplane.http.errors import APIError

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime


class RequestsController(Controller):
    path = "/requests"

    @get("/", summary="Running and waiting requests (live) and finished ones (SQL)")
    async def requests(
        self,
        runtime: NamedDependency[Runtime],
        status: FromQuery[str | None] = None,
        api_key_name: FromQuery[str | None] = None,
        since: FromQuery[str | None] = None,
        until: FromQuery[str | None] = None,
        limit: FromQuery[int] = 100,
        cursor: FromQuery[str | None] = None,
        x_request_id: FromQuery[str | None] = None,
    ) -> dict[str, Any]:
        from controlplane.store.queries import list_requests

        try:
            finished, next_cursor = await read_store(
                runtime,
                list_requests,
                status=status,
                api_key_name=api_key_name,
                since=time_param("since", since),
                until=time_param("until", until),
                limit=limit,
                cursor=cursor,
                instance_id=runtime.instance_id,
                x_request_id=x_request_id,
            )
        except FieldError as exc:
            raise unprocessable(exc.field, exc.message) from None
        live = await runtime.live_requests()
        for row in live:  # what the request row will say, from the record kept in flight
            meta = runtime.ledger.in_flight.get(row["id"])
            row["end_user"] = meta.end_user if meta else None
            row["x_request_id"] = meta.x_request_id if meta else None
        if api_key_name is not None:
            live = [r for r in live if r["api_key_name"] == api_key_name]
        if x_request_id is not None:
            live = [r for r in live if r["x_request_id"] == x_request_id]
        return {"live": live, "finished": finished, "next_cursor": next_cursor}

    @post(
        "/{request_id:str}/abort",
        status_code=200,
        summary="Abort a running or waiting request",
    )
    async def abort(
        self,
        request_id: FromPath[str],
        request: Request,
        runtime: NamedDependency[Runtime],
        finished: NamedDependency[FinishedLookup],
    ) -> dict[str, Any]:
        if runtime.abort_request(request_id, request.state.actor):
            await runtime.audit_action(
                "abort", None, f"request {request_id}", source(request), request.state.actor
            )
            return {"aborted": request_id}
        ended = finished(request_id)
        if ended is not None:
            raise APIError(
                409,
                f"request {request_id!r} already finished ({ended}): nothing to abort",
                type="conflict",
                param="request_id",
                code="already_finished",
            )
        raise APIError(
            404,
            f"request {request_id!r} is not in flight",
            param="request_id",
            code="not_found",
        )
