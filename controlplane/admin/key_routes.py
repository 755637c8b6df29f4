"""/admin/keys/{name}: abort every request of one API key, suspend and unsuspend it (all
audited)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import FromPath

from controlplane.admin.support import source, unprocessable
from controlplane.http.errors import APIError
from controlplane.runtime.live_config import ConfigChangeError

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime


def _key(runtime: Runtime, name: str) -> str:
    if name not in {k.name for k in runtime.cfg.api_keys} and name not in runtime.keys.names:
        raise APIError(
            404,
            f"api key {name!r} is not configured ([[api_keys]]) nor in the api_keys table",
            param="name",
            code="not_found",
        )
    return name


async def _suspension(
    runtime: Runtime, name: str, request: Request, suspend: bool
) -> dict[str, Any]:
    _key(runtime, name)

    def change(cfg: Any) -> dict[str, Any]:  # on the config as it is under the lock
        keys = [k for k in cfg.server.suspended_keys if k != name]
        return {"server.suspended_keys": [*keys, name] if suspend else keys}

    try:
        changed = await runtime.change_config(change, source(request), request.state.actor)
    except ConfigChangeError as exc:
        raise unprocessable(exc.field, exc.message, exc.status) from None
    return {
        "api_key_name": name,
        "suspended": suspend,
        "changed": bool(changed),
        "suspended_keys": list(runtime.cfg.server.suspended_keys),
    }


class KeysController(Controller):
    path = "/keys/{name:str}"

    @post(
        "/abort",
        status_code=200,
        summary="Abort every running and waiting request of one API key (audited)",
    )
    async def abort_key(
        self, name: FromPath[str], request: Request, runtime: NamedDependency[Runtime]
    ) -> dict[str, Any]:
        ids = runtime.abort_key(_key(runtime, name), request.state.actor)
        await runtime.audit_action(
            "abort",
            None,
            f"key {name}: {len(ids)} request{'' if len(ids) == 1 else 's'}",
            source(request),
            request.state.actor,
        )
        return {"api_key_name": name, "aborted": len(ids), "ids": ids}

    @post(
        "/suspend",
        status_code=200,
        summary="Refuse new requests of one API key (403); running ones go on (audited)",
    )
    async def suspend_key(
        self, name: FromPath[str], request: Request, runtime: NamedDependency[Runtime]
    ) -> dict[str, Any]:
        return await _suspension(runtime, name, request, True)

    @post(
        "/unsuspend",
        status_code=200,
        summary="Serve one API key again after a suspension (audited)",
    )
    async def unsuspend_key(
        self, name: FromPath[str], request: Request, runtime: NamedDependency[Runtime]
    ) -> dict[str, Any]:
        return await _suspension(runtime, name, request, False)
