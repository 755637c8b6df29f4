"""`controlplane serve`: the engine, the HTTP API and the request recorder in one process.

This module wires and runs (start, load, drain, stop, config fan-out); what the HTTP app, the
admin API and the jobs use at run time is the Runtime (controlplane.runtime.runtime) it hands
them. Only the CLI imports this module (tests/test_architecture.py).

Threads: the engine steps in its own thread (AsyncEngine); the recorder writes SQL in its own
thread; the asyncio loop serves HTTP and never waits on either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from controlplane.config import Config, served_model_name_of, serving_settings
from controlplane.http.auth import AdminAuth, resolve_tokens
from controlplane.runtime.config_file import ConfigFile
from controlplane.runtime.live_config import FieldChange, LiveConfig
from controlplane.runtime.runtime import Runtime
from controlplane.runtime.start import DEADLINE, LoadThread, StartStopped, exit_now, time_left
from controlplane.runtime.state import DaemonState
from controlplane.telemetry.metrics import Metrics

if TYPE_CHECKING:
    from controlplane.engine import AsyncEngine
    from controlplane.fleet.heartbeat import FleetMember
    from controlplane.jobs.periodic import Jobs
    from controlplane.store.recorder import Recorder

log = logging.getLogger("controlplane.daemon")

# A start stopped while the model loads (SIGTERM, or server.start_timeout_s): how long the
# daemon waits for a CPU kernel build in progress to stop (ninja and its compilers get SIGTERM,
# torch removes its lock) before it exits anyway; and, past the deadline, how long /health and
# /health/live answer `dead` before the exit (a probe or curl in flight sees why).
STOP_BUILD_WAIT_S = 10.0
DEAD_REPORT_S = 1.0


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
    """Wires and runs the process: store, model, HTTP server, jobs, signals and config reloads.

    What the app, the admin API and the jobs use lives in `self.runtime` (Runtime); they get
    that, never the daemon, so nothing below imports this module."""

    def __init__(
        self,
        cfg: Config,
        install_signals: bool = True,
        config_path: str | Path | None = None,
        file_raw: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = dict(os.environ if env is None else env)
        live = LiveConfig(cfg, file_raw or {}, env)
        tokens, token_file = resolve_tokens(cfg, env)
        # The served name from the start: the metrics carry it while the model loads.
        self.runtime = Runtime(live, instance_id(cfg), AdminAuth(tokens), served_model_name_of(cfg))
        from controlplane.autopilot.pilot import Autopilot

        self.runtime.autopilot = Autopilot(self.runtime)
        self.config_path = Path(config_path) if config_path else None
        # Reloads (SIGHUP, the watcher): read off the loop, only a complete regular file.
        self.config_file = (
            ConfigFile(
                self.config_path,
                live,
                self.runtime.change_config,
                self.runtime.events.broadcast,
                lambda: self.runtime.cfg.server,
            )
            if self.config_path is not None
            else None
        )
        self.runtime.config_file = self.config_file  # saves: the same safe read
        self.install_signals = install_signals
        self.admin_token_file = token_file
        self.url = ""
        self.ready = asyncio.Event()
        self._shutdown = asyncio.Event()
        self.jobs: Jobs | None = None  # once the engine is ready
        self.fleet: FleetMember | None = None  # this daemon's fleet row, once listening
        self._tasks: set[asyncio.Task] = set()  # reloads started by SIGHUP (kept referenced)
        self._stop_loading = threading.Event()  # abandons a CPU kernel build (cpu_ops)
        self._engine_died = False  # the step loop died: serve() stops with status 1
        live.subscribe(self._on_config_change)

    # Read-only views of the runtime, for the CLI and tests.
    @property
    def cfg(self) -> Config:
        """The effective configuration (live changes included)."""
        return self.runtime.cfg

    @property
    def live(self) -> LiveConfig:
        return self.runtime.live

    @property
    def aengine(self) -> AsyncEngine | None:
        return self.runtime.engine.aengine

    @property
    def recorder(self) -> Recorder | None:
        return self.runtime.ledger.recorder

    @property
    def instance_id(self) -> str:
        return self.runtime.instance_id

    @property
    def state(self) -> str:
        return self.runtime.state

    # -- config changes -------------------------------------------------------------------------
    def _on_config_change(
        self, new: Config, changes: list[FieldChange], source: str, actor: str | None
    ) -> None:
        engine_changes = {
            c.field.split(".", 1)[1]: c.new for c in changes if c.field.startswith("engine.")
        }
        if engine_changes:
            self.runtime.engine.update_settings(**engine_changes)
        if self.jobs is not None:
            from controlplane.jobs.periodic import AUTOPILOT_JOB, ROLLUP_JOB, SAMPLE_JOB

            intervals = {
                "jobs.utilization_interval_s": SAMPLE_JOB,
                "jobs.rollup_interval_s": ROLLUP_JOB,
                "autopilot.interval_s": AUTOPILOT_JOB,
            }
            for c in changes:
                if c.field in intervals:
                    self.jobs.reschedule(intervals[c.field], c.new)
        if self.recorder is not None and any(c.field == "prices" for c in changes):
            self.recorder.reload_prices()  # the new rows are in the table already (audit)
        self.runtime.metrics.config_changed(source, len(changes))
        self.runtime.metrics.set_config(self.live.live_values())
        self.runtime.events.broadcast(
            {
                "type": "config",
                "time": datetime.now(UTC).isoformat(),
                "source": source,
                "actor": actor,
                "changes": [
                    {"field": c.field, "old": c.old, "new": c.new, "reason": c.reason}
                    for c in changes
                ],
            }
        )

    async def change_config(
        self, changes: Mapping[str, Any], source: str, actor: str | None = None
    ) -> list[FieldChange]:
        return await self.runtime.change_config(changes, source, actor)

    async def reload_config(self, reason: str) -> None:
        if self.config_file is None:
            log.warning(
                "config reload (%s) ignored: the daemon was started without --config", reason
            )
            return
        # SIGHUP: the operator says the file is ready (applied even if it drops keys, with a
        # warning naming them); a rejection is logged, and the file is read again next time.
        await self.config_file.reload(reason)

    def _reload_soon(self, reason: str) -> None:
        """SIGHUP handler: reload in a task (signal handlers cannot await)."""
        task = asyncio.get_running_loop().create_task(self.reload_config(reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_config(self) -> None:
        """Poll the file and reload a change once it has settled (controlplane.runtime.config_file:
        it never dies, and never reads on the loop)."""
        assert self.config_file is not None
        await self.config_file.watch()

    async def _pump_metrics_forever(self) -> None:
        # Counters must see every step even if nobody scrapes for a while: the step ring is
        # finite, so drain it into the metrics twice a second.
        while True:
            self.runtime.pump_metrics()
            await asyncio.sleep(0.5)

    def advertise_url(self) -> str:
        """server.advertise_url, else this daemon's own address and bound port."""
        from controlplane.fleet.heartbeat import default_advertise_url

        if self.cfg.server.advertise_url:
            return self.cfg.server.advertise_url
        port = int(self.url.rsplit(":", 1)[-1]) if self.url else self.cfg.server.port
        return default_advertise_url(self.cfg.server.host, port)

    # -- lifecycle ------------------------------------------------------------------------------
    def _open_store(self) -> None:
        from controlplane.store import (
            Recorder,
            make_engine,
            mark_interrupted,
            replay_journal,
            sync_prices,
        )
        from controlplane.store.db import check_store
        from controlplane.store.migrate import upgrade

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
        self._check_restart(db)  # before the fleet row says when this run started
        self.runtime.store.db = db
        where = db.url.render_as_string(hide_password=True)
        if self.cfg.store.record_requests:
            self.runtime.ledger.recorder = Recorder(
                db, self.cfg.store, journal_dir=journal_dir if self.cfg.store.journal else None
            )
            log.info("recording requests to %s", where)
        else:
            log.info(
                "request recording is off (store.record_requests = false); audit log in %s", where
            )

    def _check_restart(self, db: Any) -> None:
        """Name the live values of the previous run that this start dropped (the file gives
        others): one warning line, one audit row (source and field `restart`) and GET
        /admin/config's `dropped_at_restart` (controlplane.runtime.persist)."""
        from controlplane.runtime.persist import SAVE_HINT, check_restart, describe_dropped
        from controlplane.store.audit import ConfigChange, write_changes

        try:
            dropped = check_restart(db, self.instance_id, self.cfg)
        except Exception as exc:  # never stops the start
            log.error("restart: could not compare with the previous run's live values: %s", exc)
            return
        self.runtime.dropped_at_restart = dropped
        if not dropped:
            return
        text = describe_dropped(dropped)
        log.warning("restart: dropped live values %s; %s", text, SAVE_HINT)
        row = ConfigChange(datetime.now(UTC), "restart", None, "restart", None, f"dropped {text}")
        try:
            write_changes(db, self.instance_id, [row])
        except Exception as exc:
            log.error("restart: could not audit the dropped live values: %s", exc)

    def _load_engine(self) -> AsyncEngine:
        from controlplane.engine import AsyncEngine, Engine
        from controlplane.engine.gguf.known import served_model_name
        from controlplane.engine.kernels import cpu_ops

        # A build of the CPU kernels waits this long for another process's; a stopped start
        # abandons it. /admin/stats reports what came of it (cpu_kernels).
        cpu_ops.configure(self.cfg.server.kernel_build_wait_s, self._stop_loading)
        self.runtime.cpu_kernels = cpu_ops.state

        settings = serving_settings(self.cfg)  # SmolLM2 if installed, else the demo model
        self.runtime.model_name = self.runtime.model_name or served_model_name(settings.model)
        return AsyncEngine(Engine(settings, long_running=True))

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
        # The api_keys table: loaded before the API listens, then every server.key_refresh_s.
        await self.runtime.keys.reload(self.runtime.store.db)
        # The budgeted keys' spend (and the price book), after the keys: every
        # limits.budget_refresh_s (live: read at each wait).
        await self.runtime.budgets.refresh(self.runtime.store.db)
        background = [
            asyncio.create_task(self._pump_metrics_forever()),
            asyncio.create_task(
                self.runtime.keys.run_forever(
                    lambda: self.runtime.store.db, lambda: self.cfg.server.key_refresh_s
                )
            ),
            asyncio.create_task(
                self.runtime.budgets.run_forever(
                    lambda: self.runtime.store.db, lambda: self.cfg.limits.budget_refresh_s
                )
            ),
        ]
        if self.config_path is not None:
            background.append(asyncio.create_task(self._watch_config()))
        from controlplane.asgi import create_app

        self.app = create_app(self.runtime)
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
        from controlplane.fleet.heartbeat import FleetMember

        self.fleet = FleetMember(self.runtime, self.advertise_url())
        await self.fleet.beat_now()  # registers (state loading); never stops the start
        background.append(asyncio.create_task(self.fleet.run_forever()))
        load = LoadThread(self._load_engine)
        try:
            timeout = time_left(self.cfg.server.start_timeout_s, self.runtime.started_at)
            self.runtime.engine.aengine = await load.result(self._shutdown, timeout)
        except StartStopped as stopped:
            code = await self._abandon_start(stopped.reason, server, server_task)
            if load.running and self.install_signals:  # this process is the daemon's own
                exit_now(code)
            return code
        except Exception as exc:
            log.error("model failed to load: %s", exc)
            self.runtime.state = DaemonState.DEAD
            await self._stop(server, server_task)
            return 1
        self.aengine.start()
        self.runtime.engine.warm_grammars()
        # Now that the model's name is known.
        self.runtime.metrics = Metrics(
            self.runtime.model_name,
            prefix=self.runtime.metrics_prefix,
            device=str(self.aengine.engine.device),
            http=self.runtime.http_metrics,
        )
        self.runtime.metrics.set_config(self.live.live_values())
        if self.recorder is not None:
            rec = self.recorder
            self.runtime.metrics.bind_recorder(lambda: rec.dropped, lambda: rec.buffered)
        # /metrics' kernels_loaded and compiled_step: what /admin/stats says, at each scrape.
        self.runtime.metrics.bind_kernels(self.runtime.kernels, self.runtime.engine.compile_state)
        self.runtime.metrics.bind_ranks(self.runtime.engine.tensor_parallel)
        from controlplane.jobs.periodic import Jobs

        self.jobs = Jobs(self.runtime)
        self.jobs.start()
        from controlplane.memory import configured_idle_s, trim_when_idle

        # Storms leave freed C-heap memory cached: give it back once the engine is idle.
        aeng = self.aengine
        background.append(
            asyncio.create_task(trim_when_idle(lambda: aeng.stats().step, configured_idle_s()))
        )
        if self.install_signals:  # this process is the daemon's own (runtime/collector.py)
            from controlplane.runtime.collector import freeze_startup_objects

            freeze_startup_objects()
        self.runtime.state = DaemonState.READY
        await self.fleet.beat_now()  # serving, now rather than at the next beat
        self.ready.set()
        print(
            f"controlplane: ready on {self.url}: {self.runtime.engine.describe_model(self.runtime.model_name)}",
            flush=True,
        )
        log.info("ready", extra={"event": "ready"})
        background.append(asyncio.create_task(self._exit_when_dead()))
        await self._shutdown.wait()
        if not self._engine_died:
            await self._drain()
        for task in background:
            task.cancel()
        await self._stop(server, server_task)
        return 1 if self._engine_died else 0

    async def _exit_when_dead(self) -> None:
        """An engine whose step loop died never steps again: report `dead` for
        server.dead_exit_s (probes and clients see why), then stop with status 1 so that a
        supervisor restarts the daemon. The requests it held have failed with the cause (their
        handlers record their rows; _stop flushes them)."""
        aeng = self.aengine
        while aeng is not None and aeng.is_running:
            await asyncio.sleep(0.2)
        if self._shutdown.is_set():
            return  # a stop in progress ends the engine itself
        wait = self.cfg.server.dead_exit_s
        log.error(
            "engine stopped: %s; reporting dead, exiting with status 1 in %g s",
            aeng.error if aeng is not None else "unknown",
            wait,
            extra={"event": "dead"},
        )
        self._engine_died = True
        await asyncio.sleep(wait)
        self.request_shutdown("engine dead")

    async def _abandon_start(self, reason: str, server: _Server, server_task: asyncio.Task) -> int:
        """The model was still loading at SIGTERM (exit 0) or at the start deadline (`dead`,
        exit 1): stop a kernel build in progress, so that no lock is left, then stop."""
        code = 0
        if reason == DEADLINE:
            limit = self.cfg.server.start_timeout_s
            log.error(
                "start: not ready within server.start_timeout_s = %g s (the model is still "
                "loading); reporting dead and exiting with status 1",
                limit,
                extra={"event": "dead"},
            )
            self.runtime.state = DaemonState.DEAD
            self.runtime.events.broadcast({"type": "state", "state": DaemonState.DEAD})
            code = 1
        else:
            log.info("start: stopped while the model was loading")
        self._stop_loading.set()
        if not await asyncio.to_thread(self._wait_build_stopped):
            log.error(
                "the CPU kernel build did not stop within %g s; exiting anyway",
                STOP_BUILD_WAIT_S,
            )
        if reason == DEADLINE:
            await asyncio.sleep(DEAD_REPORT_S)
        await self._stop(server, server_task)
        return code

    @staticmethod
    def _wait_build_stopped() -> bool:
        from controlplane.engine.kernels import cpu_ops

        return cpu_ops.wait_idle(STOP_BUILD_WAIT_S)

    def request_shutdown(self, reason: str = "request") -> None:
        if not self._shutdown.is_set():
            log.info("shutdown requested (%s)", reason)
            self.runtime.shutting_down = True  # an admin resume cannot undo this drain
            self._shutdown.set()

    async def _drain(self) -> None:
        self.runtime.state = DaemonState.DRAINING
        if self.fleet is not None:
            await self.fleet.beat_now()  # the fleet sees draining now, not at the next beat
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
            self.runtime.ledger.shutdown_aborted.update(left)
            for rid in left:
                aeng.abort(rid)
            # Their handlers record them; give the streams a moment to deliver the abort.
            for _ in range(200):
                if not aeng.num_unfinished:
                    break
                await asyncio.sleep(0.01)

    async def _stop(self, server: _Server, server_task: asyncio.Task) -> None:
        # Event streams end on this event instead of being cut off by the server's shutdown.
        self.runtime.events.broadcast({"type": "state", "state": "stopping"})
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
        self.runtime.state = DaemonState.STOPPED
        if self.fleet is not None:
            await self.fleet.stopped()
        log.info("stopped", extra={"event": "stopped"})
        print("controlplane: stopped", flush=True)
