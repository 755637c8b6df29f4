"""Admin bearer tokens: named, compared in constant time, generated on first start if none.

A missing and a wrong token get the same 401: the response never says which part was wrong.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler

from controlplane.config import AdminToken, Config

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


class AdminAuth:
    def __init__(self, tokens: list[AdminToken]) -> None:
        self._names = [t.name for t in tokens]
        self._secrets = [t.token.encode() for t in tokens]

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
