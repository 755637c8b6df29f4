"""At daemon start, what a previous process left: the records it journaled but may not have
committed (`replay_journal`, first), then its rows still "running" (`mark_interrupted`)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import URL, Engine, bindparam, select, update

from controlplane.store.db import make_engine
from controlplane.store.journal import read_journal
from controlplane.store.prices import PriceBook, cost
from controlplane.store.recorder import (
    REQUESTS,
    as_utc,
    collapse,
    is_outage,
    row_values,
    upsert_statement,
)

log = logging.getLogger("controlplane.store.recorder")  # the same log lines as before the split


def mark_interrupted(engine: Engine | str | URL, instance_id: str) -> int:
    """At daemon start: this instance's rows still "running" belong to a previous process that
    died or was killed; mark them interrupted. Returns how many rows were marked."""
    own = not isinstance(engine, Engine)
    eng = make_engine(engine) if own else engine
    c = REQUESTS.c
    try:
        with eng.begin() as conn:
            left = conn.execute(
                select(
                    c.id,
                    c.model,
                    c.arrival_time,
                    c.prompt_tokens,
                    c.cached_prompt_tokens,
                    c.completion_tokens,
                ).where(c.instance_id == instance_id, c.status == "running")
            ).all()
            # Priced like every final row, on the tokens the row carries: the prompt, and the
            # completion tokens of its last progress record (runtime.ledger.PROGRESS_INTERVAL_S).
            book = PriceBook.load(conn) if left else None
            now = datetime.now(UTC)
            values = []
            for row in left:
                price = book.lookup(row.model, as_utc(row.arrival_time)) if book else None
                values.append(
                    {
                        "row_id": row.id,
                        "new_price_id": price.id if price else None,
                        "new_cost_usd": cost(
                            price,
                            row.prompt_tokens,
                            row.cached_prompt_tokens,
                            row.completion_tokens,
                        )
                        if price
                        else None,
                    }
                )
            if values:
                conn.execute(
                    update(REQUESTS)
                    .where(c.id == bindparam("row_id"), c.status == "running")
                    .values(
                        status="interrupted",
                        finish_reason="interrupted",
                        finish_time=now,
                        price_id=bindparam("new_price_id"),
                        cost_usd=bindparam("new_cost_usd"),
                    ),
                    values,
                )
            count = len(values)
    finally:
        if own:
            eng.dispose()
    if count:
        log.warning("marked %d request(s) left running by a previous run as interrupted", count)
    return count


def replay_journal(engine: Engine, directory: str | Path, batch_size: int = 500) -> int:
    """At daemon start, before `mark_interrupted`: write the records a previous process of this
    instance journaled but may not have committed (it was killed), then delete its journal.

    Upserts by the usual rule, so rows already written are unchanged and a final record wins
    over "running"; requests whose last record is "running" are then marked interrupted by
    `mark_interrupted`. Returns how many requests the journal held. Damaged lines (a torn last
    line after a power loss) are skipped and counted in the log."""
    files, records, damaged = read_journal(Path(directory))
    if not files:
        return 0
    rows = collapse(records)
    stmt = upsert_statement(engine.dialect.name)
    with engine.connect() as conn:
        book = PriceBook.load(conn)
    rejected = 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        try:
            with engine.begin() as conn:
                conn.execute(stmt, [row_values(r, book) for r in batch])
        except Exception as exc:
            if is_outage(exc):
                raise  # the journal stays for the next start
            # A record the database refuses must not block every later start: write the batch
            # one record at a time and skip (and count) the refused ones, as the writer does.
            for rec in batch:
                try:
                    with engine.begin() as conn:
                        conn.execute(stmt, [row_values(rec, book)])
                except Exception as one:
                    if is_outage(one):
                        raise
                    rejected += 1
                    log.error("journaled record %r rejected by the database: %s", rec.id, one)
    for path in files:
        path.unlink(missing_ok=True)
    running = sum(not r.is_final for r in rows)
    lost = [f"{damaged} damaged lines could not be read"] if damaged else []
    lost += [f"{rejected} records were rejected"] if rejected else []
    log.warning(
        "replayed the request journal of a previous run (%d files): %d requests, %d of them "
        "last journaled as running%s",
        len(files),
        len(rows),
        running,
        "; " + ", ".join(lost) if lost else "",
    )
    return len(rows)
