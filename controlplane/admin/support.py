"""What every admin controller shares: the error shape of a refused parameter, where a change
says it came from, time parameters, and store reads that answer 503 until the store opens."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from litestar import Request

from controlplane.common import parse_time
from controlplane.errors import FieldError
from controlplane.http.errors import APIError
from controlplane.http.signing import SOURCE_HEADER
from controlplane.runtime.store_handle import StoreNotOpenError

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime

T = TypeVar("T")

# Row ids and other integers bound into SQL: both databases store them as signed 64-bit.
MAX_SQL_INT = (1 << 63) - 1


class FinishedLookup:
    """How a recently finished request ended (None: unknown), so that aborting it answers 409
    rather than 404: the /v1 API's record, handed to the admin routes by controlplane.asgi
    (the two APIs never import each other). A class, not a bare callable, so that it can be
    a typed Litestar dependency."""

    __slots__ = ("_lookup",)

    def __init__(self, lookup: Callable[[str], str | None] | None) -> None:
        self._lookup = lookup

    def __call__(self, request_id: str) -> str | None:
        return None if self._lookup is None else self._lookup(request_id)


def source(request: Request) -> str:
    """Where a change says it came from (audit log): the TUI and fleet actions say so."""
    said = request.headers.get(SOURCE_HEADER, "").lower()
    return said if said in ("tui", "fleet") else "api"


def unprocessable(param: str, message: str, status: int = 422) -> APIError:
    kind = "conflict" if status == 409 else "invalid_request_error"
    return APIError(status, f"{param}: {message}", type=kind, param=param)


def time_param(name: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_time(name, value, relative=False)
    except FieldError as exc:
        raise unprocessable(exc.field, exc.message) from None


async def read_store(runtime: Runtime, query: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """A store query in a worker thread; 503 until the daemon has opened its store."""
    try:
        return await runtime.store.read(query, *args, **kwargs)
    except StoreNotOpenError:
        raise APIError(
            503, "the store is not open yet", type="unavailable", code="loading"
        ) from None
