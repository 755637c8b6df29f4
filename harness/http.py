"""An HTTP client on a daemon, as the tests' callers make one."""

from __future__ import annotations

import httpx


def client(url: str, key: str | None = None, timeout: float = 60) -> httpx.Client:
    """An httpx client on `url`, with `key` (an API key or admin token) as its bearer token
    when given."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=timeout)
