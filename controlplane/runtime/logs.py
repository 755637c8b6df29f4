"""Logging: one line per event, plain text or JSON (server.log_format)."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

# Attributes every LogRecord has; anything else on a record came from `extra={...}`.
_RECORD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
# uvicorn passes a colored copy of its message as an extra: noise in JSON.
_DROPPED_EXTRAS = frozenset({"color_message"})


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        # Fields passed with `extra={...}` become keys (the lifecycle `event` among them); the
        # four above keep their meaning if an extra uses one of their names.
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in _DROPPED_EXTRAS:
                entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # default=str: an extra that JSON cannot encode (a datetime, a Path) is still logged.
        return json.dumps(entry, default=str)


class RepeatLimit(logging.Filter):
    """At most `burst` records with the same text (logger, level, message, exception type) per
    `window_s` seconds; the rest are counted and dropped. The last record let through says so,
    and the first one after the window says how many were dropped.

    A failure that repeats in a tight loop (the accept loop's "Too many open files" when the
    process runs out of descriptors logged ~11,000 lines a second) then costs a few lines a
    minute instead of filling the disk. Distinct messages are untouched.
    """

    def __init__(self, burst: int = 10, window_s: float = 60.0, max_keys: int = 1024) -> None:
        super().__init__()
        self.burst, self.window_s, self.max_keys = burst, window_s, max_keys
        # key -> [window start (monotonic), records in this window, dropped in this window]
        self._seen: OrderedDict[tuple[Any, ...], list[float]] = OrderedDict()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a bad format string: let the handler report it as usual
            return True
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        key = (record.name, record.levelno, text[:500], exc)
        now = time.monotonic()
        note = ""
        with self._lock:
            entry = self._seen.get(key)
            if entry is None or now - entry[0] >= self.window_s:
                if entry is not None and entry[2]:
                    note = f" ({int(entry[2])} more like this suppressed in {self.window_s:g}s)"
                entry = [now, 0, 0]
                self._seen[key] = entry
                if len(self._seen) > self.max_keys:
                    self._seen.popitem(last=False)
            else:
                self._seen.move_to_end(key)
            entry[1] += 1
            if entry[1] > self.burst:
                entry[2] += 1
                return False
            if entry[1] == self.burst:
                note += (
                    f" (logged {self.burst} times in {now - entry[0]:.1f}s: further repeats "
                    f"are suppressed for up to {self.window_s:g}s)"
                )
        if note:
            record.msg, record.args = text + note, None
        return True


def setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RepeatLimit())
    if fmt == "json":
        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's access log would print a line per request: too much for a busy server.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # APScheduler logs every job run at INFO: one line every few seconds, forever.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
