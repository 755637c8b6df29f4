"""`controlplane serve`: the engine, the HTTP API and the request recorder in one process.

Threads: the engine steps in its own thread (AsyncEngine); the recorder writes SQL in its own
thread; the asyncio loop serves HTTP and never waits on either.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from controlplane.admin_api.auth import AdminAuth, match_bearer, resolve_tokens
from controlplane.admin_api.metrics import Metrics
from controlplane.admin_api.stats import percentile, summarize
from controlplane.config import ApiKey, Config, default_model, read_toml
from controlplane.engine.errors import InvalidSettingError
from controlplane.server.live_config import (
    ConfigAuditError,
    ConfigChangeError,
    FieldChange,
    LiveConfig,
)
from controlplane.store.records import RequestRecord, hash_api_key

if TYPE_CHECKING:
    from controlplane.engine import AsyncEngine, RequestOutput
    from controlplane.store.recorder import Recorder

log = logging.getLogger("controlplane.daemon")
access_log = logging.getLogger("controlplane.access")

LOADING, READY, DRAINING, STOPPED, DEAD = "loading", "ready", "draining", "stopped", "dead"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the daemon drains before it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


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


def log_access(rec: RequestRecord) -> None:
    """The access log line of a finished request (server.access_log): its fields are `extra`s,
    so JSON logs carry them as keys."""
    latency_ms = None if rec.e2e_latency_s is None else round(rec.e2e_latency_s * 1000, 1)
    fields = {
        "request_id": rec.id,
        "api_key_name": rec.api_key_name,
        "endpoint": rec.endpoint,
        "model": rec.model,
        "status": rec.status,
        "finish_reason": rec.finish_reason,
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "latency_ms": latency_ms,
    }
    text = " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())
    access_log.info("%s", text, extra=fields)


class Daemon:
    def __init__(
        self,
        cfg: Config,
        install_signals: bool = True,
        config_path: str | Path | None = None,
        file_raw: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = dict(os.environ if env is None else env)
        self.live = LiveConfig(cfg, file_raw or {}, env)
        self.config_path = Path(config_path) if config_path else None
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
        self.admin_aborted: dict[str, str] = {}  # request id -> admin token name
        self._keys = [(k, hash_api_key(k.key)) for k in cfg.api_keys]
        tokens, token_file = resolve_tokens(cfg, env)
        self.admin_auth = AdminAuth(tokens)
        self.admin_token_file = token_file
        self.metrics = Metrics(cfg.server.model_name or "loading")
        self.db = None  # sqlalchemy Engine, once the store is open
        self.jobs = None  # controlplane.server.jobs.Jobs, once the engine is ready
        self.request_meta: dict[str, RequestRecord] = {}  # in flight, by request id
        self._event_queues: set[asyncio.Queue] = set()
        self._metrics_step = -1
        # (finish time, TTFT s, inter-token gaps s) of recently finished requests: latency
        # percentiles over the last minute for /admin/stats.
        self._latencies: deque[tuple[float, float | None, list[float]]] = deque(maxlen=10_000)
        # One config change at a time: each is planned, audited, then applied (see
        # change_config), and a second one planned meanwhile would revert the first.
        self._config_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()  # reloads started by SIGHUP (kept referenced)
        self.live.subscribe(self._on_config_change)

    @property
    def cfg(self) -> Config:
        """The effective configuration (live changes included)."""
        return self.live.effective

    # -- requests: checks used by the API ------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """Readiness: loaded and admitting requests (GET /health, /health/ready)."""
        return self.state == READY and self.aengine is not None and self.aengine.is_running

    @property
    def alive(self) -> bool:
        """Liveness (GET /health/live): the step loop has not died. A model still loading has
        no step loop yet and is alive; restarting it would only start the load over."""
        if self.state == LOADING:
            return True
        return self.aengine is not None and self.aengine.is_running

    def authenticate(self, authorization: str | None) -> tuple[ApiKey, str] | None:
        """The matching key and its hash (see match_bearer: constant time, every key compared)."""
        i = match_bearer(authorization, [key.key.encode() for key, _ in self._keys])
        return None if i is None else self._keys[i]

    def record(self, rec: RequestRecord) -> None:
        if rec.status == "running":
            self.request_meta[rec.id] = rec
        else:
            self.request_meta.pop(rec.id, None)
        if self.recorder is not None:
            self.recorder.submit(rec)

    def finish(
        self,
        rec: RequestRecord,
        out: RequestOutput | None,
        token_times: list[float],
        error: str | None = None,
    ) -> None:
        """Record a request's end and count it in the metrics."""
        final = self.final_record(rec, out, error)
        self.record(final)
        if self.cfg.server.access_log:
            log_access(final)
        if out is not None:
            reason = out.finish_reason if out.finished and out.finish_reason else "abort"
            self.metrics.observe_request(reason, out.metrics, token_times)
            gaps = [b - a for a, b in itertools.pairwise(token_times)]
            self._latencies.append((time.time(), out.metrics.ttft, gaps))

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
        if error is None and out is not None and out.finish_reason == "error":
            error = out.error or "request failed in the engine"  # the engine kept serving
        if error is not None:
            rec.status, rec.finish_reason, rec.error = "error", "error", error
        elif out is not None and out.finished and out.finish_reason in ("stop", "length"):
            rec.status, rec.finish_reason = "success", out.finish_reason
        else:
            rec.status = "aborted"
            rec.finish_reason = "shutdown" if rec.id in self.shutdown_aborted else "abort"
            actor = self.admin_aborted.pop(rec.id, None)
            if actor is not None:
                rec.error = f"aborted by admin ({actor})"
        return rec

    # -- admin: control -------------------------------------------------------------------------
    def abort_request(self, request_id: str, actor: str) -> bool:
        """Abort a request in flight; False if it is not (unknown, or already finished)."""
        if (
            request_id not in self.request_meta
            or self.aengine is None
            or request_id not in self.aengine.unfinished_ids()  # ended, record not yet written
        ):
            return False
        self.admin_aborted[request_id] = actor
        self.aengine.abort(request_id)
        log.info("request %s aborted by admin (%s)", request_id, actor)
        return True

    def drain(self, actor: str) -> None:
        if self.state == READY:
            self.state = DRAINING
            log.info(
                "draining: admitting no new requests (admin %s)", actor, extra={"event": "draining"}
            )
            self._broadcast({"type": "state", "state": self.state, "actor": actor})

    def resume(self, actor: str) -> None:
        if self.state == DRAINING and not self._shutdown.is_set():
            self.state = READY
            log.info("resumed: admitting requests (admin %s)", actor, extra={"event": "ready"})
            self._broadcast({"type": "state", "state": self.state, "actor": actor})

    # -- admin: visibility ----------------------------------------------------------------------
    def queue_length(self, incoming: int = 0) -> int:
        """Requests accepted but not running, `incoming` more included: those waiting at the
        engine's last step, plus those accepted since then (the step's statistics do not show
        them yet) that the free max_num_seqs slots cannot take."""
        if self.aengine is None:
            return 0
        s = self.aengine.stats()
        waiting = s.num_waiting + s.num_swapped
        new = max(0, self.aengine.num_unfinished - s.num_running - waiting) + incoming
        if waiting:  # something besides free slots holds requests back (KV blocks, budget)
            return waiting + new
        return max(0, new - max(0, self.cfg.engine.max_num_seqs - s.num_running))

    def stats_payload(self) -> dict[str, Any]:
        s = self.cfg.engine
        now = time.time()
        steps = self.aengine.recent_steps() if self.aengine else []
        body = summarize(
            steps,
            now=now,
            window_s=10.0,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
        )
        recent = [item for item in self._latencies if item[0] > now - 60.0]
        ttfts = [t for _, t, _ in recent if t is not None]
        gaps = [g for _, _, gs in recent for g in gs]

        def ms(values: list[float], q: float) -> float | None:
            return None if not values else round(1000 * percentile(values, q), 3)

        body.update(
            ttft_p50_ms=ms(ttfts, 50),
            ttft_p99_ms=ms(ttfts, 99),
            itl_p50_ms=ms(gaps, 50),
            itl_p99_ms=ms(gaps, 99),
            latency_window_s=60.0,
            requests_finished_in_window=len(recent),
        )
        body.update(
            state=self.state if self.state != READY or self.healthy else DEAD,
            model=self.model_name or None,
            uptime_s=round(now - self.started_at, 3),
            time=now,
            requests_in_flight=self.aengine.num_unfinished if self.aengine else 0,
            queue_length=self.queue_length(),
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_queue_len=self.cfg.server.max_queue_len,
            memory=dataclasses.asdict(self.aengine.engine.memory) if self.aengine else None,
        )
        return body

    async def live_requests(self) -> list[dict[str, Any]]:
        if self.aengine is None:
            return []

        def snapshot(engine: Any) -> list[dict[str, Any]]:
            return [
                {
                    "id": rid,
                    "state": seq.status.value,
                    "prompt_tokens": len(seq.prompt_token_ids),
                    "output_tokens": len(seq.output_token_ids),
                    "preemptions": seq.metrics.num_preemptions,
                    "arrival_time": seq.metrics.arrival_time,
                }
                for rid, seq in engine.requests.items()
            ]

        now = time.time()
        rows = await self.aengine.call(snapshot)
        for row in rows:
            meta = self.request_meta.get(row["id"])
            row["api_key_name"] = meta.api_key_name if meta else None
            row["endpoint"] = meta.endpoint if meta else None
            row["age_s"] = round(now - row.pop("arrival_time"), 3)
        return rows

    def subscribe_events(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=64)
        self._event_queues.add(queue)
        return queue

    def unsubscribe_events(self, queue: asyncio.Queue) -> None:
        self._event_queues.discard(queue)

    def _broadcast(self, event: dict[str, Any]) -> None:
        for queue in self._event_queues:
            if queue.full():  # a slow client loses its oldest event, never slows anyone
                queue.get_nowait()
            queue.put_nowait(event)

    def pump_metrics(self) -> None:
        if self.aengine is None:
            return
        steps = self.aengine.recent_steps(self._metrics_step)
        if steps:
            self._metrics_step = steps[-1].step
            self.metrics.observe_steps(steps)

    # -- config changes -------------------------------------------------------------------------
    def _on_config_change(
        self, new: Config, changes: list[FieldChange], source: str, actor: str | None
    ) -> None:
        engine_changes = {
            c.field.split(".", 1)[1]: c.new for c in changes if c.field.startswith("engine.")
        }
        if engine_changes and self.aengine is not None:
            self.aengine.update_settings(**engine_changes)
        if self.jobs is not None:
            from controlplane.server.jobs import ROLLUP_JOB, SAMPLE_JOB

            intervals = {
                "jobs.utilization_interval_s": SAMPLE_JOB,
                "jobs.rollup_interval_s": ROLLUP_JOB,
            }
            for c in changes:
                if c.field in intervals:
                    self.jobs.reschedule(intervals[c.field], c.new)
        if self.recorder is not None and any(c.field == "prices" for c in changes):
            self.recorder.reload_prices()  # the new rows are in the table already (audit)
        self.metrics.config_changed(source, len(changes))
        self.metrics.set_config(self.live.live_values())
        self._broadcast(
            {
                "type": "config",
                "time": datetime.now(UTC).isoformat(),
                "source": source,
                "actor": actor,
                "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in changes],
            }
        )

    async def change_config(
        self, changes: Mapping[str, Any], source: str, actor: str | None = None
    ) -> list[FieldChange]:
        """The one way a running daemon changes its config: validate, write the audit rows
        (and new price rows) in a worker thread, then apply. If the audit write fails, the
        change is not applied and ConfigAuditError says why."""
        async with self._config_lock:
            plan = self.live.plan(changes, source)
            if plan.changes:
                try:
                    await asyncio.to_thread(
                        self._write_audit, plan.new, list(plan.changes), source, actor
                    )
                except ConfigAuditError as exc:
                    if source != "file":  # a reload logs its own rejection
                        log.error("config change from %s (%s) rejected: %s", source, actor, exc)
                    raise
            return self.live.commit(plan, source, actor)

    def _write_audit(
        self, new: Config, changes: list[FieldChange], source: str, actor: str | None
    ) -> None:
        """Audit rows and price rows in one transaction: both are written or neither."""
        from controlplane.store import sync_prices
        from controlplane.store.audit import ConfigChange, write_changes

        when = datetime.now(UTC)
        entries = [ConfigChange(when, source, actor, c.field, c.old, c.new) for c in changes]
        try:
            if self.db is None:
                raise RuntimeError("the store is not open")
            with self.db.begin() as conn:
                if any(c.field == "prices" for c in changes):
                    sync_prices(conn, new.prices)
                write_changes(conn, self.instance_id, entries)
        except Exception as exc:
            fields = ", ".join(c.field for c in changes)
            raise ConfigAuditError(
                f"could not write the audit log ({type(exc).__name__}: {_first_line(exc)}); "
                f"nothing changed ({fields})"
            ) from exc

    async def reload_config(self, reason: str) -> None:
        if self.config_path is None:
            log.warning(
                "config reload (%s) ignored: the daemon was started without --config", reason
            )
            return
        try:
            raw = read_toml(self.config_path)
            live, restart = self.live.file_changes(raw)
            changes = await self.change_config(live, "file") if live else []
        except (ConfigChangeError, InvalidSettingError) as exc:
            log.error("config reload (%s) rejected, keeping the running values: %s", reason, exc)
            return  # the file is read again on the next change or SIGHUP
        self.live.file_read(raw)
        if restart:
            log.warning(
                "config file changes that need a restart (not applied): %s", ", ".join(restart)
            )
            self._broadcast({"type": "restart_required", "fields": restart})
        if not changes and not restart:
            log.info("config reload (%s): nothing changed", reason)

    def _reload_soon(self, reason: str) -> None:
        """SIGHUP handler: reload in a task (signal handlers cannot await)."""
        task = asyncio.get_running_loop().create_task(self.reload_config(reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_config(self) -> None:
        """Reload when the file's mtime or size changes (polling: works on every filesystem)."""
        assert self.config_path is not None

        def stamp() -> tuple[int, int] | None:
            try:
                st = self.config_path.stat()
            except OSError:
                return None
            return st.st_mtime_ns, st.st_size

        last = stamp()
        while True:
            await asyncio.sleep(self.cfg.server.config_watch_interval_s)
            now = stamp()
            if now == last or now is None:
                continue
            # The writer may not be done (a truncated file reads as keys removed): reload only
            # once the file has stopped changing for a moment.
            while True:
                await asyncio.sleep(0.2)
                settled = stamp()
                if settled == now:
                    break
                now = settled
            last = now
            await self.reload_config("file changed")

    async def _pump_metrics_forever(self) -> None:
        # Counters must see every step even if nobody scrapes for a while: the step ring is
        # finite, so drain it into the metrics twice a second.
        while True:
            self.pump_metrics()
            await asyncio.sleep(0.5)

    # -- lifecycle ------------------------------------------------------------------------------
    def _open_store(self) -> None:
        from controlplane.store import Recorder, make_engine, mark_interrupted, sync_prices
        from controlplane.store.db import check_store
        from controlplane.store.migrate import upgrade
        from controlplane.store.recorder import replay_journal

        url = self.cfg.store_url
        check_store(url)  # one clear line (StoreUnavailableError, cli.main) if it cannot open
        upgrade(url)
        db = make_engine(url)
        sync_prices(db, self.cfg.prices)
        # A killed predecessor's journal first: what it had not committed gets its row, and the
        # ones still "running" are then marked interrupted with the rest.
        journal_dir = self.cfg.data_path / "journal" / self.instance_id
        replay_journal(db, journal_dir)
        mark_interrupted(db, self.instance_id)  # it logs the count (once)
        self.db = db
        where = db.url.render_as_string(hide_password=True)
        if self.cfg.store.record_requests:
            self.recorder = Recorder(
                db, self.cfg.store, journal_dir=journal_dir if self.cfg.store.journal else None
            )
            log.info("recording requests to %s", where)
        else:
            log.info(
                "request recording is off (store.record_requests = false); audit log in %s", where
            )

    def _load_engine(self) -> AsyncEngine:
        from controlplane.engine import AsyncEngine, Engine
        from controlplane.engine.gguf.known import served_model_name

        settings = self.cfg.engine
        if not settings.model:  # SmolLM2 if installed, else the generated demo model
            settings = dataclasses.replace(settings, model=default_model(self.cfg))
        self.model_name = self.model_name or served_model_name(settings.model)
        return AsyncEngine(Engine(settings))

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        if self.install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_shutdown, sig.name)
            loop.add_signal_handler(signal.SIGHUP, self._reload_soon, "SIGHUP")
        log.info("loading", extra={"event": "loading"})
        if self.admin_token_file is not None:
            print(f"controlplane: admin token in {self.admin_token_file}", flush=True)
        await asyncio.to_thread(self._open_store)
        background = [asyncio.create_task(self._pump_metrics_forever())]
        if self.config_path is not None:
            background.append(asyncio.create_task(self._watch_config()))
        from controlplane.server.app import create_app

        self.app = create_app(self)
        server = _Server(
            uvicorn.Config(
                self.app,
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
        self.metrics = Metrics(self.model_name)  # now that the model's name is known
        self.metrics.set_config(self.live.live_values())
        if self.recorder is not None:
            rec = self.recorder
            self.metrics.bind_recorder(lambda: rec.dropped, lambda: rec.buffered)
        kv = eng.block_pool.num_blocks
        from controlplane.server.jobs import Jobs

        self.jobs = Jobs(self)
        self.jobs.start()
        from controlplane.server.memory import configured_idle_s, trim_when_idle

        # Storms leave freed C-heap memory cached: give it back once the engine is idle.
        aeng = self.aengine
        background.append(
            asyncio.create_task(trim_when_idle(lambda: aeng.stats().step, configured_idle_s()))
        )
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
        for task in background:
            task.cancel()
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
        # Event streams end on this event instead of being cut off by the server's shutdown.
        self._broadcast({"type": "state", "state": "stopping"})
        await asyncio.sleep(0.05)  # let handlers that just finished submit their records
        server.should_exit = True
        with contextlib.suppress(Exception):
            await server_task
        if self.jobs is not None:
            await self.jobs.stop()
        if self.aengine is not None:
            await self.aengine.shutdown()
        if self.recorder is not None:
            ok = await asyncio.to_thread(self.recorder.close, 30.0)
            if not ok:
                log.error("could not flush every request record before exit")
        if self.jobs is not None:
            # After the recorder's last flush, so the last requests are in the rollup.
            await self.jobs.close()
        self.state = STOPPED
        log.info("stopped", extra={"event": "stopped"})
        print("controlplane: stopped", flush=True)
