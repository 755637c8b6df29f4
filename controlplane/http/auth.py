"""Admin bearer tokens: named, compared in constant time, generated on first start if none.

A missing and a wrong token get the same 401: the response never says which part was wrong.
Fleet requests carry no token but a signature made with a key derived from one
(controlplane.http.signing); the admin routes take either, `fleet_guard`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from litestar.connection import ASGIConnection, Request
from litestar.exceptions import HTTPException, NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.status_codes import HTTP_413_REQUEST_ENTITY_TOO_LARGE

from controlplane.config import AdminToken, Config
from controlplane.http.signing import Verified, Verifier, is_signed, sign_response

log = logging.getLogger("controlplane.admin")

TOKEN_FILE = "admin_token"
ENV_TOKEN = "CONTROLPLANE_ADMIN_TOKEN"
ASCII_WHITESPACE = " \t\r\n\x0b\x0c"


def token_path(cfg: Config) -> Path:
    return cfg.data_path / TOKEN_FILE


def resolve_tokens(
    cfg: Config, env: dict[str, str] | None = None
) -> tuple[list[AdminToken], Path | None]:
    """Configured tokens, plus CONTROLPLANE_ADMIN_TOKEN (named "env"); if there are none,
    the token in <data_dir>/admin_token, created with mode 0600 on first start.
    Returns the tokens and the file's path when the file is the source."""
    env = os.environ if env is None else env
    tokens = list(cfg.admin_tokens)
    if env.get(ENV_TOKEN):
        tokens.append(AdminToken("env", env[ENV_TOKEN]))
    if tokens:
        return tokens, None
    path = token_path(cfg)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Create with 0600 from the start: never a moment where others can read it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        log.info("generated an admin token in %s", path)
    return [AdminToken("local", path.read_text().strip())], path


def match_bearer(authorization: str | None, secrets: Sequence[bytes]) -> int | None:
    """Index of the secret an `Authorization: Bearer <secret>` header carries, or None.

    Every secret is compared, in constant time, so timing says nothing about which matched.
    """
    if not authorization or authorization[:7].lower() != "bearer ":
        return None
    # Only ASCII whitespace is padding: str.strip() would also drop a non-breaking space
    # (U+00A0, a latin-1 header byte) or U+3000, accepting a header that is not the token.
    given = authorization[7:].strip(ASCII_WHITESPACE).encode()
    found = None
    for i, secret in enumerate(secrets):
        if hmac.compare_digest(given, secret):
            found = i
    return found


# Where a verified fleet request leaves what its answer is signed with (connection state).
FLEET_STATE = "fleet_request"


class AdminAuth:
    def __init__(self, tokens: list[AdminToken]) -> None:
        self._names = [t.name for t in tokens]
        self._secrets = [t.token.encode() for t in tokens]
        self._tokens = [t.token for t in tokens]

    def actor(self, authorization: str | None) -> str | None:
        """The token's name, or None."""
        i = match_bearer(authorization, self._secrets)
        return None if i is None else self._names[i]

    def guard(self, connection: ASGIConnection, _: BaseRouteHandler) -> None:
        actor = self.actor(connection.headers.get("authorization"))
        if actor is None:
            raise NotAuthorizedException(
                "a valid admin token is required (Authorization: Bearer <token>)"
            )
        connection.state.actor = actor

    def fleet_guard(self, instance_id: str):
        """The admin routes' guard: a bearer token, or a fleet signature made for this
        instance (`instance_id`) with one of its tokens. A signed request is marked as part
        of a fleet operation (it never starts another) and its answer gets signed
        (`fleet_answers`); a refused one gets the same 401 as a wrong token."""
        verifier = Verifier(self._tokens, instance_id)

        async def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
            if not is_signed(connection.headers):
                return self.guard(connection, handler)
            scope = connection.scope
            path = scope["path"]
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
            # Authentication before the body (issue 52): what needs no body is checked first,
            # and a body over server.max_body_bytes is never verified, so an unauthenticated
            # request is 401 whatever its size, never told the limit (413).
            found: Verified | str | None = verifier.check_headers(
                scope["method"], path, connection.headers
            )
            if found is None:
                try:
                    body = await Request(scope, connection.receive).body()
                except HTTPException as exc:
                    if exc.status_code != HTTP_413_REQUEST_ENTITY_TOO_LARGE:
                        raise
                    found = "body over server.max_body_bytes: its signature cannot be checked"
                else:
                    await asyncio.to_thread(lambda: verifier.keys)  # PBKDF2, once: off the loop
                    found = verifier.verify(scope["method"], path, connection.headers, body)
            if not isinstance(found, Verified):
                log.warning("fleet request refused: %s", found)
                raise NotAuthorizedException(
                    "a valid admin token is required (Authorization: Bearer <token>)"
                )
            connection.state.actor = self._names[found.index]
            connection.state[FLEET_STATE] = found

        return guard


def fleet_answers(app):
    """ASGI middleware for the admin routes: the answer to a verified fleet request carries
    this instance's signature over its id, the request's nonce, the status and the body."""

    async def middleware(scope, receive, send) -> None:
        if scope["type"] != "http" or not is_signed_scope(scope):
            return await app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def buffered(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = dict(message)
                return
            if message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            assert start is not None
            body = b"".join(chunks)
            found = (scope.get("state") or {}).get(FLEET_STATE)
            if isinstance(found, Verified):
                headers = [*start.get("headers", ()), *sign_response(found, start["status"], body)]
                start["headers"] = headers
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await app(scope, receive, buffered)

    return middleware


def is_signed_scope(scope) -> bool:
    return any(k == b"x-controlplane-fleet-signature" for k, _ in scope.get("headers", ()))
