"""Run real daemons for tests: a `controlplane serve` subprocess, or in-process in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa


def write_config(
    path: Path, data_dir: Path, model: Path | None, **sections: dict[str, Any]
) -> Path:
    """A TOML config: data_dir, a free port, the given model, plus extra [section] keys."""

    def render(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return str(value)

    server = {"host": "127.0.0.1", "port": 0, **sections.pop("server", {})}
    engine = {**({"model": str(model)} if model else {}), **sections.pop("engine", {})}
    lines = [f"data_dir = {render(str(data_dir))}"]
    for name, table in (("server", server), ("engine", engine), *sections.items()):
        if isinstance(table, list):  # [[prices]], [[api_keys]], [[admin_tokens]]
            for row in table:
                lines.append(f"[[{name}]]")
                lines += [f"{k} = {render(v)}" for k, v in row.items()]
            continue
        lines.append(f"[{name}]")
        lines += [f"{k} = {render(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# Every daemon subprocess a test started: conftest kills the ones still alive after each test,
# so a failing assertion never leaves a daemon running.
STARTED: list[subprocess.Popen] = []


@dataclass
class DaemonProcess:
    config: Path
    proc: subprocess.Popen
    url: str = ""
    lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None
    _q: queue.Queue = field(default_factory=queue.Queue)

    @classmethod
    def start(
        cls,
        config: Path,
        wait_ready: bool = True,
        timeout: float = 120,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        preexec_fn: Any = None,
    ) -> DaemonProcess:
        """`controlplane serve --config CONFIG ARGS`; `env`: CONTROLPLANE_* variables to set;
        `preexec_fn`: run in the child before exec (lower a resource limit, say)."""
        # Hermetic: the config file under test (and `env`) is the only configuration (CI
        # exports CONTROLPLANE_DATA_DIR for its quickstart run, for instance).
        base = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
        env = {**base, **(env or {}), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane", "serve", "--config", str(config), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=preexec_fn,
        )
        d = cls(config, proc)
        STARTED.append(proc)
        d._reader = threading.Thread(target=d._pump, daemon=True)
        d._reader.start()
        d.wait_for("listening on", timeout)
        d.url = d.wait_for("listening on", 0).split("listening on ")[1].split()[0]
        if wait_ready:
            d.wait_for("ready on", timeout)
        return d

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            self._q.put(line)

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines:
                if needle in line:
                    return line
            if self.proc.poll() is not None and self._q.empty():
                raise RuntimeError(
                    f"daemon exited ({self.proc.returncode}):\n" + "\n".join(self.lines)
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {needle!r} in daemon output:\n" + "\n".join(self.lines))
            with contextlib.suppress(queue.Empty):
                self._q.get(timeout=0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        self._reader.join(10)  # every line the process wrote is in self.lines
        return code


class InProcessDaemon:
    """The real daemon and HTTP server on loopback, in a thread, so tests can see the engine."""

    def __init__(
        self, cfg: Any, config_path: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.env = {} if env is None else env
        self.loop = asyncio.new_event_loop()
        self.daemon: Any = None  # controlplane.daemon.Daemon, once started
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = threading.Event()
        self.exit_code: int | None = None

    def _run(self) -> None:
        from controlplane.daemon import Daemon

        asyncio.set_event_loop(self.loop)

        async def main() -> int:
            from controlplane.config import read_toml

            raw = read_toml(self.config_path) if self.config_path else {}
            self.daemon = Daemon(
                self.cfg,
                install_signals=False,
                config_path=self.config_path,
                file_raw=raw,
                env=self.env,
            )
            self._started.set()
            return await self.daemon.serve()

        self.exit_code = self.loop.run_until_complete(main())

    def start(self, timeout: float = 120) -> InProcessDaemon:
        self._thread.start()
        self._started.wait(timeout)
        deadline = time.monotonic() + timeout
        while self.daemon is None or not self.daemon.ready.is_set():
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("in-process daemon did not become ready")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        assert self.daemon is not None
        return self.daemon.url

    def openai(self) -> Any:
        """The openai library's client for this daemon (no retries: a test sees every error)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def stop(self, timeout: float = 60) -> None:
        if self.daemon is not None:
            self.loop.call_soon_threadsafe(self.daemon.request_shutdown, "test")
        self._thread.join(timeout)
        # A stopped daemon's engine (its KV cache: 1 GiB by default) sits in reference cycles
        # that only a full collection frees: without this the suite's process grew by ~1.3 GB
        # a daemon, to 17.7 GB, and was OOM-killed beside another process on 24 GB.
        gc.collect()


def rows(url: str, where: str = "1=1") -> list[dict[str, Any]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [
                dict(r._mapping)
                for r in conn.execute(sa.text(f"SELECT * FROM requests WHERE {where}"))
            ]
    finally:
        engine.dispose()


def wait_rows(url: str, predicate, timeout: float = 20, where: str = "1=1") -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = rows(url, where)
        except sa.exc.OperationalError:
            found = []
        if predicate(found):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"rows never matched; last: {found}")
        time.sleep(0.1)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
