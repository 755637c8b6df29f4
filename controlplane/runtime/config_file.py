"""The config file of a running daemon: read it safely, watch it, reload it (live fields only).

What a reload may meet at the path, and what it does (issue 24, item 8):

- The file is read off the event loop, in a thread of its own, and given `READ_TIMEOUT_S`:
  a hung network mount costs the watcher that long, never the HTTP server (health probes
  included). While such a read is still stuck, no other is started (the threads cannot be
  killed; this keeps them to one).
- Only a regular file is opened, never with a blocking open (controlplane/config_read.py, the
  one read the start takes too): a FIFO, a directory (or a symlink to one), a device or a
  socket is an error naming what it is. Symlinks to a regular file are followed.
- Bytes that are not UTF-8, invalid TOML, an invalid value, a file over `MAX_CONFIG_BYTES`, a
  missing file: an error naming the path (and the offset or the field). The running values
  stay; the next change of the file (or SIGHUP) is read again.
- The watcher applies a file only once it is complete: its (device, inode, mtime, size,
  SHA-256) must be the same in two reads `server.config_settle_s` apart, so a writer that pauses
  mid-file is waited for. And a file that no longer sets keys the applied file set (what a
  truncated write looks like) is held, not applied: a warning names the dropped keys and
  says to send SIGHUP to apply the file as it is (those keys then go back to their defaults).
  A later edit that sets the keys again is applied as usual. A dropped key is never applied
  on a timer: a writer that died mid-file leaves its file truncated for good.
- SIGHUP is the operator saying "the file is ready": it reads once (same safe read, no settle
  time) and applies the file even if it drops keys, with a warning naming them.
- A save (POST /admin/config/save, issue 52) reads with the same safe read, before it takes the
  config lock (a stuck read never holds up PATCHes, key suspensions or the autopilot), and
  writes the live values back only over the file the daemon last applied: a file that drops
  keys the applied file set (a truncated write: no [[api_keys]], no [[admin_tokens]]) or that
  was edited since (the watcher has not applied it yet) is refused (SaveError, naming why).
  The write runs in a thread of its own too, bounded by the same timeout.
- The threads are daemon threads, never the event loop's default executor: a read stuck for
  good does not keep the process alive after SIGTERM (the interpreter joins executor threads at
  exit, not daemon threads).
- Every rejection and hold is logged (error / warning) and sent on `GET /admin/events` as a
  `{"type": "config_reload", "status": "rejected" | "held", ...}` event. Logging repeats only
  when the file changes again, so a file left broken logs once.
- The watcher never dies: anything unexpected is logged with its traceback (the same error at
  most ten times a minute: server.logs.RepeatLimit) and the watch goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from controlplane.config import ServerSettings
from controlplane.config_read import Snapshot, file_stamp, read_snapshot, stat_stamp
from controlplane.errors import FieldError
from controlplane.runtime.live_config import ConfigChangeError, FieldChange, LiveConfig, flatten_raw
from controlplane.runtime.persist import SaveError, write_file

log = logging.getLogger("controlplane.daemon")

READ_TIMEOUT_S = 5.0  # one read (or stat) of the config file, in its thread


class OffLoopReader:
    """Runs a blocking file-system call in a thread of its own with a timeout; one at a time,
    so a call stuck for good (a hung mount) holds one thread, not one per poll."""

    def __init__(self, timeout_s: float = READ_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._stuck: threading.Thread | None = None

    async def call(
        self, what: str, fn: Callable[[], Any], then: str = "the running values stay"
    ) -> Any:
        """fn()'s result; TimeoutError(message, ending with `then`) if it takes longer than the
        timeout or an earlier call is still stuck."""
        blocked = (
            f"{what}: did not finish within {self.timeout_s:g}s (a hung network mount?); {then}"
        )
        if self._stuck is not None:
            if self._stuck.is_alive():
                raise TimeoutError(blocked)
            self._stuck = None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def deliver(ok: bool, value: Any) -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def work() -> None:
            try:
                outcome = (True, fn())
            except Exception as exc:  # delivered to the awaiting task
                outcome = (False, exc)
            # RuntimeError: the loop is closed, nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, *outcome)

        thread = threading.Thread(target=work, name="config-file-read", daemon=True)
        thread.start()
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.shield(future)
        except TimeoutError:
            self._stuck = thread
            raise TimeoutError(blocked) from None


class ConfigFile:
    """Reloads of one config file into a LiveConfig: on SIGHUP (`reload`) and by polling
    (`watch`); see the module docstring for what each accepts."""

    def __init__(
        self,
        path: Path,
        live: LiveConfig,
        apply: Callable[[Mapping[str, Any], str], Awaitable[list[FieldChange]]],
        broadcast: Callable[[dict[str, Any]], None],
        settings: Callable[[], ServerSettings],
        reader: OffLoopReader | None = None,
    ) -> None:
        self.path = path
        self.live = live
        self._apply = apply  # (changes, source) -> applied changes (Runtime.change_config)
        self._broadcast = broadcast
        self._settings = settings
        self.reader = reader or OffLoopReader()
        self._lock = asyncio.Lock()  # a SIGHUP and the watcher never interleave

    # -- reading ------------------------------------------------------------------------------
    async def read(self) -> Snapshot:
        try:
            return await self.reader.call(str(self.path), lambda: read_snapshot(self.path))
        except TimeoutError as exc:
            return Snapshot(None, str(exc), "", None, str(exc))

    async def _stamp(self) -> tuple[int, ...] | str:
        try:
            return await self.reader.call(str(self.path), lambda: stat_stamp(self.path))
        except TimeoutError as exc:
            return str(exc)

    async def _settled(self) -> Snapshot:
        """A read that matches the one `config_settle_s` before it (the writer is done)."""
        before = await self.read()
        while True:
            await asyncio.sleep(self._settings().config_settle_s)
            now = await self.read()
            if now.key == before.key:
                return now
            before = now

    # -- saving -------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def exclusive(self) -> Any:
        """No reload (SIGHUP, the watcher) applies the file while this is held: a save holds
        it from its read to its write (reads and writes are bounded by the reader's timeout)."""
        async with self._lock:
            yield

    async def read_for_save(self) -> Snapshot:
        """The file as a save may overwrite it: read like a reload (see the module docstring),
        writable, setting every key the applied file set and nothing else than it (it is the
        file last applied). SaveError naming why not; call it under `exclusive()`."""
        path = self.path

        def read() -> tuple[Snapshot, bool]:
            snap = read_snapshot(path)
            return snap, snap.error is None and os.access(path, os.W_OK)

        try:
            snap, writable = await self.reader.call(str(path), read, "not saved")
        except TimeoutError as exc:
            raise SaveError(f"config file {exc}") from None
        if snap.error is not None or snap.raw is None:
            raise SaveError(f"config file {snap.error or path}; not saved")
        if not writable:
            raise SaveError(f"config file {path} is not writable by uid {os.geteuid()}")
        dropped = sorted(self.live.file_keys() - set(flatten_raw(snap.raw)))
        if dropped:
            raise SaveError(
                f"config file {path} no longer sets {', '.join(dropped)} (the file last applied "
                "set them): a truncated or unfinished write? Not saved (writing it back would "
                "drop them for good); finish the file, or send SIGHUP to apply it as it is, "
                "then save again"
            )
        edited = self.live.file_differs(snap.raw)
        if edited:
            raise SaveError(
                f"config file {path} was edited since it was last applied ({', '.join(edited)} "
                "differ): not saved; the daemon applies it once it has settled "
                "(server.config_settle_s) or on SIGHUP, then save again"
            )
        return snap

    async def write(self, text: str, read: Snapshot) -> None:
        """Replace the file with `text` (persist.write_file: atomic where it can be) unless it
        changed since `read`; in the reader's thread, bounded by its timeout. SaveError."""
        path = self.path

        def write() -> None:
            if file_stamp(Path(os.path.realpath(path)).stat()) != read.stamp:
                raise SaveError(f"config file {path} changed while saving; not written, save again")
            write_file(path, text)

        try:
            await self.reader.call(f"writing {path}", write, "it may be written later")
        except TimeoutError as exc:
            raise SaveError(f"config file {exc}") from None
        except OSError as exc:
            raise SaveError(f"could not write {path}: {exc.strerror or exc}") from None

    # -- applying -----------------------------------------------------------------------------
    def _refuse(self, status: str, reason: str, message: str, **extra: Any) -> None:
        self._broadcast(
            {"type": "config_reload", "status": status, "reason": reason, "error": message, **extra}
        )

    async def reload(
        self, reason: str, snapshot: Snapshot | None = None, confirmed: bool = True
    ) -> bool:
        """Apply the file's live changes (all or nothing); True if the file was taken.
        `confirmed` (SIGHUP): apply even if the file drops keys the applied file set."""
        async with self._lock:
            snap = snapshot if snapshot is not None else await self.read()
            if snap.error is not None or snap.raw is None:
                message = snap.error or f"{self.path}: unreadable"
                log.error(
                    "config reload (%s) rejected, keeping the running values: %s", reason, message
                )
                self._refuse("rejected", reason, message)
                return False
            raw = snap.raw
            dropped = sorted(self.live.file_keys() - set(flatten_raw(raw)))
            if dropped and not confirmed:
                message = (
                    f"{self.path} no longer sets {', '.join(dropped)} (set before): a truncated "
                    "write? Not applied; send SIGHUP to apply the file as it is (those keys go "
                    "back to their defaults)"
                )
                log.warning("config reload (%s) held: %s", reason, message)
                self._refuse("held", reason, message, dropped=dropped)
                return False
            try:
                live, restart = self.live.file_changes(raw)
                changes = await self._apply(live, "file") if live else []
            except (ConfigChangeError, FieldError) as exc:
                log.error(
                    "config reload (%s) rejected, keeping the running values: %s", reason, exc
                )
                self._refuse("rejected", reason, str(exc))
                return False
            self.live.file_read(raw)
            if dropped:
                log.warning(
                    "config reload (%s): keys removed from the file are back to their defaults: %s",
                    reason,
                    ", ".join(dropped),
                )
            if restart:
                log.warning(
                    "config file changes that need a restart (not applied): %s", ", ".join(restart)
                )
                self._broadcast({"type": "restart_required", "fields": restart})
            if not changes and not restart:
                log.info("config reload (%s): nothing changed", reason)
            return True

    # -- watching -----------------------------------------------------------------------------
    async def watch(self) -> None:
        """Poll the file every `config_watch_interval_s` (works on every filesystem); reload a
        change once it has settled. Runs until cancelled, whatever happens to the file."""
        last = await self._stamp()
        while True:
            try:
                await asyncio.sleep(self._settings().config_watch_interval_s)
                now = await self._stamp()
                if now == last:
                    continue
                snap = await self._settled()
                last = snap.poll  # a change after that read is seen by the next poll
                await self.reload("file changed", snap, confirmed=False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._unexpected(exc)
                await asyncio.sleep(1.0)  # never a busy loop, whatever fails

    def _unexpected(self, exc: Exception) -> None:
        # The same error repeating is bounded by the log handler's RepeatLimit (server.logs).
        log.error(
            "config file watcher: %s: %s (still watching)", type(exc).__name__, exc, exc_info=exc
        )
