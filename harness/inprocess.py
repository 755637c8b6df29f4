"""The real daemon and its HTTP server in a thread of this process, so a test can see (and
patch) the engine."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from harness import http
from harness.config import admin_sections, write_config
from harness.engine import assert_no_leaks


class InProcessDaemon:
    """The real daemon and HTTP server on loopback, in a thread, so tests can see the engine.

    A context manager: `with InProcessDaemon.configured(folder, model, engine={...}) as d:`
    starts it and waits until it is ready; leaving stops it and checks that it leaked nothing
    (`assert_stopped_clean`)."""

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
        self.error: BaseException | None = None  # what ended the daemon's thread, if it raised

    @classmethod
    def from_file(
        cls, path: Path, env: dict[str, str] | None = None, *, with_file: bool = True
    ) -> InProcessDaemon:
        """A daemon (not started) on the config file at `path`, with `env` as its
        CONTROLPLANE_* environment (none: the file is the whole configuration). `with_file=False`:
        the daemon does not know the file (it neither watches it nor saves to it)."""
        from controlplane.config import load_config

        env = env or {}
        return cls(load_config(path, env=env), config_path=path if with_file else None, env=env)

    @classmethod
    def configured(
        cls,
        folder: Path,
        model: Path | str | None,
        *,
        admin: bool = False,
        env: dict[str, str] | None = None,
        with_file: bool = True,
        **sections: Any,
    ) -> InProcessDaemon:
        """A daemon (not started) on `model`, its config written to folder/cp.toml and its data
        in folder/data: `sections` as `write_config` takes them, over the test defaults
        (`admin_sections`) with `admin`."""
        if admin:
            sections = admin_sections(**sections)
        path = write_config(folder / "cp.toml", folder / "data", model, **sections)
        return cls.from_file(path, env, with_file=with_file)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            self.error = exc  # `start` raises from it at once, not at its timeout
            raise
        finally:
            self._started.set()

    def _serve(self) -> None:
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
            if self.error is not None:
                raise RuntimeError(f"in-process daemon failed: {self.error!r}") from self.error
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("in-process daemon did not become ready")
            time.sleep(0.02)
        return self

    def __enter__(self) -> InProcessDaemon:
        return self if self._thread.is_alive() else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if exc_type is None:  # a failing test's own error is the one to see
            self.assert_stopped_clean()

    @property
    def url(self) -> str:
        assert self.daemon is not None
        return self.daemon.url

    @property
    def engine(self) -> Any:
        """The inference engine (controlplane.engine.Engine) the daemon serves with."""
        return self.daemon.aengine.engine

    def client(self, key: str | None = None, timeout: float = 60) -> httpx.Client:
        """An HTTP client on this daemon, with `key` (an API key or admin token) as its bearer
        token when given."""
        return http.client(self.url, key, timeout)

    def openai(self, api_key: str = "none") -> Any:
        """The openai library's client for this daemon (no retries: a test sees every error)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def stop(self, timeout: float = 60) -> None:
        if self.daemon is not None:
            self.loop.call_soon_threadsafe(self.daemon.request_shutdown, "test")
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)
        # A stopped daemon's engine (its KV cache: 1 GiB by default) sits in reference cycles
        # that only a full collection frees: without this the suite's process grew by ~1.3 GB
        # a daemon, to 17.7 GB, and was OOM-killed beside another process on 24 GB.
        gc.collect()

    def assert_stopped_clean(self) -> None:
        """After `stop`: the daemon's thread has ended and, unless its engine died (a test that
        kills the step thread), the engine holds no request and no KV block: a drained stop
        gives everything back."""
        assert not self._thread.is_alive(), "the in-process daemon did not stop"
        aengine = None if self.daemon is None else self.daemon.aengine
        if aengine is not None and aengine.error is None:
            assert_no_leaks(aengine.engine)
