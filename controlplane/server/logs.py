"""Logging: one line per event, plain text or JSON (server.log_format)."""

from __future__ import annotations

import json
import logging
import sys
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


def setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
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
