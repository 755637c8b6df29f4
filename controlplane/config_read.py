"""Reading the config file safely: the one read every path takes (the start, the reload
watcher, SIGHUP, a save).

Only a regular file is opened (`os.stat` + `S_ISREG` first, then `O_NONBLOCK` and an `fstat` of
what was opened, in case it was swapped in between): a FIFO, a directory (or a symlink to one),
a device or a socket is an error naming what it is, never a read that blocks. At most
`MAX_CONFIG_BYTES` are read; bytes that are not UTF-8 and invalid TOML are errors naming the
path and the offset. Blocking on a hung mount is the caller's concern: the running daemon reads
in a thread with a timeout (runtime/config_file.py: OffLoopReader).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_CONFIG_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One read of the file: its identity and content, and the parsed table or why not."""

    stamp: tuple[int, ...] | None  # (dev, inode, mtime_ns, size) of what was read
    poll: tuple[int, ...] | str  # stat_stamp() as it was before the read
    digest: str  # SHA-256 of the bytes read ("" when nothing was read)
    raw: dict[str, Any] | None
    error: str | None  # why it cannot be applied
    text: str = ""  # the file as read (a save keeps its comments and layout)

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.stamp, self.digest, self.error)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def file_stamp(st: os.stat_result) -> tuple[int, ...]:
    """A read file's identity (dev, inode, mtime_ns, size): Snapshot.stamp, and what a save
    compares before it writes over the file it read."""
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _poll_stamp(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode)


def _stat_error(exc: OSError) -> str:
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def stat_stamp(path: Path) -> tuple[int, ...] | str:
    """What the watcher polls: (dev, inode, mtime_ns, size, mode), or the error as text."""
    try:
        return _poll_stamp(os.stat(path))
    except OSError as exc:
        return _stat_error(exc)


def read_snapshot(path: Path) -> Snapshot:
    """Read and parse the config file, refusing anything but a regular file; never raises
    for what is at the path (blocking is the caller's concern: see `OffLoopReader`)."""

    poll: tuple[int, ...] | str = ""

    def failed(message: str, st: os.stat_result | None = None, digest: str = "") -> Snapshot:
        stamp = None if st is None else file_stamp(st)
        return Snapshot(stamp, poll, digest, None, f"{path}: {message}")

    try:
        st = os.stat(path)
    except OSError as exc:
        poll = _stat_error(exc)
        if isinstance(exc, FileNotFoundError):
            return failed("file not found")
        return failed(f"cannot stat: {exc.strerror or exc}")
    poll = _poll_stamp(st)
    if not stat.S_ISREG(st.st_mode):
        return failed(f"{_kind(st.st_mode)}, not a regular file", st)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        return failed(f"cannot open: {exc.strerror or exc}", st)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between the stat and the open
            return failed(f"{_kind(st.st_mode)}, not a regular file", st)
        chunks, size = [], 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        return failed(f"cannot read: {exc.strerror or exc}", st)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    digest = hashlib.sha256(data).hexdigest()
    if len(data) > MAX_CONFIG_BYTES:
        return failed(f"larger than {MAX_CONFIG_BYTES} bytes", st, digest)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 1].hex()
        return failed(f"not UTF-8 (byte 0x{bad} at offset {exc.start})", st, digest)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return failed(f"invalid TOML: {exc}", st, digest)
    return Snapshot(file_stamp(st), poll, digest, raw, None, text)
