"""/admin/* routes (all behind the admin token guard) and /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from litestar import Request, Response, Router, get, patch, post
from litestar.params import FromPath, FromQuery, QueryParameter
from litestar.response import ServerSentEvent, ServerSentEventMessage

from controlplane.common import parse_group_by, parse_report_time, parse_time
from controlplane.errors import FieldError
from controlplane.fleet.actions import apply_change, fleet_status, fleet_summary
from controlplane.http.auth import FLEET_STATE, fleet_answers
from controlplane.http.body import load_json, openapi_body
from controlplane.http.errors import APIError
from controlplane.http.signing import CHANGE_ID_HEADER, SOURCE_HEADER
from controlplane.runtime.store_handle import StoreNotOpenError

if TYPE_CHECKING:
    from sqlalchemy import Engine as SQLEngine

    from controlplane.runtime.runtime import Runtime

T = TypeVar("T")
log = logging.getLogger("controlplane.admin")

KEEPALIVE_S = 15.0
CHANGE_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
# Row ids and other integers bound into SQL: both databases store them as signed 64-bit.
MAX_SQL_INT = (1 << 63) - 1
CONFIG_PATCH_SCHEMA = {
    "type": "object",
    "minProperties": 1,
    "description": 'fields to change, nested ({"engine": {"max_num_seqs": 16}}) or dotted',
}


def _source(request: Request) -> str:
    """Where a change says it came from (audit log): the TUI and fleet actions say so."""
    said = request.headers.get(SOURCE_HEADER, "").lower()
    return said if said in ("tui", "fleet") else "api"


def _with_limits(fields: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """GET /admin/config's fields with what each accepts ("type", "min", "max", "choices"...),
    from the declarations the validation uses (controlplane.config.field_limits)."""
    from controlplane.config import field_limits

    limits = field_limits()
    return {k: {**v, **limits.get(k, {})} for k, v in fields.items()}


def _unprocessable(param: str, message: str, status: int = 422) -> APIError:
    kind = "conflict" if status == 409 else "invalid_request_error"
    return APIError(status, f"{param}: {message}", type=kind, param=param)


def _time_param(name: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_time(name, value, relative=False)
    except FieldError as exc:
        raise _unprocessable(exc.field, exc.message) from None


def admin_router(runtime: Runtime, finished: Callable[[str], str | None] | None = None) -> Router:
    """`finished(request_id)`: how a recently finished request ended (None: unknown), so that
    aborting it answers 409 rather than 404."""
    from controlplane.runtime.live_config import ConfigChangeError

    async def _read(query: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """A store query in a worker thread; 503 until the daemon has opened its store."""
        try:
            return await runtime.store.read(query, *args, **kwargs)
        except StoreNotOpenError:
            raise APIError(
                503, "the store is not open yet", type="unavailable", code="loading"
            ) from None

    @get("/config", summary="Effective settings: value, source and live-tunability of every field")
    async def get_config() -> dict[str, Any]:
        return {
            "fields": _with_limits(runtime.live.describe()),
            "dropped_at_restart": runtime.dropped_at_restart,
        }

    @post(
        "/config/save",
        status_code=200,
        summary="Write the live values that differ from the config file into it (audited)",
    )
    async def save_config(request: Request) -> dict[str, Any]:
        from controlplane.runtime.persist import SaveError

        try:
            return await runtime.save_config(_source(request), request.state.actor)
        except SaveError as exc:
            raise APIError(409, str(exc), type="conflict", param="config_file") from None
        except ConfigChangeError as exc:  # the audit row could not be written: nothing saved
            raise _unprocessable(exc.field, exc.message, exc.status) from None

    @patch(
        "/config",
        status_code=200,
        summary="Change live settings (all or nothing)",
        operation_class=openapi_body(CONFIG_PATCH_SCHEMA),
    )
    async def patch_config(
        request: Request,
        dry_run: FromQuery[bool] = False,
        # `scope` is litestar's name for the ASGI scope: the query parameter gets another.
        where: Annotated[str, QueryParameter(name="scope")] = "instance",
    ) -> Any:
        # 400 naming the field for malformed JSON, too deep, huge integers, lone surrogates;
        # 422 for a key given twice.
        body = load_json(await request.body(), unique_keys=True)
        if not isinstance(body, dict) or not body:
            raise _unprocessable("body", "must be a non-empty JSON object of fields to change", 400)
        if where not in ("instance", "fleet"):
            raise _unprocessable("scope", f"must be instance or fleet, got {where!r}", 400)
        from controlplane.runtime.live_config import check_json_types, flatten_body

        try:  # before the fan-out too: every instance would refuse it alike
            changes = flatten_body(body)
            check_json_types(changes)
        except ConfigChangeError as exc:
            raise _unprocessable(exc.field, exc.message, exc.status) from None
        if where == "fleet":
            if FLEET_STATE in request.state:  # the fleet signature allows no such route either
                raise APIError(
                    403,
                    "scope: a fleet operation never starts another (this request is part of one)",
                    type="permission_error",
                    param="scope",
                )
            if dry_run:
                raise _unprocessable("dry_run", "is for one instance, not with scope=fleet", 400)
            return await _fleet_change(request, changes)
        source = _source(request)
        change_id = request.headers.get(CHANGE_ID_HEADER)
        if change_id is not None and not CHANGE_ID_RE.fullmatch(change_id):
            raise _unprocessable(
                CHANGE_ID_HEADER, "must be 1-64 characters of A-Z a-z 0-9 . _ : -", 400
            )
        change_id = change_id or uuid.uuid4().hex
        try:
            if dry_run:
                planned = runtime.check_config(changes, source)
            else:
                planned = await runtime.change_config(
                    changes, source, request.state.actor, change_id
                )
        except ConfigChangeError as exc:
            raise _unprocessable(exc.field, exc.message, exc.status) from None
        return {
            "change_id": None if dry_run else change_id,
            "dry_run": dry_run,
            "changed": [{"field": c.field, "old": c.old, "new": c.new} for c in planned],
            "fields": runtime.live.describe(),
        }

    async def _fleet_change(request: Request, changes: dict[str, Any]) -> Response:
        """This daemon coordinates: every live instance validates, then all apply (requests
        signed with a key derived from the caller's token, never the token itself: one token
        per fleet works, and a URL in the table learns nothing it could reuse)."""
        from controlplane.fleet.registry import members

        found = await _read(
            members,
            now=datetime.now(UTC),
            unreachable_after_s=runtime.cfg.fleet.unreachable_after_s,
        )
        authorization = request.headers.get("authorization", "")
        token = authorization[7:].strip() if authorization[:7].lower() == "bearer " else None
        result = await apply_change(found, changes, token)
        log.info(
            "fleet change %s by %s: %s",
            result.change_id,
            request.state.actor,
            ", ".join(f"{o.instance} {o.outcome}" for o in result.instances) or "no instances",
        )
        status, body = fleet_status(result), result.to_dict()
        if status != 200:
            body["error"] = {"message": fleet_summary(result), "type": "fleet_change_failed"}
        return Response(body, status_code=status)

    @get("/config/history", summary="Audit log of config changes, newest first")
    async def config_history(
        limit: FromQuery[int] = 100,
        before_id: FromQuery[int | None] = None,
        field: FromQuery[str | None] = None,
    ) -> dict[str, Any]:
        if not 1 <= limit <= 1000:
            raise _unprocessable("limit", f"must be in [1, 1000], got {limit}")
        if before_id is not None and not 1 <= before_id <= MAX_SQL_INT:
            raise _unprocessable("before_id", f"must be in [1, {MAX_SQL_INT}], got {before_id}")
        from controlplane.store.audit import history

        entries = await _read(
            history,
            limit=limit,
            before_id=before_id,
            field=field,
            instance_id=runtime.instance_id,
        )
        return {"changes": entries}

    @get("/stats", summary="Engine and queue statistics (10 s window)")
    async def stats(block_map: FromQuery[int | None] = None) -> dict[str, Any]:
        body = runtime.stats_payload()
        if block_map is not None:
            if not 8 <= block_map <= 1024:
                raise _unprocessable("block_map", f"must be in [8, 1024] buckets, got {block_map}")
            body["kv_block_map"], body["kv_block_map_cached"] = runtime.engine.kv_block_map(
                block_map
            )
        return body

    @get("/events", summary="Server-Sent Events: stats snapshots and config changes")
    async def events(interval: FromQuery[float | None] = None) -> ServerSentEvent:
        period = runtime.cfg.server.events_interval_s if interval is None else interval
        if not 0.1 <= period <= 60:
            raise _unprocessable("interval", f"must be in [0.1, 60] seconds, got {period}")
        return ServerSentEvent(_event_stream(runtime, period))

    @get("/requests", summary="Running and waiting requests (live) and finished ones (SQL)")
    async def requests(
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
            finished, next_cursor = await _read(
                list_requests,
                status=status,
                api_key_name=api_key_name,
                since=_time_param("since", since),
                until=_time_param("until", until),
                limit=limit,
                cursor=cursor,
                instance_id=runtime.instance_id,
                x_request_id=x_request_id,
            )
        except FieldError as exc:
            raise _unprocessable(exc.field, exc.message) from None
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
        "/requests/{request_id:str}/abort",
        status_code=200,
        summary="Abort a running or waiting request",
    )
    async def abort(request_id: FromPath[str], request: Request) -> dict[str, Any]:
        if runtime.abort_request(request_id, request.state.actor):
            await runtime.audit_action(
                "abort", None, f"request {request_id}", _source(request), request.state.actor
            )
            return {"aborted": request_id}
        ended = finished(request_id) if finished is not None else None
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

    def _key(name: str) -> str:
        if name not in {k.name for k in runtime.cfg.api_keys}:
            raise APIError(
                404,
                f"api key {name!r} is not configured ([[api_keys]])",
                param="name",
                code="not_found",
            )
        return name

    @post(
        "/keys/{name:str}/abort",
        status_code=200,
        summary="Abort every running and waiting request of one API key (audited)",
    )
    async def abort_key(name: FromPath[str], request: Request) -> dict[str, Any]:
        ids = runtime.abort_key(_key(name), request.state.actor)
        await runtime.audit_action(
            "abort",
            None,
            f"key {name}: {len(ids)} request{'' if len(ids) == 1 else 's'}",
            _source(request),
            request.state.actor,
        )
        return {"api_key_name": name, "aborted": len(ids), "ids": ids}

    async def _suspension(name: str, request: Request, suspend: bool) -> dict[str, Any]:
        _key(name)

        def change(cfg: Any) -> dict[str, Any]:  # on the config as it is under the lock
            keys = [k for k in cfg.server.suspended_keys if k != name]
            return {"server.suspended_keys": [*keys, name] if suspend else keys}

        try:
            changed = await runtime.change_config(change, _source(request), request.state.actor)
        except ConfigChangeError as exc:
            raise _unprocessable(exc.field, exc.message, exc.status) from None
        return {
            "api_key_name": name,
            "suspended": suspend,
            "changed": bool(changed),
            "suspended_keys": list(runtime.cfg.server.suspended_keys),
        }

    @post(
        "/keys/{name:str}/suspend",
        status_code=200,
        summary="Refuse new requests of one API key (403); running ones go on (audited)",
    )
    async def suspend_key(name: FromPath[str], request: Request) -> dict[str, Any]:
        return await _suspension(name, request, True)

    @post(
        "/keys/{name:str}/unsuspend",
        status_code=200,
        summary="Serve one API key again after a suspension (audited)",
    )
    async def unsuspend_key(name: FromPath[str], request: Request) -> dict[str, Any]:
        return await _suspension(name, request, False)

    @get("/fleet", summary="Every daemon sharing this database, worst first")
    async def fleet(include_stopped: FromQuery[bool] = False) -> dict[str, Any]:
        from controlplane.fleet.registry import config_drift, members, totals

        age, now = runtime.cfg.fleet.unreachable_after_s, datetime.now(UTC)

        def read(db: SQLEngine) -> dict[str, Any]:
            found = members(db, now=now, unreachable_after_s=age, include_stopped=include_stopped)
            return {
                "instances": [m.to_dict() for m in found],
                "totals": totals(db, found, now=now).to_dict(),
                "config_drift": config_drift(found),
            }

        body = await _read(read)
        return {**body, "self": runtime.instance_id, "unreachable_after_s": age}

    @get("/autopilot", summary="The SLO autopilot: on/off, targets, bounds, recent decisions")
    async def autopilot() -> dict[str, Any]:
        if runtime.autopilot is None:
            raise APIError(503, "the autopilot is not running yet", type="unavailable")
        return runtime.autopilot.describe()

    @patch(
        "/autopilot",
        status_code=200,
        summary="Change [autopilot] settings (all or nothing, audited like PATCH /admin/config)",
        operation_class=openapi_body(
            {"type": "object", "minProperties": 1, "description": '{"enabled": true, ...}'}
        ),
    )
    async def patch_autopilot(request: Request) -> dict[str, Any]:
        body = load_json(await request.body(), unique_keys=True)
        if not isinstance(body, dict) or not body:
            raise _unprocessable("body", "must be a non-empty JSON object of [autopilot] keys", 400)
        if runtime.autopilot is None:
            raise APIError(503, "the autopilot is not running yet", type="unavailable")
        from controlplane.runtime.live_config import check_json_types

        changes = {f"autopilot.{k}": v for k, v in body.items()}
        try:
            check_json_types(changes)
            await runtime.change_config(changes, _source(request), request.state.actor)
        except ConfigChangeError as exc:
            raise _unprocessable(exc.field, exc.message, exc.status) from None
        return runtime.autopilot.describe()

    @post(
        "/cache/reset",
        status_code=200,
        summary="Drop every cached prefix block no request holds (audited)",
    )
    async def cache_reset(request: Request) -> dict[str, Any]:
        if not runtime.engine.loaded:
            raise APIError(503, "the engine is not loaded yet", type="unavailable", code="loading")
        if not runtime.engine.running:  # before the audit: a dead engine resets nothing
            raise APIError(
                503,
                "the engine's step loop has stopped (state dead): nothing to reset",
                type="unavailable",
                code="engine_dead",
            )
        source = _source(request)
        try:
            dropped = await runtime.reset_prefix_cache(source, request.state.actor)
        except ConfigChangeError as exc:
            raise _unprocessable(exc.field, exc.message, exc.status) from None
        return {"dropped_blocks": dropped}

    @post("/drain", status_code=200, summary="Stop admitting new requests; running ones finish")
    async def drain(request: Request) -> dict[str, Any]:
        before = runtime.state
        runtime.drain(request.state.actor)
        return await _state_change(request, before)

    @post("/resume", status_code=200, summary="Admit new requests again after a drain")
    async def resume(request: Request) -> dict[str, Any]:
        before = runtime.state
        runtime.resume(request.state.actor)
        return await _state_change(request, before)

    async def _state_change(request: Request, before: str) -> dict[str, Any]:
        """The answer to a drain or resume; a change of state is audited (field `state`)."""
        after = runtime.state
        if after != before:
            await runtime.audit_action(
                "state", str(before), str(after), _source(request), request.state.actor
            )
        return {"state": after}

    def _window(
        since: str | None, until: str | None, group_by: str, allowed: tuple[str, ...]
    ) -> tuple:
        now = datetime.now(UTC)  # one "now" for both bounds: "24h" is exactly 24 hours
        try:
            start = parse_report_time("since", since or "24h", now=now)
            end = parse_report_time("until", until, now=now) if until else now
            keys = parse_group_by(group_by, allowed)
        except FieldError as exc:
            raise _unprocessable(exc.field, exc.message) from None
        if start >= end:
            raise _unprocessable(
                "since", f"must be before until ({start.isoformat()} >= {end.isoformat()})"
            )
        return start, end, keys

    @get(
        "/costs",
        summary="Cost report (same numbers as `controlplane report cost`): exact windows of "
        "1 minute to 24 hours from the request rows, longer ones from the hourly rollups",
    )
    async def costs(
        since: FromQuery[str | None] = None,
        until: FromQuery[str | None] = None,
        group_by: FromQuery[str] = "day,model,api_key",
        # `scope` is litestar's name for the ASGI scope: the query parameter gets another.
        where: Annotated[str, QueryParameter(name="scope")] = "fleet",
    ) -> dict[str, Any]:
        from controlplane.accounting.reports import COST_GROUPS, cost_report, cost_window

        start, end, keys = _window(since, until, group_by, COST_GROUPS)
        if where not in ("fleet", "instance"):
            raise _unprocessable("scope", f"must be fleet or instance, got {where!r}")
        try:
            cost_window(start, end, keys)  # a bad window is a 422 naming since / group_by
        except FieldError as exc:
            raise _unprocessable(exc.field, exc.message) from None
        report = await _read(
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
        since: FromQuery[str | None] = None,
        until: FromQuery[str | None] = None,
        group_by: FromQuery[str] = "hour",
    ) -> dict[str, Any]:
        from controlplane.accounting.reports import utilization_report

        start, end, keys = _window(since, until, group_by, ("day", "hour", "instance"))
        report = await _read(utilization_report, since=start, until=end, group_by=keys)
        return report.to_dict()

    return Router(
        path="/admin",
        route_handlers=[
            get_config,
            patch_config,
            save_config,
            config_history,
            stats,
            events,
            requests,
            abort,
            abort_key,
            suspend_key,
            unsuspend_key,
            drain,
            resume,
            cache_reset,
            autopilot,
            patch_autopilot,
            fleet,
            costs,
            utilization,
        ],
        guards=[runtime.admin_auth.fleet_guard(runtime.instance_id)],
        middleware=[fleet_answers],
        tags=["admin"],
    )


class _EncodedMessage(ServerSentEventMessage):
    """A message encoded once: the same stats snapshot goes to every subscriber."""

    def __init__(self, data: str, event: str) -> None:
        super().__init__(data=data, event=event)
        self._encoded = super().encode()

    def encode(self) -> bytes:
        return self._encoded


_last_stats: tuple[str, _EncodedMessage] | None = None


def _stats_message(runtime: Runtime) -> _EncodedMessage:
    """The current snapshot (runtime.stats_json: computed at most every 0.1 s), framed once
    for all subscribers: 500 open streams must not cost serving more than a few percent."""
    global _last_stats
    data = runtime.stats_json()
    if _last_stats is None or _last_stats[0] is not data:
        _last_stats = (data, _EncodedMessage(data, "stats"))
    return _last_stats[1]


async def _event_stream(runtime: Runtime, period: float) -> AsyncIterator[ServerSentEventMessage]:
    """Snapshots are taken when sent (shared by all subscribers, at most 0.1 s old), so a slow
    client gets fewer, never a backlog; config events wait in a small per-client queue that
    drops the oldest when full."""
    queue = runtime.events.subscribe()
    loop = asyncio.get_running_loop()
    last_ping = loop.time()
    try:
        while True:
            yield _stats_message(runtime)
            deadline = loop.time() + period
            while (left := deadline - loop.time()) > 0:
                try:  # asyncio.timeout, not wait_for: no task per wait, for 500 subscribers
                    async with asyncio.timeout(left):
                        event = await queue.get()
                except TimeoutError:
                    break
                yield ServerSentEventMessage(data=json.dumps(event), event="config")
                if event.get("type") == "state" and event.get("state") == "stopping":
                    return  # the daemon is shutting down: end the stream cleanly
            if loop.time() - last_ping >= KEEPALIVE_S:
                last_ping = loop.time()
                yield ServerSentEventMessage(comment="keep-alive")
    finally:
        runtime.events.unsubscribe(queue)


def metrics_handler(runtime: Runtime):
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
