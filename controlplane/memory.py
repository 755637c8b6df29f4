"""Give the C heap's free memory back to the OS once the daemon is idle.

Measured with benchmarks/rss_storms.py: a storm of requests grows the daemon's RSS by hundreds
of MB that stay after it ends, and the growth slows storm after storm (a plateau, not a leak).
It is glibc malloc keeping freed memory: many threads (engine, HTTP, tokenizer, SQL writer)
each get an arena, and the large, short-lived buffers of a busy step (activations, logits,
request bodies) are freed into them rather than unmapped. `malloc_trim(0)` hands the free pages
of every arena back; it costs a few milliseconds, so it runs only after the engine has had no
request for a while, never while serving.

Engine steps are not the only such work: a large request served without the engine (POST
/tokenize of a long text, a large admin body) leaves its buffers too. `note_large_work()`
counts it, and the idle wait follows it as it follows engine steps.

Off where the C library has no `malloc_trim` (not glibc). `CONTROLPLANE_MALLOC_TRIM_IDLE_S`
sets the idle time before a trim (default 5 s; 0 turns it off).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

ENV_VAR = "CONTROLPLANE_MALLOC_TRIM_IDLE_S"
DEFAULT_IDLE_S = 5.0
# A request body at least this large counts as large work (controlplane.http.body).
LARGE_BODY_BYTES = 1 << 20

# Large requests served outside the engine, this process's count (only its changes matter: a
# lost update between threads costs nothing).
_large_work = 0


def note_large_work() -> None:
    """A large request was served outside the engine: arm the next idle trim."""
    global _large_work
    _large_work += 1


def note_body(size: int) -> None:
    """A request body of `size` bytes was read: a large one arms the idle trim (its buffers
    are freed into the heap whether it is parsed, refused or served)."""
    if size >= LARGE_BODY_BYTES:
        note_large_work()


def _libc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def idle_seconds(env: Mapping[str, str]) -> float:
    """The configured idle time before a trim; 0 means off (also for a value that is not a
    finite number >= 0, which is logged)."""
    raw = env.get(ENV_VAR)
    if raw is None:
        return DEFAULT_IDLE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        log.warning("%s=%r is not a number of seconds >= 0: idle malloc_trim is off", ENV_VAR, raw)
        return 0.0
    return value


async def trim_when_idle(activity: Callable[[], int], idle_s: float, poll_s: float = 1.0) -> None:
    """Forever: once `activity()` (a counter of work done, e.g. engine steps) and the large work
    noted outside it have not moved for `idle_s`, trim the C heap; once per idle spell (the
    next trim waits for more work)."""
    trim = _libc_trim()
    if trim is None or idle_s <= 0:
        return

    def work() -> tuple[int, int]:
        return activity(), _large_work

    last = work()
    idle_since = time.monotonic()
    trimmed = True  # nothing to give back before the first request
    while True:
        await asyncio.sleep(poll_s)
        now, seen = time.monotonic(), work()
        if seen != last:
            last, idle_since, trimmed = seen, now, False
            continue
        if trimmed or now - idle_since < idle_s:
            continue
        t0 = time.perf_counter()
        # In a worker thread: the event loop keeps serving while the heap is walked.
        await asyncio.to_thread(trim, 0)
        trimmed = True
        log.debug("malloc_trim after %.0fs idle: %.1f ms", idle_s, 1e3 * (time.perf_counter() - t0))


def configured_idle_s() -> float:
    return idle_seconds(os.environ)
