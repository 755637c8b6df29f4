"""The real daemon and its HTTP server in a thread of this process, so a test can see (and
patch) the engine."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from pathlib import Path
from typing import Any


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

    def start(self, timeout: float = 120, wait_ready: bool = True) -> InProcessDaemon:
        """Start and wait until the model has loaded; `wait_ready=False`: only until the HTTP
        server listens (the model may still be loading)."""
        self._thread.start()
        self._started.wait(timeout)
        deadline = time.monotonic() + timeout

        def waiting() -> bool:
            if self.daemon is None:
                return True
            return not self.daemon.ready.is_set() if wait_ready else not self.daemon.url

        while waiting():
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
