"""Price history: configured prices are appended to the `prices` table, never changed.

Costs are computed once, when a request's final record is written, with the price in force at
the request's arrival time, and stored with the price's id. A later price (or a corrected
config) therefore only affects requests that arrive under it; stored history is immutable.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, select

from controlplane.config import Price
from controlplane.store.db import dialect_insert
from controlplane.store.models import PriceEntry

log = logging.getLogger(__name__)

PRICES = PriceEntry.__table__

ANY_MODEL = "*"
_PRICE_FIELDS = ("prompt_per_mtok", "cached_prompt_per_mtok", "completion_per_mtok")


@dataclass(frozen=True, slots=True)
class PriceRow:
    """A row of the `prices` table (an immutable snapshot, safe to share between threads)."""

    id: int
    model: str
    effective_from: datetime
    prompt_per_mtok: float
    cached_prompt_per_mtok: float
    completion_per_mtok: float


def cost(price: PriceRow, prompt: int, cached: int, completion: int) -> float:
    """USD for one request: cached prompt tokens at their own rate, the rest of the prompt at the
    prompt rate, completion tokens at the completion rate."""
    cached = min(cached, prompt)  # defensive: never price a negative number of uncached tokens
    return (
        (prompt - cached) * price.prompt_per_mtok
        + cached * price.cached_prompt_per_mtok
        + completion * price.completion_per_mtok
    ) / 1e6


def sync_prices(bind: Engine | Connection, prices: Iterable[Price]) -> int:
    """Insert the configured prices that the table lacks, keyed by (model, effective_from).

    Existing rows are never updated or deleted: a config entry whose key exists with different
    amounts is ignored with a warning (add a new entry with a later effective_from instead).
    Returns the number of rows inserted. With a Connection, the caller's transaction holds the
    rows (the daemon writes them with the config change's audit rows: both or neither).
    """
    prices = list(prices)
    if not prices:
        return 0
    with _transaction(bind) as conn:
        existing = {(r.model, r.effective_from): r for r in conn.execute(select(PRICES))}
        new: dict[tuple[str, datetime], dict[str, Any]] = {}
        for p in prices:
            key = (p.model, p.effective_from.astimezone(UTC))
            values = {f: float(getattr(p, f)) for f in _PRICE_FIELDS}
            if key in existing:
                row = existing[key]
                if _differs(values, {f: getattr(row, f) for f in _PRICE_FIELDS}):
                    log.warning(
                        "price for model %r from %s differs from the stored one (id %d); the "
                        "stored price is kept: history never changes, add a price with a later "
                        "effective_from instead",
                        key[0],
                        key[1].isoformat(),
                        row.id,
                    )
            elif key in new:
                if _differs(values, new[key]):
                    log.warning(
                        "price for model %r from %s is configured twice with different "
                        "amounts; the first is used",
                        key[0],
                        key[1].isoformat(),
                    )
            else:
                new[key] = {"model": key[0], "effective_from": key[1], **values}
        if new:
            insert = dialect_insert(conn.dialect.name)
            # DO NOTHING: another daemon sharing the database may insert the same price first.
            stmt = insert(PRICES).on_conflict_do_nothing(index_elements=["model", "effective_from"])
            conn.execute(stmt, list(new.values()))
    if new and isinstance(bind, Engine):  # a caller's transaction may still roll back
        log.info("added %d price(s) to the price history", len(new))
    return len(new)


@contextlib.contextmanager
def _transaction(bind: Engine | Connection) -> Iterator[Connection]:
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            yield conn
    else:
        yield bind


def _differs(a: dict[str, float], b: dict[str, float]) -> bool:
    # Stored with 9 decimals: compare at that precision.
    return any(round(a[f], 9) != round(b[f], 9) for f in _PRICE_FIELDS)


class PriceBook:
    """All prices, indexed for `lookup` by model and time."""

    def __init__(self, rows: Iterable[PriceRow] = ()) -> None:
        self._by_model: dict[str, list[PriceRow]] = {}
        for row in sorted(rows, key=lambda r: r.effective_from):
            self._by_model.setdefault(row.model, []).append(row)
        self._starts = {m: [r.effective_from for r in rs] for m, rs in self._by_model.items()}

    @classmethod
    def load(cls, bind: Engine | Connection) -> PriceBook:
        stmt = select(PRICES)
        if isinstance(bind, Engine):
            with bind.connect() as conn:
                entries = conn.execute(stmt).all()
        else:
            entries = bind.execute(stmt).all()
        return cls(
            PriceRow(
                id=e.id,
                model=e.model,
                effective_from=e.effective_from,
                **{f: float(getattr(e, f)) for f in _PRICE_FIELDS},
            )
            for e in entries
        )

    @property
    def rows(self) -> list[PriceRow]:
        return [r for rs in self._by_model.values() for r in rs]

    def lookup(self, model: str, at: datetime) -> PriceRow | None:
        """The price in force for `model` at `at`: the latest effective_from <= at.

        A price for the exact model wins over "*" whenever one is in force, even if a newer "*"
        price exists: a model-specific price is an explicit override.
        """
        for m in (model, ANY_MODEL):
            starts = self._starts.get(m)
            if starts:
                i = bisect.bisect_right(starts, at)
                if i:
                    return self._by_model[m][i - 1]
        return None
