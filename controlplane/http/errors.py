"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response

log = logging.getLogger("controlplane.api")


def printable(text: str) -> str:
    """`text` with lone surrogates (valid in a Python str, invalid in UTF-8) escaped as \\udXXX,
    so an error that quotes hostile input can always be serialized."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": printable(self.message),
                "type": self.type,
                "param": None if self.param is None else printable(self.param),
                "code": self.code,
            }
        }


def invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def unavailable(message: str, retry_after: int = 5) -> APIError:
    return APIError(
        503,
        message,
        type="service_unavailable",
        code="unavailable",
        headers={"Retry-After": str(retry_after)},
    )


def handle_api_error(_: Request, exc: APIError) -> Response:
    return Response(exc.body(), status_code=exc.status, headers=exc.headers)


def handle_http_exception(_: Request, exc: Exception) -> Response:
    """Litestar's own errors (404 route, 405, a query parameter of the wrong type) in OpenAI's
    shape too."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or str(exc) or "error"
    param = None
    extra = getattr(exc, "extra", None)
    if isinstance(extra, list) and extra and isinstance(extra[0], dict):
        # A validation error: name the parameter, as our own errors do.
        param = extra[0].get("key")
        detail = f"{param}: {extra[0].get('message', detail)}" if param else detail
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = dict(getattr(exc, "headers", None) or {})
    return handle_api_error(
        _, APIError(status, str(detail), type=kind, param=param, headers=headers)
    )


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than the limit of {limit} bytes (server.max_body_bytes)",
        param="body",
        code="request_too_large",
    )


def handle_unexpected(_: Request, exc: Exception) -> Response:
    """Anything else is a bug: log it with its traceback, answer a 500 in the usual shape."""
    log.error("unhandled error in a request handler", exc_info=exc)
    error = APIError(500, f"internal error ({type(exc).__name__})", type="server_error")
    return handle_api_error(_, error)
