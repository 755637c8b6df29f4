"""A daemon's port, config file and environment."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

# Dropped from the inherited environment: CONTROLPLANE_* would override the config file under
# test (CI exports CONTROLPLANE_DATA_DIR for its quickstart run, for instance), and the
# allocator's arena count changes the daemon's RSS (benchmarks/rss_storms.py sets it itself).
SCRUBBED_PREFIXES = ("CONTROLPLANE_",)
SCRUBBED_NAMES = ("MALLOC_ARENA_MAX",)
# Kept: the test suite's own choice for every daemon it starts (tests/conftest.py: no
# background compile of the decode step).
KEPT_NAMES = ("CONTROLPLANE_ENGINE__COMPILE",)


def free_port() -> int:
    """A loopback TCP port that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_value(value: Any) -> str:
    """A TOML value: booleans, strings (a basic string, escaped), numbers as Python writes them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def write_config(
    path: Path, data_dir: Path, model: Path | str | None = None, **sections: Any
) -> Path:
    """A TOML config at `path`: `data_dir`, `[server]` on 127.0.0.1 port 0 (a free port, read
    back from the daemon's output), `[engine] model`, plus the given sections: a dict is a
    `[section]` (server and engine keys go over the defaults), a list of dicts is an array of
    tables (`prices=[...]`, `api_keys=[...]`, `admin_tokens=[...]`)."""
    server = {"host": "127.0.0.1", "port": 0, **sections.pop("server", {})}
    engine = {**({"model": str(model)} if model else {}), **sections.pop("engine", {})}
    lines = [f"data_dir = {toml_value(str(data_dir))}"]
    for name, table in (("server", server), ("engine", engine), *sections.items()):
        if isinstance(table, list):  # [[prices]], [[api_keys]], [[admin_tokens]]
            for row in table:
                lines.append(f"[[{name}]]")
                lines += [f"{k} = {toml_value(v)}" for k, v in row.items()]
            continue
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# The admin token of `admin_sections`: tests send it as their bearer token.
ADMIN_TOKEN = "ops-token-0123456789abcdef"


def admin_sections(**sections: Any) -> dict[str, Any]:
    """`sections` over the tests' usual daemon: an admin token `ops` (ADMIN_TOKEN) unless
    `admin_tokens` is given, records written every 0.1 s, and events and config-file checks
    every 0.2 s (so a test sees them soon)."""
    sections.setdefault("admin_tokens", [{"name": "ops", "token": ADMIN_TOKEN}])
    store = {"flush_interval_s": 0.1, **sections.pop("store", {})}
    server = {
        "events_interval_s": 0.2,
        "config_watch_interval_s": 0.2,
        **sections.pop("server", {}),
    }
    return {**sections, "store": store, "server": server}


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the scrubbed variables, plus `extra` (say, the
    CONTROLPLANE_* variables a test sets on purpose), with unbuffered Python output."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k in KEPT_NAMES or (not k.startswith(SCRUBBED_PREFIXES) and k not in SCRUBBED_NAMES)
    }
    return {**env, **(extra or {}), "PYTHONUNBUFFERED": "1"}
