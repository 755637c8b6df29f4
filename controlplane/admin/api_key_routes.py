"""/admin/keys: the API keys of the api_keys table (controlplane.tenants.keys), managed live.

    GET   /admin/keys                 every key with its live usage (controlplane.tenants.usage)
                                      and a budgeted one with its spend, worst first (?sort=):
                                      never a secret
    POST  /admin/keys                 create one; its secret is in this answer only
    PATCH /admin/keys/{name}          limits, budget, expiry, allowed models, priority, owner
    POST  /admin/keys/{name}/rotate   a new secret (in this answer only); the old one stops
    POST  /admin/keys/{name}/revoke   the key stops on every daemon within server.key_refresh_s

Every change is written with its audit rows (config_changes, field `api_keys.<name>[.field]`,
who = the admin token's name) in one transaction; never a secret or hash in them. The config
file's `[[api_keys]]` are listed too (`source: config`), read-only. Suspending and aborting a
key (either kind) stay in key_routes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Controller, Request, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery

from controlplane.admin.support import source, unprocessable
from controlplane.errors import FieldError
from controlplane.http.body import load_json
from controlplane.http.errors import APIError
from controlplane.runtime.store_handle import StoreNotOpenError
from controlplane.tenants.keys import Audit, KeyConflictError, KeyNotFoundError, KeyStore
from controlplane.tenants.usage import OPEN, SORTS, sort_key

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime


def _store(runtime: Runtime) -> KeyStore:
    if runtime.store.db is None:
        raise APIError(503, "the store is not open yet", type="unavailable", code="loading")
    return KeyStore(runtime.store.db)


async def _body(request: Request) -> dict[str, Any]:
    body = load_json(await request.body(), unique_keys=True)
    if not isinstance(body, dict):
        raise unprocessable("body", "must be a JSON object", 400)
    return body


async def _call(runtime: Runtime, fn: Any, *args: Any) -> Any:
    """A KeyStore call in a worker thread, its errors as the API's; then this daemon's copy of
    the table is reloaded, so that the change holds here at once."""
    try:
        result = await runtime.store.read(lambda _db: fn(*args))
    except StoreNotOpenError:
        raise APIError(
            503, "the store is not open yet", type="unavailable", code="loading"
        ) from None
    except FieldError as exc:
        raise unprocessable(exc.field, exc.message) from None
    except KeyConflictError as exc:
        raise unprocessable(exc.field, exc.message, 409) from None
    except KeyNotFoundError as exc:
        raise APIError(
            404,
            f"api key {exc.args[0]!r} is not in the api_keys table",
            param="name",
            code="not_found",
        ) from None
    await runtime.keys.reload(runtime.store.db)
    return result


def _audit(runtime: Runtime, request: Request) -> Audit:
    return Audit(runtime.instance_id, source(request), request.state.actor)


class ApiKeysController(Controller):
    path = "/keys"

    @get("/", summary="API keys with their live usage, worst first (?sort=)")
    async def list_keys(
        self, runtime: NamedDependency[Runtime], sort: FromQuery[str] = "worst"
    ) -> dict[str, Any]:
        if sort not in SORTS:
            raise unprocessable("sort", f"must be one of {', '.join(SORTS)}, got {sort!r}", 400)
        store = _store(runtime)
        keys = await _call(runtime, store.list)
        suspended = set(runtime.cfg.server.suspended_keys)
        for k in keys:
            k["source"] = "table"
            k["suspended"] = k["name"] in suspended
            # Spend against the budget in the current period, as this daemon sees it.
            standing = runtime.budgets.standing(k["name"]) if k["state"] == "active" else None
            if standing is not None:
                k["budget"].update(standing.view())
        configured = [
            {
                "name": k.name,
                "source": "config",
                "state": "active",
                "suspended": k.name in suspended,
                "priority_class": 0,
            }
            for k in runtime.cfg.api_keys
        ]
        keys += configured
        # The open API's anonymous requests (no key anywhere), once it has had any.
        if OPEN in runtime.usage.names():
            keys.append({"name": OPEN, "source": "open", "state": "active", "priority_class": 0})
        views = runtime.usage.views([k["name"] for k in keys])
        for k in keys:
            k["usage"] = views[k["name"]].view()
        keys.sort(key=sort_key(sort))
        return {"keys": keys, "sort": sort, "key_refresh_s": runtime.cfg.server.key_refresh_s}

    @post("/", status_code=201, summary="Create an API key; its secret is shown this once")
    async def create_key(
        self, request: Request, runtime: NamedDependency[Runtime]
    ) -> dict[str, Any]:
        body = await _body(request)
        store = _store(runtime)
        names = [k.name for k in runtime.cfg.api_keys]
        view, secret = await _call(runtime, store.create, body, _audit(runtime, request), names)
        await runtime.budgets.refresh(runtime.store.db)  # its budget holds here at once
        return {**view, "secret": secret}

    @patch("/{name:str}", summary="Change an API key's limits, budget, expiry, models (audited)")
    async def update_key(
        self, name: FromPath[str], request: Request, runtime: NamedDependency[Runtime]
    ) -> dict[str, Any]:
        body = await _body(request)
        if not body:
            raise unprocessable("body", "must name at least one field to change", 400)
        store = _store(runtime)
        view = await _call(runtime, store.update, name, body, _audit(runtime, request))
        await runtime.budgets.refresh(runtime.store.db)  # a budget changed holds here at once
        return view

    @post("/{name:str}/rotate", status_code=200, summary="A new secret (shown once) (audited)")
    async def rotate_key(
        self, name: FromPath[str], request: Request, runtime: NamedDependency[Runtime]
    ) -> dict[str, Any]:
        store = _store(runtime)
        view, secret = await _call(runtime, store.rotate, name, _audit(runtime, request))
        return {**view, "secret": secret}

    @post("/{name:str}/revoke", status_code=200, summary="Revoke an API key (audited)")
    async def revoke_key(
        self, name: FromPath[str], request: Request, runtime: NamedDependency[Runtime]
    ) -> dict[str, Any]:
        store = _store(runtime)
        view, changed = await _call(runtime, store.revoke, name, _audit(runtime, request))
        return {**view, "changed": changed}
