"""One daemon harness for the tests, the drills and the benchmarks (not shipped in the wheel).

- `free_port()`: a loopback port nothing listens on (for a daemon that must keep its port
  across restarts; otherwise give `port = 0` and read `DaemonProcess.url`).
- `write_config(path, data_dir, model, **sections)`: a daemon's TOML config.
- `clean_env(extra)`: the inherited environment without CONTROLPLANE_* (the config file under
  test is the only configuration) and without MALLOC_ARENA_MAX, plus `extra`.
- `DaemonProcess.start(config)`: `controlplane serve --config CONFIG` as a subprocess, its
  output in a log file, ready once /health/ready answers 200; `stop()` (SIGTERM, wait, then
  SIGKILL), `kill()` (SIGKILL), `rss()`, `log_tail()`, `lines`, `wait_for(needle)`.
  `DaemonError` when it exits or is not ready in time, with the log's tail.
- `admin_sections(**sections)`: config sections over the tests' usual daemon (an admin token,
  ADMIN_TOKEN; records, events and config-file checks at short intervals).
- `InProcessDaemon(cfg)`: the real daemon and HTTP server in a thread of this process; a
  context manager (start, then stop and `assert_stopped_clean`). `InProcessDaemon.configured(
  folder, model, **sections)` writes its config; `from_file(path)` reads one.
- `drain(engine)`: an engine stepped to the end; `assert_no_leaks(engine)`: nothing left held.
- `rows(url)`, `wait_rows(url, predicate)`: the request rows in SQL.

Run from the repository root: `python -m pytest`, `python -m drills.<name>`,
`python -m benchmarks.<name>` (the root is on sys.path; nothing edits it).
"""

from __future__ import annotations

from harness.config import (
    ADMIN_TOKEN,
    REPO_ROOT,
    admin_sections,
    clean_env,
    free_port,
    toml_value,
    write_config,
)
from harness.engine import assert_no_leaks, drain
from harness.inprocess import InProcessDaemon
from harness.process import STARTED, DaemonError, DaemonProcess
from harness.store import rows, wait_rows

__all__ = [
    "ADMIN_TOKEN",
    "REPO_ROOT",
    "STARTED",
    "DaemonError",
    "DaemonProcess",
    "InProcessDaemon",
    "admin_sections",
    "assert_no_leaks",
    "clean_env",
    "drain",
    "free_port",
    "rows",
    "toml_value",
    "wait_rows",
    "write_config",
]
