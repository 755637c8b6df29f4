"""/admin/config: the effective settings, live changes (one instance or the whole fleet), the
save into the config file, and the audit log of changes."""

from __future__ import annotations

import logging
import re
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

from litestar import Controller, Request, Response, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromQuery, QueryParameter

from controlplane.admin.support import MAX_SQL_INT, read_store, source, unprocessable
from controlplane.fleet.actions import apply_change, fleet_status, fleet_summary
from controlplane.http.auth import FLEET_STATE
from controlplane.http.body import load_json, openapi_body
from controlplane.http.errors import APIError
from controlplane.http.signing import CHANGE_ID_HEADER
from controlplane.runtime.live_config import ConfigChangeError

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime

log = logging.getLogger("controlplane.admin")

CHANGE_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
CONFIG_PATCH_SCHEMA = {
    "type": "object",
    "minProperties": 1,
    "description": 'fields to change, nested ({"engine": {"max_num_seqs": 16}}) or dotted',
}


def _with_limits(fields: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """GET /admin/config's fields with what each accepts ("type", "min", "max", "choices"...),
    from the declarations the validation uses (controlplane.config.field_limits)."""
    from controlplane.config import field_limits

    limits = field_limits()
    return {k: {**v, **limits.get(k, {})} for k, v in fields.items()}


class ConfigController(Controller):
    path = "/config"

    @get("/", summary="Effective settings: value, source and live-tunability of every field")
    async def get_config(self, runtime: NamedDependency[Runtime]) -> dict[str, Any]:
        return {
            "fields": _with_limits(runtime.live.describe()),
            "dropped_at_restart": runtime.dropped_at_restart,
        }

    @post(
        "/save",
        status_code=200,
        summary="Write the live values that differ from the config file into it (audited)",
    )
    async def save_config(
        self, request: Request, runtime: NamedDependency[Runtime]
    ) -> dict[str, Any]:
        from controlplane.runtime.persist import SaveError

        try:
            return await runtime.save_config(source(request), request.state.actor)
        except SaveError as exc:
            raise APIError(409, str(exc), type="conflict", param="config_file") from None
        except ConfigChangeError as exc:  # the audit row could not be written: nothing saved
            raise unprocessable(exc.field, exc.message, exc.status) from None

    @patch(
        "/",
        status_code=200,
        summary="Change live settings (all or nothing)",
        operation_class=openapi_body(CONFIG_PATCH_SCHEMA),
    )
    async def patch_config(
        self,
        request: Request,
        runtime: NamedDependency[Runtime],
        dry_run: FromQuery[bool] = False,
        # `scope` is litestar's name for the ASGI scope: the query parameter gets another.
        where: Annotated[str, QueryParameter(name="scope")] = "instance",
    ) -> Any:
        # The hand parser stays for this body (not a typed struct): a key given twice is a 422
        # naming it (msgspec keeps the last value silently), and the body is an open map of
        # nested or dotted setting names that the config's own declarations validate
        # (runtime.live_config), one field-named error at a time.
        # 400 naming the field for malformed JSON, too deep, huge integers, lone surrogates;
        # 422 for a key given twice.
        body = load_json(await request.body(), unique_keys=True)
        if not isinstance(body, dict) or not body:
            raise unprocessable("body", "must be a non-empty JSON object of fields to change", 400)
        if where not in ("instance", "fleet"):
            raise unprocessable("scope", f"must be instance or fleet, got {where!r}", 400)
        from controlplane.runtime.live_config import check_json_types, flatten_body

        try:  # before the fan-out too: every instance would refuse it alike
            changes = flatten_body(body)
            check_json_types(changes)
        except ConfigChangeError as exc:
            raise unprocessable(exc.field, exc.message, exc.status) from None
        if where == "fleet":
            if FLEET_STATE in request.state:  # the fleet signature allows no such route either
                raise APIError(
                    403,
                    "scope: a fleet operation never starts another (this request is part of one)",
                    type="permission_error",
                    param="scope",
                )
            if dry_run:
                raise unprocessable("dry_run", "is for one instance, not with scope=fleet", 400)
            return await _fleet_change(runtime, request, changes)
        said = source(request)
        change_id = request.headers.get(CHANGE_ID_HEADER)
        if change_id is not None and not CHANGE_ID_RE.fullmatch(change_id):
            raise unprocessable(
                CHANGE_ID_HEADER, "must be 1-64 characters of A-Z a-z 0-9 . _ : -", 400
            )
        change_id = change_id or uuid.uuid4().hex
        try:
            if dry_run:
                planned = runtime.check_config(changes, said)
            else:
                planned = await runtime.change_config(changes, said, request.state.actor, change_id)
        except ConfigChangeError as exc:
            raise unprocessable(exc.field, exc.message, exc.status) from None
        return {
            "change_id": None if dry_run else change_id,
            "dry_run": dry_run,
            "changed": [{"field": c.field, "old": c.old, "new": c.new} for c in planned],
            "fields": runtime.live.describe(),
        }

    @get("/history", summary="Audit log of config changes, newest first")
    async def config_history(
        self,
        runtime: NamedDependency[Runtime],
        limit: FromQuery[int] = 100,
        before_id: FromQuery[int | None] = None,
        field: FromQuery[str | None] = None,
    ) -> dict[str, Any]:
        if not 1 <= limit <= 1000:
            raise unprocessable("limit", f"must be in [1, 1000], got {limit}")
        if before_id is not None and not 1 <= before_id <= MAX_SQL_INT:
            raise unprocessable("before_id", f"must be in [1, {MAX_SQL_INT}], got {before_id}")
        from controlplane.store.audit import history

        entries = await read_store(
            runtime,
            history,
            limit=limit,
            before_id=before_id,
            field=field,
            instance_id=runtime.instance_id,
        )
        return {"changes": entries}


async def _fleet_change(runtime: Runtime, request: Request, changes: dict[str, Any]) -> Response:
    """This daemon coordinates: every live instance validates, then all apply (requests
    signed with a key derived from the caller's token, never the token itself: one token
    per fleet works, and a URL in the table learns nothing it could reuse)."""
    from controlplane.fleet.registry import members

    found = await read_store(
        runtime,
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
