"""`controlplane serve`: the engine, the HTTP API and the request recorder in one process.

Threads: the engine steps in its own thread (AsyncEngine); the recorder writes SQL in its own
thread; the asyncio loop serves HTTP and never waits on either.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from controlplane.config import ApiKey, Config, demo_model_path
from controlplane.store.records import RequestRecord, hash_api_key

if TYPE_CHECKING:
    from controlplane.engine import AsyncEngine, RequestOutput
    from controlplane.store.recorder import Recorder

log = logging.getLogger("controlplane.daemon")

LOADING, READY, DRAINING, STOPPED, DEAD = "loading", "ready", "draining", "stopped", "dead"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the daemon drains before it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def instance_id(cfg: Config) -> str:
    if cfg.server.instance_id:
        return cfg.server.instance_id
    path = cfg.data_path / "instance_id"
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = f"cp-{uuid.uuid4().hex[:12]}"
    path.write_text(value + "\n")
    return value


class Daemon:
    def __init__(self, cfg: Config, install_signals: bool = True) -> None:
        self.cfg = cfg
        self.install_signals = install_signals
        self.state = LOADING
        self.started_at = time.time()
        self.aengine: AsyncEngine | None = None
        self.recorder: Recorder | None = None
        self.model_name = cfg.server.model_name
        self.instance_id = instance_id(cfg)
        self.url = ""
        self.ready = asyncio.Event()
        self._shutdown = asyncio.Event()
        self.shutdown_aborted: set[str] = set()
        self._keys = [(k, hash_api_key(k.key)) for k in cfg.api_keys]

    # -- requests: checks used by the API ------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.state == READY and self.aengine is not None and self.aengine.is_running

    def authenticate(self, authorization: str | None) -> tuple[ApiKey, str] | None:
        """The matching key and its hash; compared in constant time against every key."""
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        given = authorization[7:].strip().encode()
        found = None
        for key, digest in self._keys:
            if hmac.compare_digest(given, key.key.encode()):
                found = (key, digest)
        return found

    def record(self, rec: RequestRecord) -> None:
        if self.recorder is not None:
            self.recorder.submit(rec)

    def final_record(
        self, rec: RequestRecord, out: RequestOutput | None, error: str | None = None
    ) -> RequestRecord:
        """Fill a started record from the request's last output (None: it never produced one)."""
        now = datetime.now(UTC)
        rec = dataclasses.replace(
            rec, finish_time=now, e2e_latency_s=(now - rec.arrival_time).total_seconds()
        )
        if out is not None:
            m = out.metrics

            def ts(value: float | None) -> datetime | None:
                return None if value is None else datetime.fromtimestamp(value, UTC)

            rec.first_token_time = ts(m.first_token_time)
            rec.finish_time = ts(m.finish_time) or now
            rec.queue_time_s, rec.ttft_s, rec.mean_itl_s = m.queue_time, m.ttft, m.mean_itl
            rec.e2e_latency_s = m.e2e_latency if m.finish_time is not None else rec.e2e_latency_s
            rec.prompt_tokens = m.num_prompt_tokens
            rec.cached_prompt_tokens = m.num_cached_tokens
            rec.completion_tokens = m.num_output_tokens
            rec.preemptions = m.num_preemptions
        if error is not None:
            rec.status, rec.finish_reason, rec.error = "error", "error", error
        elif out is not None and out.finished and out.finish_reason in ("stop", "length"):
            rec.status, rec.finish_reason = "success", out.finish_reason
        else:
            rec.status = "aborted"
            rec.finish_reason = "shutdown" if rec.id in self.shutdown_aborted else "abort"
        return rec

    # -- lifecycle ------------------------------------------------------------------------------
    def _open_store(self) -> None:
        from controlplane.store import Recorder, make_engine, mark_interrupted, sync_prices
        from controlplane.store.migrate import upgrade

        url = self.cfg.store_url
        upgrade(url)
        db = make_engine(url)
        sync_prices(db, self.cfg.prices)
        n = mark_interrupted(db, self.instance_id)
        if n:
            log.warning("marked %d request rows left running by a previous crash as interrupted", n)
        self.recorder = Recorder(db, self.cfg.store)
        log.info("recording requests to %s", db.url.render_as_string(hide_password=True))

    def _load_engine(self) -> AsyncEngine:
        from controlplane.engine import AsyncEngine, Engine

        settings = self.cfg.engine
        if not settings.model:
            from controlplane.engine.demo_model import write_demo_model

            path = demo_model_path(self.cfg)
            log.info("no model configured: using the small demo model in %s", path)
            settings = dataclasses.replace(
                settings, model=str(write_demo_model(path, size="small"))
            )
        self.model_name = self.model_name or Path(settings.model).name
        return AsyncEngine(Engine(settings))

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        if self.install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_shutdown, sig.name)
        log.info("loading", extra={"event": "loading"})
        if self.cfg.store.record_requests:
            await asyncio.to_thread(self._open_store)
        from controlplane.server.app import create_app

        server = _Server(
            uvicorn.Config(
                create_app(self),
                host=self.cfg.server.host,
                port=self.cfg.server.port,
                log_config=None,
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=1,
            )
        )
        server_task = asyncio.create_task(server.serve())
        while not server.started:
            if server_task.done():
                await server_task  # raises the bind error
                return 1
            await asyncio.sleep(0.01)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        print(f"controlplane: listening on {self.url} (loading the model)", flush=True)
        try:
            self.aengine = await asyncio.to_thread(self._load_engine)
        except Exception as exc:
            log.error("model failed to load: %s", exc)
            self.state = DEAD
            await self._stop(server, server_task)
            return 1
        self.aengine.start()
        eng = self.aengine.engine
        kv = eng.block_pool.num_blocks
        self.state = READY
        self.ready.set()
        print(
            f"controlplane: ready on {self.url}: model {self.model_name} ({eng.model_config.architecture}, "
            f"{eng.dtype}, {eng.device}), KV cache {kv} blocks x {eng.settings.block_size} tokens "
            f"= {kv * eng.settings.block_size} tokens",
            flush=True,
        )
        log.info("ready", extra={"event": "ready"})
        await self._shutdown.wait()
        await self._drain()
        await self._stop(server, server_task)
        return 0

    def request_shutdown(self, reason: str = "request") -> None:
        if not self._shutdown.is_set():
            log.info("shutdown requested (%s)", reason)
            self._shutdown.set()

    async def _drain(self) -> None:
        self.state = DRAINING
        aeng = self.aengine
        timeout = self.cfg.server.drain_timeout_s
        n = aeng.num_unfinished if aeng else 0
        log.info(
            "draining: %d requests in flight, up to %.0fs", n, timeout, extra={"event": "draining"}
        )
        deadline = time.monotonic() + timeout
        while aeng is not None and aeng.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if aeng is not None and aeng.num_unfinished:
            left = aeng.unfinished_ids()
            log.warning("drain timeout: aborting %d requests", len(left))
            self.shutdown_aborted.update(left)
            for rid in left:
                aeng.abort(rid)
            # Their handlers record them; give the streams a moment to deliver the abort.
            for _ in range(200):
                if not aeng.num_unfinished:
                    break
                await asyncio.sleep(0.01)

    async def _stop(self, server: _Server, server_task: asyncio.Task) -> None:
        await asyncio.sleep(0.05)  # let handlers that just finished submit their records
        server.should_exit = True
        with contextlib.suppress(Exception):
            await server_task
        if self.aengine is not None:
            await self.aengine.shutdown()
        if self.recorder is not None:
            ok = await asyncio.to_thread(self.recorder.close, 30.0)
            if not ok:
                log.error("could not flush every request record before exit")
        self.state = STOPPED
        log.info("stopped", extra={"event": "stopped"})
        print("controlplane: stopped", flush=True)
