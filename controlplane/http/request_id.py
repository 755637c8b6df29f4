"""X-Request-Id: the client's id for a request (printable ASCII, once, at most
MAX_REQUEST_ID_CHARS), or one generated for it; resolved once per request and kept in the ASGI
scope, so the handler and the hook that echoes the header see the same one."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from controlplane.store.records import MAX_X_REQUEST_ID_CHARS

# X-Request-Id is stored in the request row (requests.x_request_id): its column's length.
MAX_REQUEST_ID_CHARS = MAX_X_REQUEST_ID_CHARS
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]+")

_REQUEST_ID_STATE = "controlplane.request_id"  # the resolved id, kept in the ASGI scope's state
# Generated ids look like the response ids of each endpoint (`cmpl-...`), so a client that sent
# no X-Request-Id gets back its response's `id`.
_ID_PREFIXES = {
    "/v1/completions": "cmpl",
    "/v1/chat/completions": "chatcmpl",
    "/v1/responses": "resp",
}
# OpenAI's Responses ids are `resp_<hex>` (an underscore); the other endpoints' use a hyphen.
_SEPARATORS = {"resp": "_"}


@dataclass(frozen=True, slots=True)
class RequestId:
    """A /v1 request's X-Request-Id: the client's, or one generated for it.

    `error` says why the client's header was refused: the handler then answers 400 naming the
    header (the response still carries the generated id, for the logs).
    """

    value: str
    from_client: bool
    error: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}{_SEPARATORS.get(prefix, '-')}{uuid.uuid4().hex}"


def request_id(scope: Any) -> RequestId:
    """The request's X-Request-Id, resolved once per request (the handler and the hook that
    adds the response header see the same one)."""
    state = scope.setdefault("state", {})
    found = state.get(_REQUEST_ID_STATE)
    if found is None:
        found = state[_REQUEST_ID_STATE] = _resolve_request_id(scope)
    return found


def _resolve_request_id(scope: Any) -> RequestId:
    sent = [v for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"]
    generated = new_id(_ID_PREFIXES.get(scope.get("path", ""), "req"))
    if not sent or sent == [b""]:  # an empty header (a proxy's template) counts as none
        return RequestId(generated, from_client=False)
    if len(sent) > 1:
        return RequestId(generated, False, "must be sent at most once")
    raw = sent[0]
    if len(raw) > MAX_REQUEST_ID_CHARS:
        return RequestId(
            generated, False, f"is {len(raw)} characters long; the limit is {MAX_REQUEST_ID_CHARS}"
        )
    text = raw.decode("latin-1")  # how HTTP header bytes map to characters
    if not _PRINTABLE_ASCII.fullmatch(text):
        return RequestId(generated, False, "must be printable ASCII (characters 0x20 to 0x7e)")
    return RequestId(text, from_client=True)
