"""What every drill needs: a real `controlplane serve` subprocess on the tiny demo model, its
admin API, its RSS, and its request rows in SQL.

Drills print what they measure and end with one PASS/FAIL line per check; the exit status is
1 when a check failed. They are run by hand and by CI's drill step (tests/test_drills.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import sqlalchemy as sa

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / ".bench" / "tiny"
ADMIN_TOKEN = "drill-admin-token-0123456789"
MB = 1024 * 1024


def log(msg: str) -> None:
    print(msg, flush=True)


def tiny_model() -> Path:
    from controlplane.engine.demo_model import write_demo_model  # imports torch: only here

    return write_demo_model(MODEL_DIR, size="tiny")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


@dataclass
class Daemon:
    """One daemon; `start()` again after a kill reuses its config, data dir and port."""

    workdir: Path
    db_url: str | None = None  # None: SQLite in the data dir
    engine: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def store_url(self) -> str:
        return self.db_url or f"sqlite:///{self.workdir / 'data' / 'controlplane.db'}"

    def write_config(self) -> Path:
        engine = {"model": str(tiny_model()), "dtype": "float32", **self.engine}
        server = {"host": "127.0.0.1", "port": self.port, **self.server}
        lines = [f"data_dir = {_toml(str(self.workdir / 'data'))}"]
        if self.db_url:
            lines += ["[store]", f"url = {_toml(self.db_url)}"]
        for name, table in (("server", server), ("engine", engine)):
            lines.append(f"[{name}]")
            lines += [f"{k} = {_toml(v)}" for k, v in table.items()]
        lines += ["[[admin_tokens]]", 'name = "drill"', f"token = {_toml(ADMIN_TOKEN)}"]
        path = self.workdir / "controlplane.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, timeout_s: float = 300) -> None:
        config = self.write_config()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
        self.starts += 1
        out = (self.workdir / f"daemon-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane", "serve", "--config", str(config)],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"daemon never became healthy:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        path = self.workdir / f"daemon-{self.starts}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stats(self) -> dict[str, Any]:
        r = httpx.get(
            self.url + "/admin/stats",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
        )
        r.raise_for_status()
        return r.json()

    def rss(self) -> int:
        assert self.proc is not None
        return psutil.Process(self.proc.pid).memory_info().rss

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 120) -> int:
        """SIGTERM (a graceful drain); returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def wait_idle(self, timeout_s: float = 120) -> dict[str, Any]:
        """Stats once nothing runs or waits (and the last step's stats say so)."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.stats()
            engine = s.get("engine") or s
            if engine.get("num_running") == 0 and engine.get("num_waiting") == 0:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.5)

    def rows(self) -> list[tuple[str, str]]:
        """(id, status) of every request row."""
        eng = sa.create_engine(self.store_url)
        try:
            with eng.connect() as c:
                return [(r[0], r[1]) for r in c.execute(sa.text("SELECT id, status FROM requests"))]
        finally:
            eng.dispose()

    def rows_by_request_id(self) -> dict[str, list[str]]:
        """x_request_id -> the statuses of its rows (one, if nothing is lost or doubled)."""
        eng = sa.create_engine(self.store_url)
        try:
            with eng.connect() as c:
                out: dict[str, list[str]] = {}
                for rid, status in c.execute(sa.text("SELECT x_request_id, status FROM requests")):
                    out.setdefault(rid, []).append(status)
                return out
        finally:
            eng.dispose()

    def wait_rows_final(self, timeout_s: float = 60) -> list[tuple[str, str]]:
        """The rows, once none is `running` (the recorder writes in batches), or at the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.rows()
            if all(status != "running" for _, status in rows) or time.monotonic() > deadline:
                return rows
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
