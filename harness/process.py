"""`controlplane serve` as a subprocess: start, readiness, output, stop, kill, RSS."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from harness import http
from harness.config import clean_env

# Every daemon subprocess started here: the tests' conftest kills the ones still alive after
# each test, so a failing assertion never leaves a daemon running.
STARTED: list[subprocess.Popen] = []

TAIL_LINES = 80


class DaemonError(RuntimeError):
    """The daemon exited, or was not ready (or not stopped) in time; the message ends with the
    tail of its output."""


def _fresh_log(folder: Path) -> Path:
    """daemon.log in `folder`, or daemon-2.log, ... when taken (a restart on the same config
    keeps the earlier log). Created exclusively: daemons started at once get one each."""
    for n in range(1, 10_000):
        path = folder / ("daemon.log" if n == 1 else f"daemon-{n}.log")
        try:
            path.open("xb").close()
        except FileExistsError:
            continue
        return path
    raise DaemonError(f"no free daemon log name in {folder}")


@dataclass(eq=False)
class DaemonProcess:
    config: Path
    proc: subprocess.Popen
    log_path: Path
    url: str = ""

    @classmethod
    def start(
        cls,
        config: Path,
        wait_ready: bool = True,
        timeout: float = 120,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        preexec_fn: Any = None,
        log_path: Path | None = None,
    ) -> DaemonProcess:
        """`controlplane serve --config CONFIG ARGS`, its stdout and stderr in `log_path`
        (default: a fresh daemon*.log beside the config). Returns once it listens (`url` read
        from its output, so port 0 works) and, with `wait_ready`, once it is ready: GET
        /health/ready answers 200 and it has said so ("ready on"). `env`: variables set on top
        of `clean_env()`; `preexec_fn`: run in the child before exec (lower a resource limit,
        say). DaemonError, with the log's tail, if it exits or is not ready within `timeout` (it
        is killed then)."""
        log_path = log_path or _fresh_log(config.parent)
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "controlplane", "serve", "--config", str(config), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=clean_env(env),
                preexec_fn=preexec_fn,
            )
        STARTED.append(proc)
        d = cls(config, proc, log_path)
        deadline = time.monotonic() + timeout
        try:
            try:
                line = d.wait_for("listening on", timeout)
            except TimeoutError:
                raise DaemonError(f"daemon not listening within {timeout:g}s{d._tail()}") from None
            d.url = line.split("listening on ")[1].split()[0]
            if wait_ready:
                d.wait_ready(max(0.0, deadline - time.monotonic()))
        except BaseException:
            d.kill()  # a daemon that did not start is not left running
            raise
        return d

    def wait_ready(self, timeout: float) -> None:
        """Until GET /health/ready answers 200 and the daemon has printed its "ready on" line
        (its start is over: the fleet beat that follows readiness included)."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            self._raise_if_exited("before it was ready")
            try:
                r = httpx.get(self.url + "/health/ready", timeout=2.0)
                if r.status_code == 200:
                    break
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise DaemonError(
                    f"/health/ready did not answer 200 within {timeout:g}s (last: {last})"
                    + self._tail()
                )
            time.sleep(0.05)
        try:
            self.wait_for("ready on", max(0.0, deadline - time.monotonic()) + 5)
        except TimeoutError:
            raise DaemonError(f"ready, but no 'ready on' line{self._tail()}") from None

    # -- output --------------------------------------------------------------------------------

    @property
    def lines(self) -> list[str]:
        """Every line the daemon has written so far (only whole lines while it runs)."""
        try:
            text = self.log_path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            return []
        if self.proc.poll() is None and not text.endswith("\n"):
            text = text.rpartition("\n")[0]
        return text.splitlines()

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        return "\n".join(self.lines[-lines:])

    def _tail(self) -> str:
        return f"\n--- {self.log_path} (tail) ---\n{self.log_tail()}"

    def _raise_if_exited(self, when: str) -> None:
        if self.proc.poll() is not None:
            raise DaemonError(f"daemon exited ({self.proc.returncode}) {when}{self._tail()}")

    def wait_for(self, needle: str, timeout: float) -> str:
        """The first output line containing `needle`, once there is one. DaemonError if the
        daemon exits without writing it, TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            exited = self.proc.poll() is not None  # before reading: its last lines are in
            for line in self.lines:
                if needle in line:
                    return line
            if exited:
                raise DaemonError(
                    f"daemon exited ({self.proc.returncode}) without {needle!r}{self._tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {needle!r} in daemon output{self._tail()}")
            time.sleep(0.05)

    def client(self, key: str | None = None, timeout: float = 60) -> httpx.Client:
        """An HTTP client on this daemon, with `key` as its bearer token when given."""
        return http.client(self.url, key, timeout)

    # -- the process ---------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> int:
        """Resident set size of the daemon process, in bytes."""
        import psutil  # the test extra

        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(
        self, sig: int = signal.SIGTERM, timeout: float = 60, *, check: bool = True
    ) -> int | None:
        """Send `sig` (SIGTERM: a graceful drain) and wait up to `timeout` seconds; returns the
        exit status. A daemon still running then is killed (SIGKILL): with `check`, that is a
        DaemonError; without, the result is None."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            if check:
                name = signal.Signals(sig).name
                raise DaemonError(
                    f"daemon ignored {name} for {timeout:g}s: killed it{self._tail()}"
                ) from None
            return None

    def kill(self) -> int:
        """SIGKILL (no drain, no flush); returns the exit status."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(30)
