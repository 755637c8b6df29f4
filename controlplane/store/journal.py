"""A local append-only journal of request records: what a killed daemon had not yet written.

The recorder writes rows in batches (a partial batch waits up to `store.flush_interval_s`), so
a daemon killed outright (SIGKILL, the OOM killer, a crash) used to lose every record submitted
since its last batch: requests admitted in that window had no row at all. The journal closes
the window cheaply. `Recorder.submit` appends each record (the "running" one at admission, the
final one at the end) as one JSON line with a plain write(2), and the writer thread forgets the
lines once their rows are committed to SQL; files whose lines are all committed are deleted (or
truncated, for the one being written). On the next start `replay_journal` (in the recovery
module) upserts what the files still hold and deletes them; `mark_interrupted` then turns the
rows still "running" into "interrupted".

What survives what:
- Process death (SIGKILL, OOM, a crash): every record submitted. A write(2) that returned is in
  the kernel's page cache, which outlives the process; no fsync is needed for that.
- Power loss or a kernel crash: there is no fsync per record (it would cost a disk flush per
  request), so lines the kernel had not yet written back can be lost: up to
  vm.dirty_expire_centisecs (30 s by default) of records, plus a torn last line, which replay
  skips and counts.

Not thread-safe by itself: the recorder calls it under its own lock.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from controlplane.store.records import RequestRecord

log = logging.getLogger(__name__)

SUFFIX = ".jsonl"
_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))
_TIME_FIELDS = frozenset(("arrival_time", "first_token_time", "finish_time"))
# One encoder, built once: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def encode(record: RequestRecord) -> bytes:
    """One journal line: the record's non-empty fields as JSON, times in ISO 8601."""
    data: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(record, name)
        if value is None:
            continue
        data[name] = value.isoformat() if isinstance(value, datetime) else value
    return (_ENCODER.encode(data) + "\n").encode()


def decode(line: bytes) -> RequestRecord:
    """The record of one journal line; ValueError/TypeError/KeyError for a damaged line."""
    data = json.loads(line)
    for name in _TIME_FIELDS & data.keys():
        data[name] = datetime.fromisoformat(data[name])
    return RequestRecord(**data)


def read_journal(directory: Path) -> tuple[list[Path], list[RequestRecord], int]:
    """The journal files in `directory`, the records they hold (in order) and how many lines
    could not be read (a torn last line after a power loss)."""
    files = sorted(directory.glob("*" + SUFFIX)) if directory.is_dir() else []
    records: list[RequestRecord] = []
    damaged = 0
    for path in files:
        for line in path.read_bytes().splitlines():
            if not line.strip():
                continue
            try:
                records.append(decode(line))
            except (ValueError, TypeError, KeyError):
                damaged += 1
    return files, records, damaged


class Journal:
    """Append records, forget them once committed; see the module docstring.

    Files are `<directory>/<start ns>-<n>.jsonl`: a new one every `segment_records` lines, so
    that one long-lived record pins at most one file's worth of lines on disk.
    """

    def __init__(self, directory: str | Path, segment_records: int = 4096) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.segment_records = segment_records
        self._prefix = f"{time.time_ns()}-"
        self._segment = -1  # number of the file being written
        self._fd = -1
        self._lines = 0  # lines in the file being written
        self._pending: dict[int, int] = {}  # file number -> its records not yet committed
        self._where: dict[tuple[str, bool], int] = {}  # (id, final) -> file number
        self.failed = False
        self._open_next()

    @property
    def pending(self) -> int:
        """Records appended and not yet committed (or dropped)."""
        return len(self._where)

    def append(self, record: RequestRecord, line: bytes | None = None) -> None:
        """Journal one record (`line`: its `encode`, if the caller made it outside its lock); on
        an I/O error, log it once and stop journaling (the records still go to SQL: the journal
        only narrows what a crash can lose)."""
        if self.failed:
            return
        try:
            if self._lines >= self.segment_records:
                self._open_next()
            os.write(self._fd, encode(record) if line is None else line)
        except OSError as exc:
            self._fail(exc)
            return
        self._lines += 1
        key = (record.id, record.is_final)
        old = self._where.get(key)
        if old is not None:  # the same record submitted twice: count it once
            self._pending[old] -= 1
        self._where[key] = self._segment
        self._pending[self._segment] = self._pending.get(self._segment, 0) + 1

    def committed(self, records: Iterable[RequestRecord]) -> None:
        """These records' rows are in SQL (or were dropped, and counted as such): forget them,
        and delete the files that hold nothing else."""
        emptied: set[int] = set()
        for record in records:
            seg = self._where.pop((record.id, record.is_final), None)
            if seg is None:
                continue
            self._pending[seg] -= 1
            if self._pending[seg] <= 0:
                emptied.add(seg)
        for seg in emptied:
            if self._pending.get(seg, 1) > 0:
                continue
            del self._pending[seg]
            try:
                if seg == self._segment:
                    os.ftruncate(self._fd, 0)  # O_APPEND: the next line goes at offset 0
                    self._lines = 0
                else:
                    self._path(seg).unlink(missing_ok=True)
            except OSError as exc:
                self._fail(exc)
                return

    def close(self) -> bool:
        """Close the file. With nothing pending the journal is deleted (a clean stop leaves
        nothing to replay) and True is returned; otherwise its files stay for the next start."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.pending or self.failed:
            return False
        for seg in range(self._segment + 1):
            self._path(seg).unlink(missing_ok=True)
        return True

    def files(self) -> Iterator[Path]:
        return (self._path(seg) for seg in range(self._segment + 1) if self._path(seg).exists())

    def _path(self, seg: int) -> Path:
        return self.directory / f"{self._prefix}{seg:06d}{SUFFIX}"

    def _open_next(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if self._pending.get(self._segment, 0) <= 0:
                self._pending.pop(self._segment, None)
                self._path(self._segment).unlink(missing_ok=True)
        self._segment += 1
        self._lines = 0
        self._fd = os.open(
            self._path(self._segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )

    def _fail(self, exc: OSError) -> None:
        self.failed = True
        log.error(
            "request journal in %s failed (%s): journaling stops; records still go to the "
            "database, but a crash can now lose the ones not yet written",
            self.directory,
            exc,
        )
