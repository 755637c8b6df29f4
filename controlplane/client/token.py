"""Where a client of the admin API finds its token (no HTTP library: the CLI imports it at
start)."""

from __future__ import annotations

import os
from pathlib import Path


def resolve_token(token: str | None, env: dict[str, str] | None = None) -> str | None:
    """--token, else CONTROLPLANE_ADMIN_TOKEN, else <data_dir>/admin_token (data dir from
    CONTROLPLANE_DATA_DIR, default `data`)."""
    env = dict(os.environ) if env is None else env
    if token:
        return token
    if env.get("CONTROLPLANE_ADMIN_TOKEN"):
        return env["CONTROLPLANE_ADMIN_TOKEN"]
    path = Path(env.get("CONTROLPLANE_DATA_DIR") or "data") / "admin_token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
