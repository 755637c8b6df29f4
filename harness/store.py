"""A daemon's request rows, read from its store."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa


def rows(url: str, where: str = "1=1") -> list[dict[str, Any]]:
    """Every row of the requests table (matching `where`), as dicts."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [
                dict(r._mapping)
                for r in conn.execute(sa.text(f"SELECT * FROM requests WHERE {where}"))
            ]
    finally:
        engine.dispose()


def wait_rows(
    url: str,
    predicate: Callable[[list[dict[str, Any]]], bool],
    timeout: float = 20,
    where: str = "1=1",
) -> list[dict[str, Any]]:
    """The rows once `predicate(rows)` holds (the recorder writes in batches); AssertionError
    after `timeout` seconds. A store not created yet reads as no rows."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = rows(url, where)
        except sa.exc.OperationalError:
            found = []
        if predicate(found):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"rows never matched; last: {found}")
        time.sleep(0.1)
