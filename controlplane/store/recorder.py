"""The recorder: request records go to the database in batches, off the serving hot path.

`Recorder.submit` only appends to an in-memory deque under a lock; one daemon thread drains it,
writing up to `batch_size` records per transaction (a partial batch waits at most
`flush_interval_s`). Writes are upserts keyed by request id, so a request's start and finish
records collapse into one row, and a final status is never overwritten by "running".

When the database is unreachable the records stay in memory (at most `buffer_max_records`; the
oldest are dropped and counted beyond that) and the write is retried every `retry_interval_s`.
An outage logs one warning when it starts and one line when it ends, however long it lasts.

With a journal directory (`store.journal`, on by default) every submitted record is also
appended to a local journal (see controlplane.store.journal) until its batch is committed, so a
process killed outright loses nothing it had submitted: the next start replays the journal
(`replay_journal`, in store.recovery) before marking rows left "running" as interrupted
(`mark_interrupted`).
Records still unwritten at close (the database was down) stay in the journal for that replay.

Refused requests (`refused`: a rate limit's or budget's 429, a suspended key's 403, a full
queue) have no request row; the same writer counts them into `refusals` (migration 0014):
`refused` adds one to an in-memory count per (hour, instance, key, reason), and each write
adds the counts taken to their rows with an upsert (`requests = requests + excluded`), in
their own transaction after the batch's, as often as the records are written (a partial
batch's flush_interval_s; `flush` and `close` write them too). A count is taken out of memory
only for its write: a failed write puts it back (added to what came meanwhile), so an outage
loses nothing (the counts are a few per key an hour, never dropped for room) and a committed
write is never repeated. They are not journaled: a process killed outright loses at most
flush_interval_s of refusals; a clean stop writes them (`close`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Connection, Engine, or_
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError

from controlplane.config import StoreSettings
from controlplane.store.db import dialect_insert, make_engine
from controlplane.store.journal import Journal, encode
from controlplane.store.models import RefusalRow, RequestRow, time_buckets
from controlplane.store.prices import PriceBook, cost
from controlplane.store.records import RequestRecord

log = logging.getLogger(__name__)

REQUESTS = RequestRow.__table__
REFUSALS = RefusalRow.__table__
_STOP_GRACE_S = 1.0
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))
_TIME_FIELDS = ("arrival_time", "first_token_time", "finish_time")
_UPDATE_COLUMNS = tuple(c.name for c in REQUESTS.columns if c.name != "id")


def as_utc(value: datetime | None) -> datetime | None:
    # Records should carry aware UTC times; a naive one is taken as UTC rather than losing the
    # record (the column type refuses naive datetimes).
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def row_values(record: RequestRecord, book: PriceBook | None) -> dict[str, Any]:
    """The `requests` row for a record; final records are priced here, at ingest."""
    row = {name: getattr(record, name) for name in _RECORD_FIELDS}
    for name in _TIME_FIELDS:
        row[name] = as_utc(row[name])
    row["hour_bucket"], row["day_bucket"] = time_buckets(row["arrival_time"])
    price = book.lookup(record.model, row["arrival_time"]) if book and record.is_final else None
    row["price_id"] = price.id if price else None
    row["cost_usd"] = (
        cost(price, record.prompt_tokens, record.cached_prompt_tokens, record.completion_tokens)
        if price
        else None
    )
    return row


def collapse(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """One record per id, by the same rule as the upsert: a later record replaces an earlier
    one, except that "running" never replaces a final status. (PostgreSQL also refuses an
    upsert that touches one row twice in a statement.)"""
    latest: dict[str, RequestRecord] = {}
    for rec in records:
        prev = latest.get(rec.id)
        if prev is None or rec.is_final or not prev.is_final:
            latest[rec.id] = rec
    return list(latest.values())


def upsert_statement(dialect_name: str) -> Any:
    insert = dialect_insert(dialect_name)
    stmt = insert(REQUESTS)
    return stmt.on_conflict_do_update(
        index_elements=[REQUESTS.c.id],
        set_={name: stmt.excluded[name] for name in _UPDATE_COLUMNS},
        # A start record that arrives after the finish (or a retried one) must not turn a
        # final row back into "running".
        where=or_(REQUESTS.c.status == "running", stmt.excluded.status != "running"),
    )


def refusals_statement(dialect_name: str) -> Any:
    """The upsert that adds refusal counts to their (hour, instance, key, reason) rows."""
    insert = dialect_insert(dialect_name)
    stmt = insert(REFUSALS)
    return stmt.on_conflict_do_update(
        index_elements=[REFUSALS.c[name] for name in REFUSAL_KEY],
        set_={
            "requests": REFUSALS.c.requests + stmt.excluded.requests,
            "updated_at": stmt.excluded.updated_at,
        },
    )


# A refusal count's key: (hour_bucket, instance_id, api_key_name, reason), the table's.
REFUSAL_KEY = ("hour_bucket", "instance_id", "api_key_name", "reason")
RefusalKey = tuple[str, str, str, str]


def is_outage(exc: BaseException) -> bool:
    """True when the database cannot take writes right now (down, unreachable, locked, not
    migrated): keep the records and retry. False when the records themselves are rejected
    (constraint or data errors, values the driver cannot bind): retrying would fail forever."""
    return isinstance(exc, DBAPIError) and not isinstance(exc, IntegrityError | DataError)


class Recorder:
    """Batched, thread-backed writer of `RequestRecord`s (see the module docstring).

    Counters (thread-safe reads): `written` (records written), `dropped` (records lost: buffer
    overflow, rejected by the database, submitted after close, or unwritten at close),
    `buffered` (records held now, including the batch being written), `failed_writes` (write
    transactions that failed).
    """

    def __init__(
        self,
        url_or_engine: str | URL | Engine,
        settings: StoreSettings,
        *,
        price_refresh_s: float = 60.0,
        drop_log_interval_s: float = 10.0,
        journal_dir: str | Path | None = None,
    ) -> None:
        if isinstance(url_or_engine, Engine):
            self._engine, self._owns_engine = url_or_engine, False
        else:
            self._engine, self._owns_engine = make_engine(url_or_engine), True
        self.settings = settings
        self._stmt = upsert_statement(self._engine.dialect.name)
        self._price_refresh_s = price_refresh_s
        self._drop_log_interval_s = drop_log_interval_s
        self._journal = _open_journal(journal_dir) if journal_dir is not None else None

        # Shared state, guarded by _cond's lock. The writer never holds it during database I/O.
        self._cond = threading.Condition()
        self._buffer: deque[RequestRecord] = deque()
        self._inflight = 0  # records taken by the writer, not yet written or put back
        self._submitted = 0  # records accepted into the buffer, ever
        self._resolved = 0  # records that left it for good (written or dropped), ever
        self._written = 0
        self._dropped = 0
        self._failed_writes = 0
        self._drops_unlogged = 0
        self._flush_waiters = 0
        self._stopping = False
        self._warned_late_submit = False
        # Refused requests: counts per RefusalKey not written yet, and every refusal counted /
        # written or lost, ever (flush waits on these as on the records).
        self._refusals: dict[RefusalKey, int] = {}
        self._refused = 0
        self._refusals_resolved = 0
        self._refusals_written = 0
        self._refusals_lost = 0
        self._refusal_stmt = refusals_statement(self._engine.dialect.name)

        # Writer-thread state.
        self._book: PriceBook | None = None
        self._book_loaded_at = -math.inf
        self._outage_since: float | None = None  # monotonic time of the first failed write
        self._outage_written_from = 0  # `written` when the outage started
        self._recovery_target: int | None = None  # `resolved` at which the backlog is written
        self._drops_logged_at = -math.inf

        self._thread = threading.Thread(target=self._run, name="store-recorder", daemon=True)
        self._thread.start()

    # -- the daemon's side ------------------------------------------------------------------

    def submit(self, record: RequestRecord) -> None:
        """Queue a record for writing; never blocks on (or touches) the database."""
        if not self.settings.record_requests:
            return
        # Encoded before taking the lock, which the writer thread also needs.
        line = encode(record) if self._journal is not None else None
        warn_late = False
        with self._cond:
            if self._stopping:
                # Nothing will write it any more: count it rather than lose it silently.
                self._dropped += 1
                warn_late, self._warned_late_submit = not self._warned_late_submit, True
            else:
                buf = self._buffer
                buf.append(record)
                self._submitted += 1
                if self._journal is not None:
                    self._journal.append(record, line)
                if len(buf) > self.settings.buffer_max_records:
                    # The oldest goes: recent records are the more useful ones.
                    self._forget([buf.popleft()])
                    self._dropped += 1
                    self._drops_unlogged += 1
                    self._resolved += 1
                # Wake the writer only when it has something new to do: the first record
                # starts the flush_interval clock, a full batch is written at once.
                if len(buf) == 1 or len(buf) >= self.settings.batch_size:
                    self._cond.notify_all()
        if warn_late:
            log.warning(
                "request record %r submitted after the recorder was closed; dropped", record.id
            )

    def refused(
        self, instance_id: str, api_key_name: str | None, reason: str, at: datetime | None = None
    ) -> None:
        """Count a request of `api_key_name` (None: an open API's, kept as "") refused for
        `reason` at `at` (default now) on this daemon (`instance_id`); written with the next
        batch. Never blocks on the database."""
        if not self.settings.record_requests:
            return
        hour = time_buckets(as_utc(at) or datetime.now(UTC))[0]
        key = (hour, instance_id, api_key_name or "", reason)
        with self._cond:
            if self._stopping:
                self._refusals_lost += 1
                return
            first = not self._refusals and not self._buffer
            self._refusals[key] = self._refusals.get(key, 0) + 1
            self._refused += 1
            if first:  # starts the flush_interval clock, as a first record does
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record submitted and every refusal counted before this call has
        been written (or dropped and counted, see `dropped`). False if `timeout` seconds
        passed first."""
        with self._cond:
            target, refused = self._submitted, self._refused

            def done() -> bool:
                return self._resolved >= target and self._refusals_resolved >= refused

            self._flush_waiters += 1
            self._cond.notify_all()  # don't let a partial batch wait for flush_interval_s
            try:
                return (
                    self._cond.wait_for(lambda: done() or not self._thread.is_alive(), timeout)
                    and done()
                )
            finally:
                self._flush_waiters -= 1

    def close(self, timeout: float = 10.0) -> bool:
        """Flush, then stop the writer thread. True when every submitted record was written or
        had already been counted as dropped; records still unwritten (the database was down
        for the whole `timeout`) are logged and counted in `dropped`. Stopping may take up to
        _STOP_GRACE_S longer than `timeout`."""
        deadline = time.monotonic() + timeout
        flushed = self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        # A short grace beyond `timeout`: after a timed-out flush the writer is usually in its
        # retry wait, which `_stopping` ends at once, or in a quick failing write.
        self._thread.join(max(deadline - time.monotonic(), _STOP_GRACE_S))
        if self._thread.is_alive():
            # Stuck in a database call (e.g. a connect timeout); it is a daemon thread.
            log.error(
                "request recorder did not stop within %.1fs; %d records may be lost",
                timeout,
                self.buffered,
            )
            return False
        with self._cond:
            lost = len(self._buffer)
            self._buffer.clear()
            self._dropped += lost
            self._resolved += lost
            refusals_lost = sum(self._refusals.values())
            self._refusals.clear()
            self._refusals_lost += refusals_lost
            self._refusals_resolved += refusals_lost
            self._cond.notify_all()
            journal, self._journal = self._journal, None
        if refusals_lost:
            log.error(
                "request store unreachable at shutdown: %d refused requests were not counted "
                "in the refusals table",
                refusals_lost,
            )
        self._log_drops(force=True)
        kept = journal is not None and not journal.failed
        if journal is not None:
            journal.close()
        if lost:
            log.error(
                "request store unreachable at shutdown: %d request records were not written%s",
                lost,
                f" (kept in the journal in {journal.directory}: the next start writes them)"
                if kept
                else "",
            )
        if self._owns_engine:
            self._engine.dispose()
        return flushed and not lost

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reload_prices(self) -> None:
        """Reload the price book before the next write (e.g. after sync_prices added one);
        otherwise it is reloaded every `price_refresh_s`."""
        self._book = None  # a single attribute store: safe against the writer thread

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def written(self) -> int:
        with self._cond:
            return self._written

    @property
    def dropped(self) -> int:
        with self._cond:
            return self._dropped

    @property
    def buffered(self) -> int:
        with self._cond:
            return len(self._buffer) + self._inflight

    @property
    def refusals_written(self) -> int:
        """Refused requests added to the refusals table, ever."""
        with self._cond:
            return self._refusals_written

    @property
    def refusals_lost(self) -> int:
        """Refused requests never added (counted after close, or unwritten at close)."""
        with self._cond:
            return self._refusals_lost

    @property
    def failed_writes(self) -> int:
        with self._cond:
            return self._failed_writes

    # -- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug, not a database error (those are handled in _write)
            log.exception("request recorder thread failed; request records are no longer written")
            raise

    def _loop(self) -> None:
        while True:
            with self._cond:
                batch = self._next_batch()
                if batch is None:
                    return  # stopping, and nothing left
                self._inflight = len(batch)
                refusals, self._refusals = self._refusals, {}
            written, rejected = 0, 0
            retry: list[RequestRecord] = []
            error: BaseException | None = None
            if batch:
                written, rejected, retry, error = self._write(batch)
            if refusals:
                error = self._write_refusals(refusals, error)
            with self._cond:
                self._inflight = 0
                self._written += written
                self._dropped += rejected
                self._resolved += written + rejected
                # The batch is written in order: what is not retried is committed (or rejected).
                self._forget(batch[: len(batch) - len(retry)])
                if error is not None and not retry:  # only the refusal counts' write failed
                    self._failed_writes += 1
                if retry:
                    self._failed_writes += 1
                    # Back to the front, in order, then enforce the bound again (the batch was
                    # outside the buffer while being written).
                    self._buffer.extendleft(reversed(retry))
                    overflow = len(self._buffer) - self.settings.buffer_max_records
                    self._forget([self._buffer.popleft() for _ in range(max(0, overflow))])
                    if overflow > 0:
                        self._dropped += overflow
                        self._drops_unlogged += overflow
                        self._resolved += overflow
                self._cond.notify_all()  # flush() waiters
                stopping = self._stopping
            if error is None:
                self._note_success()
                self._log_drops()
                continue
            self._note_failure(error)
            self._log_drops()
            with self._cond:
                # close() already gave the database its flush timeout: stop retrying at once
                # and let close() account for what is left.
                if stopping or self._cond.wait_for(
                    lambda: self._stopping, self.settings.retry_interval_s
                ):
                    return

    def _forget(self, records: list[RequestRecord]) -> None:
        """(Lock held.) These records are written or dropped: the journal need not keep them."""
        if self._journal is not None and records:
            self._journal.committed(records)

    def _next_batch(self) -> list[RequestRecord] | None:
        """Wait (lock held) for a batch worth writing: a full one, a partial one that has waited
        flush_interval_s, or anything when flushing, stopping or catching up after an outage.
        Refusal counts waiting count as a partial batch (the batch may then be []). Returns
        None only when stopping with nothing left."""
        s = self.settings
        deadline: float | None = None
        while True:
            n = len(self._buffer)
            if n == 0 and not self._refusals:
                if self._stopping:
                    return None
                deadline = None
                self._cond.wait()
                continue
            if n >= s.batch_size or self._stopping or self._flush_waiters:
                break
            if self._outage_since is not None:
                break  # retrying: the retry interval was already waited
            now = time.monotonic()
            if deadline is None:
                deadline = now + s.flush_interval_s
            if now >= deadline:
                break
            self._cond.wait(deadline - now)
        return [self._buffer.popleft() for _ in range(min(n, s.batch_size))]

    def _write(
        self, batch: list[RequestRecord]
    ) -> tuple[int, int, list[RequestRecord], BaseException | None]:
        """Write a batch. Returns (written, rejected, to retry, outage error)."""
        try:
            self._write_rows(batch)
            return len(batch), 0, [], None
        except Exception as exc:
            if is_outage(exc):
                return 0, 0, batch, exc
        # The database rejected something in the batch: write the records one at a time so a
        # bad record costs only itself, not its whole batch (and does not block the queue).
        written = rejected = 0
        for i, rec in enumerate(batch):
            try:
                self._write_rows([rec])
                written += 1
            except Exception as exc:
                if is_outage(exc):
                    return written, rejected, batch[i:], exc
                rejected += 1
                log.error("request record %r rejected by the database, dropped: %s", rec.id, exc)
        return written, rejected, [], None

    def _write_refusals(
        self, counts: dict[RefusalKey, int], error: BaseException | None
    ) -> BaseException | None:
        """Add `counts` to their rows in one transaction, unless the batch just found the
        database down (`error`). Not written: they go back into the counts (added to those
        counted meanwhile), for the next write. Returns the outage error, if any."""
        if error is None:
            now = datetime.now(UTC)
            rows = [
                {**dict(zip(REFUSAL_KEY, key, strict=True)), "requests": n, "updated_at": now}
                | {"day_bucket": key[0][:10]}  # the hour bucket's date: "2026-11-30T14"
                for key, n in sorted(counts.items())
            ]
            try:
                with self._engine.begin() as conn:
                    conn.execute(self._refusal_stmt, rows)
            except Exception as exc:
                if is_outage(exc):
                    error = exc
                else:  # rejected (a value the column cannot hold): retrying cannot help
                    n = sum(counts.values())
                    log.error("%d refused requests rejected by the database, dropped: %s", n, exc)
                    with self._cond:
                        self._refusals_lost += n
                        self._refusals_resolved += n
                    return None
            else:
                n = sum(counts.values())
                with self._cond:
                    self._refusals_written += n
                    self._refusals_resolved += n
                return None
        with self._cond:
            for key, n in counts.items():
                self._refusals[key] = self._refusals.get(key, 0) + n
        return error

    def _write_rows(self, records: list[RequestRecord]) -> None:
        rows = collapse(records)
        with self._engine.begin() as conn:
            book = self._prices(conn) if any(r.is_final for r in rows) else None
            conn.execute(self._stmt, [row_values(r, book) for r in rows])

    def _prices(self, conn: Connection) -> PriceBook:
        # Reloaded now and then so that prices added by another daemon (or a restart of this
        # one) are used for new requests without a restart of every instance.
        now = time.monotonic()
        if self._book is None or now - self._book_loaded_at >= self._price_refresh_s:
            self._book = PriceBook.load(conn)
            self._book_loaded_at = now
        return self._book

    def _note_failure(self, error: BaseException) -> None:
        self._recovery_target = None
        if self._outage_since is not None:
            return  # one warning per outage, not one per retry
        self._outage_since = time.monotonic()
        with self._cond:
            self._outage_written_from = self._written
        log.warning(
            "request store unreachable (%s); buffering request records in memory (at most %d) "
            "and retrying every %gs",
            str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__,
            self.settings.buffer_max_records,
            self.settings.retry_interval_s,
        )

    def _note_success(self) -> None:
        if self._outage_since is None:
            return
        with self._cond:
            if self._recovery_target is None:
                # The backlog is what was buffered when the database came back.
                self._recovery_target = self._resolved + len(self._buffer)
            if self._resolved < self._recovery_target:
                return
            wrote = self._written - self._outage_written_from
        log.info(
            "request store reachable again after %.1fs, wrote %d buffered records",
            time.monotonic() - self._outage_since,
            wrote,
        )
        self._outage_since = None
        self._recovery_target = None
        self._log_drops(force=True)

    def _log_drops(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._drops_logged_at < self._drop_log_interval_s:
            return
        with self._cond:
            n, self._drops_unlogged = self._drops_unlogged, 0
            total = self._dropped
        if n:
            self._drops_logged_at = now
            log.warning(
                "request store buffer full (%d records): dropped the %d oldest request records "
                "(%d dropped in total)",
                self.settings.buffer_max_records,
                n,
                total,
            )


def _open_journal(directory: str | Path) -> Journal | None:
    try:
        return Journal(directory)
    except OSError as exc:
        log.error(
            "cannot open the request journal in %s (%s): a crash may lose the records of up to "
            "flush_interval_s of requests",
            directory,
            exc,
        )
        return None
