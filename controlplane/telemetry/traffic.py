"""Request traffic for ``GET /admin/stats``: what reached the /v1 generation endpoints and how
each request ended, as rates over the last RATE_WINDOW_S seconds.

`InferenceAPI.serve` (controlplane/openai/serving.py) is the one place that counts: every
request it serves `arrived`, then ends exactly once as `rejected` (answered 429 or 503 at the
door, before anything was queued) or `finished` (any other end, `failed` when it ended in a
5xx or an engine error; a streamed request when its last engine request ends, whether the
client stayed or not). So arrivals = rejected + finished + still running, over any span.

`sample` (called by the runtime about twice a second) keeps the completion rate once a second
for BEST_WINDOW_S and the queue length for QUEUE_WINDOW_S: the best completion rate of the
last 15 minutes and whether the queue is growing. Pure bookkeeping: every method takes the
time (time.time()), nothing here reads a clock of its own or needs the engine. Thread-safe:
the event loop counts while the fleet heartbeat reads /admin/stats in a worker thread.
"""

from __future__ import annotations

import threading
from collections import deque

RATE_WINDOW_S = 10.0  # the rates' window
BEST_WINDOW_S = 900.0  # best_completion_rate_per_s: the highest completion rate this far back
SAMPLE_EVERY_S = 1.0  # completion rate and queue length samples, at most this often
QUEUE_WINDOW_S = 10.0  # "the queue is growing": longer now than this long ago
QUEUE_MIN_SPAN_S = 3.0  # ... compared with a sample at least this old

KINDS = ("arrivals", "completions", "rejected_429", "rejected_503", "failed")


class Traffic:
    def __init__(self, started: float) -> None:
        self.started = started  # rates divide by the time since then while it is < the window
        self._events: dict[str, deque[float]] = {k: deque() for k in KINDS}
        self._best: deque[tuple[float, float]] = deque()  # (time, completions per second)
        self._queue: deque[tuple[float, int]] = deque()  # (time, queue length)
        self._lock = threading.Lock()

    # -- counting -------------------------------------------------------------------------------
    def _add(self, kind: str, now: float) -> None:
        with self._lock:
            times = self._events[kind]
            times.append(now)
            self._trim(times, now)

    @staticmethod
    def _trim(times: deque[float], now: float) -> None:
        while times and times[0] <= now - RATE_WINDOW_S:
            times.popleft()

    def arrived(self, now: float) -> None:
        self._add("arrivals", now)

    def rejected(self, status: int, now: float) -> None:
        """Answered `status` (429 or 503) at the door: nothing was queued."""
        self._add("rejected_429" if status == 429 else "rejected_503", now)

    def finished(self, failed: bool, now: float) -> None:
        self._add("completions", now)
        if failed:
            self._add("failed", now)

    # -- reading --------------------------------------------------------------------------------
    def per_s(self, kind: str, now: float) -> float:
        """Events of `kind` in (now - RATE_WINDOW_S, now] per second; while the counting is
        younger than the window, over the time since it started (at least one second)."""
        with self._lock:
            count = sum(1 for t in self._events[kind] if now - RATE_WINDOW_S < t <= now)
        return count / min(RATE_WINDOW_S, max(1.0, now - self.started))

    def rates(self, now: float) -> dict[str, float]:
        """The /admin/stats rate keys: ``<kind>_per_s`` for every kind, and ``rejected_per_s``
        (429s and 503s together)."""
        r = {f"{k}_per_s": round(self.per_s(k, now), 3) for k in KINDS}
        r["rejected_per_s"] = round(r["rejected_429_per_s"] + r["rejected_503_per_s"], 3)
        return r

    def sample(self, now: float, queue_length: int) -> None:
        """Keep the completion rate and the queue length (at most once per SAMPLE_EVERY_S)."""
        rate = self.per_s("completions", now)
        with self._lock:
            if not self._best or now - self._best[-1][0] >= SAMPLE_EVERY_S:
                self._best.append((now, rate))
                self._queue.append((now, queue_length))
            while self._best and self._best[0][0] < now - BEST_WINDOW_S:
                self._best.popleft()
            while self._queue and self._queue[0][0] < now - QUEUE_WINDOW_S:
                self._queue.popleft()

    def best_completion_rate(self, now: float) -> float:
        """The highest completion rate sampled in the last BEST_WINDOW_S, the current one
        included."""
        current = self.per_s("completions", now)
        with self._lock:
            kept = [rate for t, rate in self._best if t >= now - BEST_WINDOW_S]
        return round(max(current, *kept), 3)

    def queue_growing(self, now: float, queue_length: int) -> bool:
        """The queue is longer now than at the oldest sample of the last QUEUE_WINDOW_S, which
        must be at least QUEUE_MIN_SPAN_S old (a younger history tells nothing yet)."""
        with self._lock:
            old = [q for t, q in self._queue if now - QUEUE_WINDOW_S <= t <= now - QUEUE_MIN_SPAN_S]
        return bool(old) and queue_length > old[0]
