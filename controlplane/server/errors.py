"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response


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
                "message": self.message,
                "type": self.type,
                "param": self.param,
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
    """Litestar's own errors (404 route, 405, bad body) in OpenAI's shape too."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or str(exc) or "error"
    kind = "invalid_request_error" if status < 500 else "server_error"
    return Response(
        {"error": {"message": detail, "type": kind, "param": None, "code": None}},
        status_code=status,
    )
