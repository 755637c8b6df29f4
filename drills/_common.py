"""What every drill needs beyond the daemon harness (harness/): a daemon on the tiny demo model
that can be killed and started again on its own config, data dir and port, its admin stats and
request rows, and the PASS/FAIL report.

Drills print what they measure and end with one PASS/FAIL line per check; the exit status is
1 when a check failed. They are run by hand (`python -m drills.<name>` from the repository
root) and by CI's drill step (tests/daemon/test_drills.py).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness import REPO_ROOT, DaemonProcess, free_port, rows, write_config

MODEL_DIR = REPO_ROOT / ".bench" / "tiny"
ADMIN_TOKEN = "drill-admin-token-0123456789"
MB = 1024 * 1024


def log(msg: str) -> None:
    print(msg, flush=True)


def tiny_model() -> Path:
    from controlplane.engine.demo_model import write_demo_model  # imports torch: only here

    return write_demo_model(MODEL_DIR, size="tiny")


@dataclass
class Daemon:
    """One daemon; `start()` again after a kill reuses its config, data dir and port."""

    workdir: Path
    db_url: str | None = None  # None: SQLite in the data dir
    engine: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: DaemonProcess | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def store_url(self) -> str:
        return self.db_url or f"sqlite:///{self.workdir / 'data' / 'controlplane.db'}"

    def write_config(self) -> Path:
        return write_config(
            self.workdir / "controlplane.toml",
            self.workdir / "data",
            tiny_model(),
            **({"store": {"url": self.db_url}} if self.db_url else {}),
            server={"port": self.port, **self.server},
            engine={"dtype": "float32", **self.engine},
            admin_tokens=[{"name": "drill", "token": ADMIN_TOKEN}],
        )

    def start(self, timeout_s: float = 300) -> None:
        config = self.write_config()
        self.starts += 1
        self.process = DaemonProcess.start(
            config, timeout=timeout_s, log_path=self.workdir / f"daemon-{self.starts}.log"
        )

    def log_tail(self, lines: int = 60) -> str:
        return self.process.log_tail(lines) if self.process else ""

    def stats(self) -> dict[str, Any]:
        r = httpx.get(
            self.url + "/admin/stats",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
        )
        r.raise_for_status()
        return r.json()

    def rss(self) -> int:
        assert self.process is not None
        return self.process.rss()

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()

    def stop(self, timeout_s: float = 120) -> int | None:
        """SIGTERM (a graceful drain); returns the exit status (None: killed after the
        timeout)."""
        if self.process is None:
            return 0
        return self.process.stop(timeout=timeout_s, check=False)

    def wait_idle(self, timeout_s: float = 120) -> dict[str, Any]:
        """Stats once nothing runs or waits (and the last step's stats say so)."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.stats()
            engine = engine_stats(s)
            if engine.get("num_running") == 0 and engine.get("num_waiting") == 0:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.5)

    def rows(self) -> list[tuple[str, str]]:
        """(id, status) of every request row."""
        return [(r["id"], r["status"]) for r in rows(self.store_url)]

    def rows_by_request_id(self) -> dict[str, list[str]]:
        """x_request_id -> the statuses of its rows (one, if nothing is lost or doubled)."""
        out: dict[str, list[str]] = {}
        for r in rows(self.store_url):
            out.setdefault(r["x_request_id"], []).append(r["status"])
        return out

    def wait_rows_final(self, timeout_s: float = 60) -> list[tuple[str, str]]:
        """The rows, once none is `running` (the recorder writes in batches), or at the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.rows()
            if all(status != "running" for _, status in found) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


def engine_stats(stats: dict[str, Any]) -> dict[str, Any]:
    return stats.get("engine") or stats


def statuses(rows: list[tuple[str, str]]) -> dict[str, int]:
    return dict(Counter(status for _, status in rows))


@dataclass
class Checks:
    results: list[tuple[str, bool, str]] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results.append((name, ok, detail))
        return ok

    def report(self) -> int:
        log("")
        for name, ok, detail in self.results:
            log(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""))
        failed = sum(1 for _, ok, _ in self.results if not ok)
        log(f"{len(self.results) - failed} of {len(self.results)} checks passed")
        return 1 if failed else 0
