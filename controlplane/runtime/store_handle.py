"""The daemon's SQL store, as the layers above the runtime reach it: `db` for the daemon and the
jobs that write, `read` for the admin API's queries (in a worker thread, never on the event
loop). The daemon opens the store before it loads the model; until then there is none."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from sqlalchemy import Engine as SQLEngine

T = TypeVar("T")


class StoreNotOpenError(RuntimeError):
    """The daemon has not opened its store yet."""


class StoreHandle:
    def __init__(self) -> None:
        self.db: SQLEngine | None = None  # set by the daemon once the store is open

    @property
    def is_open(self) -> bool:
        return self.db is not None

    async def read(self, query: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`query(db, *args, **kwargs)` in a worker thread; StoreNotOpenError before the store
        is open."""
        db = self.db
        if db is None:
            raise StoreNotOpenError("the store is not open yet")
        return await asyncio.to_thread(query, db, *args, **kwargs)
