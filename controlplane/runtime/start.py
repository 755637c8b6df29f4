"""The daemon's start: the model's load in a thread of its own, ended by a shutdown (SIGTERM)
or by the start deadline (server.start_timeout_s).

The load runs in a daemon thread, not in asyncio's default executor: the interpreter's exit
joins that executor's threads, and what is left of a load once it is abandoned (reading
weights, a kernel build that does not stop) cannot be interrupted, so the exit must not wait
for it. The daemon stops the part that can be stopped (the CPU kernel build, which would
otherwise leave its lock) before it exits (controlplane.daemon).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Generic, Literal, TypeVar

T = TypeVar("T")

SHUTDOWN, DEADLINE = "shutdown", "deadline"


class StartStopped(Exception):
    """The load was abandoned: `reason` is SHUTDOWN (a signal) or DEADLINE (start_timeout_s)."""

    def __init__(self, reason: Literal["shutdown", "deadline"]) -> None:
        super().__init__(reason)
        self.reason = reason


class LoadThread(Generic[T]):
    """`fn` run once in a daemon thread; `result` waits for it, for a shutdown or a deadline."""

    def __init__(self, fn: Callable[[], T], name: str = "load") -> None:
        self._fn = fn
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future[T] | None = None

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    async def result(self, shutdown: asyncio.Event, timeout: float | None) -> T:
        """What `fn` returned (or raised); StartStopped if `shutdown` is set, or `timeout`
        seconds pass (None: no limit), first."""
        if shutdown.is_set():
            raise StartStopped(SHUTDOWN)
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        self._thread.start()
        stop = asyncio.ensure_future(shutdown.wait())
        try:
            await asyncio.wait({self._done, stop}, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            stop.cancel()
        if self._done.done():
            return self._done.result()
        self._done.cancel()  # a load that ends later is dropped (settle sees it done)
        raise StartStopped(SHUTDOWN if shutdown.is_set() else DEADLINE)

    def _run(self) -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = self._fn()
        except BaseException as exc:  # handed to the loop, as asyncio.to_thread would
            error = exc
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop has closed: the daemon is exiting
            self._loop.call_soon_threadsafe(self._settle, result, error)

    def _settle(self, result: T | None, error: BaseException | None) -> None:
        assert self._done is not None
        if self._done.done():
            return
        if error is not None:
            self._done.set_exception(error)
        else:
            self._done.set_result(result)  # type: ignore[arg-type]


def time_left(limit_s: float, started_at: float) -> float | None:
    """Seconds left of a start deadline of `limit_s` (0: none, None) from `started_at`
    (time.time())."""
    if not limit_s:
        return None
    return max(0.0, limit_s - (time.time() - started_at))


def exit_now(code: int) -> None:
    """End the process at once with `code`, its logs and output flushed: a load thread still
    running would be joined or torn down mid-call by a normal exit."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
