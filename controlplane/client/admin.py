"""A daemon's admin REST API and its SSE stream (httpx): the dashboard's only way to a daemon,
and how fleet actions reach each instance. Torch-free.

Every method is async and raises `APIError` for an HTTP error answer (with the API's message
and param), `Unreachable` when the daemon cannot be reached, or `NotTheMember` when a fleet
client's answer is not signed by the instance it asked; nothing else escapes.

A fleet client (`signer`: controlplane.http.signing) sends no token: it signs each request for
the instance the fleet table names and accepts only answers that instance signed. No client
follows redirects.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from controlplane.http.signing import CHANGE_ID_HEADER, NONCE_HEADER, SOURCE_HEADER, Signer


class ClientError(Exception):
    """Base of the errors the client raises."""


class Unreachable(ClientError):
    """No answer from the daemon (connection refused, reset, timed out)."""


class NotTheMember(ClientError):
    """A fleet answer without the signature of the instance asked: another daemon or not a
    fleet member answers at that URL (or it has another admin token)."""


class APIError(ClientError):
    """The daemon answered with an error status; `message` / `param` come from its body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.param = param


class AdminClient:
    """Async client for `/admin/*` and `/health` of one daemon; `source` is what its writes
    say they came from in the audit log ("tui" or "fleet")."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout: float = 10.0,
        source: str = "tui",
        signer: Signer | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        # A fleet client signs instead: the token never goes to a URL read from the database.
        headers = {"Authorization": f"Bearer {token}"} if token and signer is None else {}
        self._source = {SOURCE_HEADER: source}
        self._signer = signer
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout, follow_redirects=False
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            if self._signer is None:
                r = await self._http.request(method, path, **kwargs)
            else:
                r = await self._signed(method, path, **kwargs)
        except httpx.HTTPError as exc:  # connect / read errors, timeouts, protocol errors
            raise Unreachable(_describe(exc)) from None
        if 300 <= r.status_code < 400:
            where = r.headers.get("location", "?")
            raise APIError(r.status_code, f"redirected to {where[:200]}: not followed")
        if r.status_code >= 400:
            raise _api_error(r.status_code, r.text)
        try:
            return r.json()
        except ValueError:
            raise APIError(r.status_code, "the daemon sent a body that is not JSON") from None

    async def _signed(
        self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        """Send a request signed for the signer's instance; its answer unless that answer is
        not signed by that instance (NotTheMember), or APIError 401 where it was refused."""
        assert self._signer is not None
        extra = {"timeout": timeout} if timeout is not None else {}
        request = self._http.build_request(method, path, **kwargs, **extra)
        target = path + (f"?{request.url.query.decode('ascii')}" if request.url.query else "")
        signed = self._signer.headers(
            method,
            target,
            request.content,
            source=request.headers.get(SOURCE_HEADER, ""),
            change_id=request.headers.get(CHANGE_ID_HEADER, ""),
        )
        request.headers.update(signed)
        r = await self._http.send(request, follow_redirects=False)
        await r.aread()
        if r.status_code == 401:
            raise APIError(
                401,
                f"{self.url} refused the request signed for instance {self._signer.instance!r} "
                "(another instance answers there, or it has another admin token)",
            )
        if 300 <= r.status_code < 400:
            return r  # reported as a redirect not followed: never taken for the change applied
        if not self._signer.answered_by_instance(
            signed[NONCE_HEADER], r.status_code, r.headers, r.content
        ):
            raise NotTheMember(
                f"the answer from {self.url} is not signed by instance "
                f"{self._signer.instance!r} (another daemon, or no fleet member, answers there)"
            )
        return r

    # -- reads -------------------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        return await self._request("GET", "/health")

    async def stats(self) -> dict[str, Any]:
        return await self._request("GET", "/admin/stats")

    async def block_map(self, buckets: int = 48) -> tuple[list[float], list[float]]:
        """Fractions of KV blocks in use, and cached but unused, per range of block ids."""
        body = await self._request("GET", "/admin/stats", params={"block_map": buckets})
        return body.get("kv_block_map") or [], body.get("kv_block_map_cached") or []

    async def config(self) -> dict[str, Any]:
        return await self._request("GET", "/admin/config")

    async def history(self, limit: int = 50) -> dict[str, Any]:
        return await self._request("GET", "/admin/config/history", params={"limit": limit})

    async def requests(self) -> dict[str, Any]:
        return await self._request("GET", "/admin/requests", params={"limit": 1})

    async def costs(
        self,
        since: str = "1h",
        *,
        group_by: str = "model",
        scope: str | None = None,
        until: str | None = None,
    ) -> dict[str, Any]:
        """GET /admin/costs: `since` "5m" ... "24h" is an exact window (from the request rows),
        longer ones whole hours (rollups); `group_by` any of day|hour, model, api_key,
        end_user (comma-separated); `scope` "instance" (this daemon's requests) or "fleet"
        (every instance on its database; the daemon's default when None). The answer says
        its "source", "scope" and exact "since" / "until"."""
        params = {"since": since, "group_by": group_by}
        if scope is not None:
            params["scope"] = scope
        if until is not None:
            params["until"] = until
        return await self._request("GET", "/admin/costs", params=params)

    async def utilization(self, since: str = "1h") -> dict[str, Any]:
        return await self._request("GET", "/admin/utilization", params={"since": since})

    async def autopilot(self) -> dict[str, Any]:
        return await self._request("GET", "/admin/autopilot")

    async def patch_autopilot(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("PATCH", "/admin/autopilot", json=body, headers=self._source)

    async def fleet(self) -> dict[str, Any]:
        return await self._request("GET", "/admin/fleet")

    # -- writes ------------------------------------------------------------------------------
    async def patch_config(
        self, body: dict[str, Any], *, change_id: str | None = None, dry_run: bool = False
    ) -> dict[str, Any]:
        """Change live settings; `dry_run`: only validate (what would change)."""
        headers = dict(self._source)
        if change_id is not None:
            headers[CHANGE_ID_HEADER] = change_id
        params = {"dry_run": "true"} if dry_run else None
        return await self._request(
            "PATCH", "/admin/config", json=body, headers=headers, params=params
        )

    async def simulate(self, body: dict[str, Any], window_s: float = 900.0) -> dict[str, Any]:
        """What the change `body` (as patch_config takes it) would do to the last `window_s`
        of traffic, simulated (POST /admin/simulate); nothing is applied."""
        return await self._request(
            "POST", "/admin/simulate", json=body, params={"window_s": window_s}, timeout=60.0
        )

    async def patch_fleet_config(self, body: dict[str, Any]) -> dict[str, Any]:
        """A fleet-wide change through this daemon (PATCH ?scope=fleet)."""
        return await self._request(
            "PATCH",
            "/admin/config",
            json=body,
            headers=self._source,
            params={"scope": "fleet"},
            timeout=60.0,
        )

    async def abort(self, request_id: str) -> dict[str, Any]:
        return await self._request(
            "POST", f"/admin/requests/{request_id}/abort", headers=self._source
        )

    async def drain(self) -> dict[str, Any]:
        return await self._request("POST", "/admin/drain", headers=self._source)

    async def resume(self) -> dict[str, Any]:
        return await self._request("POST", "/admin/resume", headers=self._source)

    async def cache_reset(self) -> dict[str, Any]:
        return await self._request("POST", "/admin/cache/reset", headers=self._source)

    # -- stream ------------------------------------------------------------------------------
    async def events(self, interval: float = 0.5) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield (event, data) from `/admin/events` until the stream ends or breaks."""
        timeout = httpx.Timeout(10.0, read=max(20.0, interval * 4))
        try:
            async with self._http.stream(
                "GET", "/admin/events", params={"interval": interval}, timeout=timeout
            ) as r:
                if r.status_code >= 400:
                    raise _api_error(r.status_code, (await r.aread()).decode(errors="replace"))
                event, data = "message", []
                async for line in r.aiter_lines():
                    if not line:
                        payload = _parse(data)
                        if payload is not None:
                            yield event, payload
                        event, data = "message", []
                    elif line.startswith(":"):
                        continue
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip())
        except httpx.HTTPError as exc:
            raise Unreachable(_describe(exc)) from None

    # -- tenants and persistence -------------------------------------------------------------
    async def suspend_key(self, name: str) -> dict[str, Any]:
        """Refuse new requests of API key `name` (403; running ones go on): {"api_key_name",
        "suspended": true, "changed", "suspended_keys"}. APIError 404: no such key."""
        return await self._request(
            "POST", f"/admin/keys/{_segment(name)}/suspend", headers=self._source
        )

    async def unsuspend_key(self, name: str) -> dict[str, Any]:
        """Serve API key `name` again: {"api_key_name", "suspended": false, "changed",
        "suspended_keys"}."""
        return await self._request(
            "POST", f"/admin/keys/{_segment(name)}/unsuspend", headers=self._source
        )

    async def abort_key(self, name: str) -> dict[str, Any]:
        """Abort every live request of API key `name`: {"api_key_name", "aborted", "ids"}."""
        return await self._request(
            "POST", f"/admin/keys/{_segment(name)}/abort", headers=self._source
        )

    async def keys(self, sort: str | None = None) -> dict[str, Any]:
        """The API keys (the api_keys table's and the config file's) with their live usage:
        {"keys": [...], "sort", "key_refresh_s"}, worst first unless `sort` names another
        order (controlplane.tenants.usage.SORTS); never a secret."""
        params = {"sort": sort} if sort else None
        return await self._request("GET", "/admin/keys", params=params)

    async def create_key(self, body: dict[str, Any]) -> dict[str, Any]:
        """A new table key; its `secret` is in this answer only. APIError 422 / 409 naming
        the field."""
        return await self._request("POST", "/admin/keys", json=body, headers=self._source)

    async def update_key(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Change a table key's limits, budget, expiry, allowed models, priority or owner."""
        return await self._request(
            "PATCH", f"/admin/keys/{_segment(name)}", json=body, headers=self._source
        )

    async def rotate_key(self, name: str) -> dict[str, Any]:
        """A new secret (`secret`, in this answer only); the old one stops."""
        return await self._request(
            "POST", f"/admin/keys/{_segment(name)}/rotate", headers=self._source
        )

    async def revoke_key(self, name: str) -> dict[str, Any]:
        """Revoke a table key: it stops on every daemon within server.key_refresh_s."""
        return await self._request(
            "POST", f"/admin/keys/{_segment(name)}/revoke", headers=self._source
        )

    async def save_config(self) -> dict[str, Any]:
        """Write the live values into the daemon's config file: {"path", "saved": [{"field",
        "value"}]}; APIError 409 (with the reason) when there is no file, it cannot be read
        or written, or it is not the file the daemon last applied. A longer timeout than other
        calls: the daemon bounds each read and write of the file (5 s; a hung mount), and may
        first wait for a reload's."""
        return await self._request("POST", "/admin/config/save", headers=self._source, timeout=30.0)


def _segment(name: str) -> str:
    """`name` as one URL path segment (a key name may hold "/" or "?")."""
    from urllib.parse import quote

    return quote(name, safe="")


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _parse(data: list[str]) -> dict[str, Any] | None:
    try:
        payload = json.loads("\n".join(data)) if data else None
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def _api_error(status: int, text: str) -> APIError:
    try:
        err = json.loads(text).get("error") or {}
        if isinstance(err, dict):
            return APIError(status, str(err.get("message") or text), err.get("param"))
        return APIError(status, str(err))
    except (ValueError, AttributeError):
        return APIError(status, text.strip()[:200] or f"HTTP {status}")
