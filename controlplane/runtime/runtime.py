"""The runtime: the one object the HTTP app, the admin API and the scheduled jobs receive.

The daemon (controlplane.daemon) wires and runs the process: it opens the store, loads the
model, starts and stops everything and fans config changes out. Every layer below it gets this
one object instead: a small container of narrow parts, each in its own module:

  engine    the engine handle, their only way to the engine (engine_handle.EngineHandle)
  ledger    a request's life: running, progress, final, aborted by whom (ledger.RequestLedger)
  live      the effective config; `change_config` is the one path a change takes: validate,
            audit, apply (live_config.LiveConfig)
  events    the /admin/events stream (events.Events)
  store     the SQL store: `db` for writers, `read` for queries (store_handle.StoreHandle)
  metrics   the Prometheus registry (controlplane.telemetry.metrics)

and the few verbs that span them: drain and resume, aborting a request, the /admin/stats body,
feeding the engine's steps to the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from controlplane.common import percentile
from controlplane.config import ApiKey, Config
from controlplane.http.auth import AdminAuth, match_bearer
from controlplane.runtime.engine_handle import EngineHandle
from controlplane.runtime.events import Events
from controlplane.runtime.ledger import RequestLedger
from controlplane.runtime.live_config import ConfigAuditError, FieldChange, LiveConfig
from controlplane.runtime.state import DaemonState
from controlplane.runtime.store_handle import StoreHandle
from controlplane.store.records import hash_api_key
from controlplane.telemetry.diagnosis import Signals, diagnose
from controlplane.telemetry.http import HttpMetrics
from controlplane.telemetry.metrics import Metrics
from controlplane.telemetry.slo import slo, thresholds
from controlplane.telemetry.stats import (
    async_scheduling,
    cache_and_speculation,
    structured_outputs,
    summarize,
)
from controlplane.telemetry.traffic import Traffic
from controlplane.tenants.budgets import BudgetEvent, BudgetTracker
from controlplane.tenants.budgets import log as budget_log
from controlplane.tenants.keys import AuthFailures, KeyCache, LiveKey, bearer_secret
from controlplane.tenants.usage import KeyUsage

if TYPE_CHECKING:
    from controlplane.engine.types import StepStats
    from controlplane.planning.whatif import WhatIf
    from controlplane.runtime.config_file import ConfigFile

log = logging.getLogger("controlplane.daemon")  # same logger as before the split: same log lines

COUNTER_WINDOW_S = 60.0  # /admin/stats: hit and acceptance rates over the last minute
# StepStats kept (about one a second): the counter window twice over, and the autopilot's
# widest window (autopilot.max_window_s is at most this).
HISTORY_S = 600
# A what-if simulates at most the window's newest this many requests: it runs twice in the
# daemon's process (a worker thread, sharing the interpreter with the step thread), at 0.2-2 ms
# a request on a 2-core CPU (docs/benchmarks.md#simulator-accuracy): a second or two at most.
WHAT_IF_MAX_ROWS = 2_000


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def latency_ms(finished: list[Any], q: float) -> dict[str, float | None]:
    """TTFT and inter-token latency q-th percentiles (ms) of `finished` requests, keyed as
    /admin/stats names them (`ttft_p99_ms`, `itl_p99_ms`); None where there is no value."""

    def ms(values: list[float]) -> float | None:
        return None if not values else round(1000 * percentile(values, q), 3)

    return {
        f"ttft_p{q:g}_ms": ms([f.ttft for f in finished if f.ttft is not None]),
        f"itl_p{q:g}_ms": ms([g for f in finished for g in f.gaps]),
    }


class Runtime:
    """One per daemon. `engine.aengine` is None until the model has loaded (state LOADING)."""

    def __init__(
        self, live: LiveConfig, instance_id: str, admin_auth: AdminAuth, model_name: str = ""
    ) -> None:
        self.live = live
        self.instance_id = instance_id
        self.admin_auth = admin_auth
        self.model_name = model_name
        self.state = DaemonState.LOADING
        self.started_at = time.time()
        self.engine = EngineHandle()
        # The HTTP series outlive the registry the daemon swaps in once the model has loaded.
        self.http_metrics = HttpMetrics(self.metrics_prefix)
        self.ledger = RequestLedger(
            live,
            Metrics(model_name or "loading", prefix=self.metrics_prefix, http=self.http_metrics),
        )
        self.events = Events()
        # /v1 arrivals, rejections and ends (counted by InferenceAPI.serve) for /admin/stats.
        self.traffic = Traffic(self.started_at)
        # The daemon's SLO autopilot (controlplane.autopilot.pilot.Autopilot; not imported
        # here, even for typing: it is built on this module, not the other way round).
        self.autopilot: Any = None
        self.store = StoreHandle()
        self.shutting_down = False  # set by the daemon: a drain can no longer be resumed
        self._keys = [(k, hash_api_key(k.key)) for k in live.effective.api_keys]
        # The api_keys table's keys (controlplane.tenants.keys), reloaded by the daemon every
        # server.key_refresh_s; and the per-address limit on failed authentications.
        self.keys = KeyCache()
        self.auth_failures = AuthFailures()
        # Each key's live usage (requests and tokens a minute, refusals, in flight): counted by
        # InferenceAPI (controlplane.openai.serving) only, read by GET /admin/keys.
        self.usage = KeyUsage()
        # The table keys' spend budgets: read from SQL every limits.budget_refresh_s (by the
        # daemon), this process's own spend counted as each request ends.
        self.budgets = BudgetTracker(
            self.keys,
            instance_id,
            datetime.fromtimestamp(self.started_at, UTC),
            lambda: self.cfg.limits.budget_soft_threshold,
        )
        self.budgets.on_event = self._budget_event
        self.ledger.on_final = self.budgets.spent
        live.table_key_names = lambda: self.keys.names
        self._metrics_step = -1
        # StepStats kept about once a second (pump_metrics) for a minute: the cumulative
        # counters differenced over the last minute (hit rate, acceptance rate).
        self._history: deque[StepStats] = deque(maxlen=HISTORY_S)
        # One config change at a time: each is planned, audited, then applied (see
        # change_config), and a second one planned meanwhile would revert the first.
        self._config_lock = asyncio.Lock()
        self._stats_json: tuple[float, str] = (-1.0, "")  # (monotonic time, serialized)
        # The file the daemon was started with (--config; None: embedded defaults), where
        # POST /admin/config/save writes the live values, with its safe reads and writes
        # (controlplane.runtime.config_file.ConfigFile; set by the daemon); and the live values
        # the last start dropped ({"field", "live", "file"}: controlplane.runtime.persist).
        self.config_file: ConfigFile | None = None
        self.dropped_at_restart: list[dict[str, Any]] = []
        # The CPU kernels' state for /admin/stats (cpu_ops.state; set by the daemon's load).
        self.cpu_kernels: Callable[[], dict[str, str]] | None = None

    def _budget_event(self, event: BudgetEvent) -> None:
        """A key passed its soft threshold or reached its budget (once per key and period):
        a log line, an /admin/events message and a Prometheus count."""
        budget_log.warning("%s", event.message(), extra={"event": f"budget_{event.kind}"})
        self.events.broadcast(event.payload())
        self.metrics.budget_event(event.standing.key, event.kind)

    def kernels(self) -> dict[str, str | None]:
        """/admin/stats `kernels` and /metrics' kernels_loaded: kernels_summary below."""
        cpu_kernels = self.cpu_kernels() if self.cpu_kernels is not None else None
        return kernels_summary(cpu_kernels, self.engine.loaded)

    @property
    def metrics_prefix(self) -> str:
        """Every series' prefix: server.metrics_prefix and a colon (restart-only)."""
        return self.live.effective.server.metrics_prefix + ":"

    @property
    def metrics(self) -> Metrics:
        """The Prometheus registry (the daemon builds a new one once the model's name is known;
        the ledger, which counts every finished request in it, holds the one in use)."""
        return self.ledger.metrics

    @metrics.setter
    def metrics(self, metrics: Metrics) -> None:
        self.ledger.metrics = metrics

    @property
    def cfg(self) -> Config:
        """The effective configuration (live changes included)."""
        return self.live.effective

    @property
    def healthy(self) -> bool:
        """Readiness: loaded and admitting requests (GET /health, /health/ready)."""
        return self.state == DaemonState.READY and self.engine.running

    @property
    def alive(self) -> bool:
        """Liveness (GET /health/live): the step loop has not died. A model still loading has
        no step loop yet and is alive; restarting it would only start the load over."""
        return self.state == DaemonState.LOADING or self.engine.running

    @property
    def reported_state(self) -> DaemonState:
        """The state as /health and /admin/stats report it: READY with a dead step loop is DEAD."""
        return (
            DaemonState.DEAD if self.state == DaemonState.READY and not self.healthy else self.state
        )

    def authenticate(self, authorization: str | None) -> tuple[ApiKey | LiveKey, str] | None:
        """The matching key and its hash: a config file key (see match_bearer: constant time,
        every key compared), else a live key of the api_keys table (KeyCache.lookup)."""
        i = match_bearer(authorization, [key.key.encode() for key, _ in self._keys])
        if i is not None:
            return self._keys[i]
        given = bearer_secret(authorization)
        found = None if given is None else self.keys.lookup(given)
        return None if found is None else (found, found.secret_hash)

    def queue_length(self, incoming: int = 0) -> int:
        """Requests accepted but not running (EngineHandle.queue_length at max_num_seqs)."""
        return self.engine.queue_length(self.cfg.engine.max_num_seqs, incoming)

    # -- admin: control -------------------------------------------------------------------------
    def abort_request(self, request_id: str, actor: str) -> bool:
        """Abort a request in flight; False if it is not (unknown, or already finished)."""
        if request_id not in self.ledger.in_flight or not self.engine.is_unfinished(request_id):
            return False  # unknown, or ended with its record not yet written
        self.ledger.admin_aborted[request_id] = actor
        self.engine.abort(request_id)
        log.info("request %s aborted by admin (%s)", request_id, actor)
        return True

    def abort_key(self, name: str, actor: str) -> list[str]:
        """Abort every request of API key `name` in flight; the ids aborted (one being
        aborted already, its abort not yet taken by the engine's step, is not counted again)."""
        ids = [
            rid
            for rid, rec in list(self.ledger.in_flight.items())
            if rec.api_key_name == name and rid not in self.ledger.admin_aborted
        ]
        return [rid for rid in ids if self.abort_request(rid, actor)]

    async def audit_action(
        self, field: str, old: Any, new: Any, source: str, actor: str | None
    ) -> str | None:
        """One audit row for an operator's action (drain, resume, abort), written after the
        action: an action in an incident must not wait on the database. None when written,
        else why not (logged)."""
        change = FieldChange(field, old, new)
        try:
            await asyncio.to_thread(
                self._write_audit, self.cfg, [change], source, actor, uuid.uuid4().hex
            )
        except ConfigAuditError as exc:
            log.error("%s %r by %s (%s) not audited: %s", field, new, actor, source, exc)
            return str(exc)
        return None

    def drain(self, actor: str) -> None:
        if self.state == DaemonState.READY:
            self.state = DaemonState.DRAINING
            log.info(
                "draining: admitting no new requests (admin %s)", actor, extra={"event": "draining"}
            )
            self.events.broadcast({"type": "state", "state": self.state, "actor": actor})

    def resume(self, actor: str) -> None:
        if self.state == DaemonState.DRAINING and not self.shutting_down:
            self.state = DaemonState.READY
            log.info("resumed: admitting requests (admin %s)", actor, extra={"event": "ready"})
            self.events.broadcast({"type": "state", "state": self.state, "actor": actor})

    # -- admin: visibility ----------------------------------------------------------------------
    def stats_payload(self) -> dict[str, Any]:
        """The /admin/stats body (the fleet heartbeat sends part of it too)."""
        s = self.cfg.engine
        now = time.time()
        steps = self.engine.recent_steps()
        body = summarize(
            steps,
            now=now,
            window_s=10.0,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
        )
        recent = self.ledger.finished_since(now - 60.0)
        body.update(
            **latency_ms(recent, 50),
            **latency_ms(recent, 99),
            latency_window_s=60.0,
            requests_finished_in_window=len(recent),
        )
        # The counters as of the last snapshot before the window (none: the daemon is younger
        # than the window, so since start).
        older = [h for h in self._history if h.time < now - COUNTER_WINDOW_S]
        latest, base = steps[-1] if steps else None, older[-1] if older else None
        body.update(cache_and_speculation(latest, base))
        body.update(async_scheduling(latest, base))
        constrained = sum(f.constrained for f in recent)
        body.update(structured_outputs(latest, base, constrained, len(recent)))
        body.update(
            counter_window_s=COUNTER_WINDOW_S,
            enable_prefix_caching=s.enable_prefix_caching,
            speculative_method=s.speculative_method,
            async_scheduling=s.async_scheduling,
            scheduling_policy=s.scheduling_policy,
            speculative_num_tokens=s.speculative_num_tokens,
        )
        body.update(
            state=self.reported_state,
            model=self.model_name or None,
            uptime_s=round(now - self.started_at, 3),
            time=now,
            requests_in_flight=self.engine.num_unfinished,
            queue_length=self.queue_length(),
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_queue_len=self.cfg.server.max_queue_len,
            memory=self.engine.memory(),
            tensor_parallel=self.engine.tensor_parallel(),
            compiled_step=self.engine.compile_state(),
            compiled_max_rows=self.engine.compiled_max_rows(),
            cpu_kernels=self.cpu_kernels() if self.cpu_kernels is not None else None,
            kernels=self.kernels(),
            autopilot=self.autopilot.brief() if self.autopilot is not None else None,
        )
        self._incident_signals(body, now, recent)
        return body

    def _incident_signals(self, body: dict[str, Any], now: float, minute: list[Any]) -> None:
        """The figures that explain an incident, added to the /admin/stats `body`: traffic
        rates, the oldest wait, 10 s latency p99s, the best completion rate, the SLO, the
        severity thresholds and the diagnosis (docs/admin-api.md lists them). `minute`: the
        requests finished in the last 60 s (oldest first), which the body's latency read."""
        rates = self.traffic.rates(now)
        body.update(rates)
        body["oldest_waiting_s"] = self._oldest_waiting_s(now)
        p99 = latency_ms([f for f in minute if f.time > now - 10.0], 99)
        body["ttft_p99_10s_ms"], body["itl_p99_10s_ms"] = p99["ttft_p99_ms"], p99["itl_p99_ms"]
        best = self.traffic.best_completion_rate(now)
        body["best_completion_rate_per_s"] = best
        cfg = self.cfg
        body["slo"] = slo(
            cfg.alerts, cfg.autopilot, minute, body["ttft_p99_ms"], body["itl_p99_ms"]
        )
        body["thresholds"] = thresholds(cfg.alerts, cfg.autopilot)
        queue = body["queue_length"]
        limit = cfg.server.max_queue_len
        full = queue >= limit > 0 or rates["rejected_429_per_s"] > 0
        found = diagnose(
            Signals(
                arrivals_per_s=rates["arrivals_per_s"],
                best_completion_rate_per_s=best,
                queue_growing=full or self.traffic.queue_growing(now, queue),
                oldest_waiting_s=body["oldest_waiting_s"],
                waiting=max(queue, body["num_waiting"] + body["num_swapped"]),
                kv_usage_perc=body["kv_usage_perc"],
                preemptions_in_window=body["preemptions_in_window"],
                prefill_step_p50_ms=body["prefill_step_p50_ms"],
                decode_step_p50_ms=body["decode_step_p50_ms"],
            )
        )
        body["diagnosis"] = None if found is None else found.to_dict()

    def _oldest_waiting_s(self, now: float) -> float | None:
        """Age of the oldest request not running: waiting (or swapped out) in the engine at its
        last step, or accepted since that step began (the engine has not shown it yet)."""
        arrivals = []
        latest = self.engine.stats()
        if latest is not None and latest.oldest_waiting_arrival is not None:
            arrivals.append(latest.oldest_waiting_arrival)
        seen = latest.time - latest.step_duration if latest is not None else now
        arrivals += [
            t
            for rec in list(self.ledger.in_flight.values())
            if (t := rec.arrival_time.timestamp()) > seen
        ]
        return round(max(0.0, now - min(arrivals)), 3) if arrivals else None

    def stats_json(self, max_age_s: float = 0.1) -> str:
        """stats_payload as JSON, shared by every /admin/events subscriber: computed at most
        once per `max_age_s`. Computed per subscriber, 500 open streams at 2 snapshots/s took
        the event loop from serving (output throughput fell 98%, drills/idle_connections.py)."""
        now = time.monotonic()
        at, body = self._stats_json
        if now - at > max_age_s:
            body = json.dumps(self.stats_payload())
            self._stats_json = (now, body)
        return body

    async def live_requests(self) -> list[dict[str, Any]]:
        """The requests the engine holds, with who sent them and how long ago."""
        now = time.time()
        rows = await self.engine.live_requests()
        for row in rows:
            meta = self.ledger.in_flight.get(row["id"])
            row["api_key_name"] = meta.api_key_name if meta else None
            row["endpoint"] = meta.endpoint if meta else None
            row["age_s"] = round(now - row.pop("arrival_time"), 3)
        return rows

    def snapshots(self) -> list[StepStats]:
        """The engine's StepStats kept about once a second (HISTORY_S of them), oldest first."""
        return list(self._history)

    def pump_metrics(self) -> None:
        """Feed the engine's new steps to the metrics and the per-second history."""
        if self.autopilot is not None:  # however it was switched (API, file, itself)
            self.metrics.autopilot_enabled.set(float(self.autopilot.state != "off"))
        self.traffic.sample(time.time(), self.queue_length())
        steps = self.engine.recent_steps(self._metrics_step)
        if steps:
            self._metrics_step = steps[-1].step
            self.metrics.observe_steps(steps)
            if not self._history or steps[-1].time - self._history[-1].time >= 1.0:
                self._history.append(steps[-1])

    # -- what-if: a change simulated on the last window of traffic -----------------------------
    async def what_if(
        self, changes: Mapping[str, Any], window_s: float
    ) -> tuple[list[FieldChange], WhatIf]:
        """What `changes` (dotted live fields, validated here: ConfigChangeError, FieldError
        naming the field; the validated changes come back first) would do to the requests of
        the last `window_s` seconds, simulated under the settings in force and with the change
        (controlplane/planning/whatif.py). PlanningError while there is nothing to simulate;
        RuntimeError before the model loads; StoreNotOpenError before the store opens."""
        from controlplane.planning.costmodel import fit
        from controlplane.planning.summary import Slo
        from controlplane.planning.whatif import (
            SIMULATED,
            live_samples,
            proposed_settings,
            what_if,
        )
        from controlplane.planning.window import read_window

        changed = self.check_config(changes, "api")
        aeng = self.engine.aengine
        if aeng is None:
            raise RuntimeError("the model is still loading")
        engine = aeng.engine
        now_settings = engine.settings
        proposed = proposed_settings(now_settings, changes)
        samples = live_samples(self.engine.recent_steps())
        until = datetime.now(UTC)
        window = await self.store.read(
            read_window,
            until - timedelta(seconds=window_s),
            until,
            model=self.model_name,
            max_rows=WHAT_IF_MAX_ROWS,
            newest=True,
        )
        cfg = self.cfg
        slo = Slo(cfg.autopilot.ttft_p99_ms, cfg.autopilot.itl_p99_ms)
        hourly_usd = cfg.jobs.gpu_hourly_usd * max(1, cfg.jobs.num_gpus)

        def simulate() -> WhatIf:  # the fit too: off the event loop (thousands of steps)
            return what_if(
                window,
                now_settings,
                proposed,
                sorted(k for k in changes if k not in SIMULATED),
                fit(samples, engine),
                engine.model_config.vocab_size,
                engine.max_model_len,
                slo,
                hourly_usd,
            )

        return changed, await asyncio.to_thread(simulate)

    # -- config: the one audited change path -----------------------------------------------------
    def check_config(self, changes: Mapping[str, Any], source: str) -> list[FieldChange]:
        """What `change_config` would change, validated the same way; applies nothing (a fleet
        change asks every instance this before any applies)."""
        return list(self.live.plan(changes, source).changes)

    async def change_config(
        self,
        changes: Mapping[str, Any] | Callable[[Config], Mapping[str, Any]],
        source: str,
        actor: str | None = None,
        change_id: str | None = None,
        reason: str | None = None,
    ) -> list[FieldChange]:
        """The one way a running daemon changes its config: validate, write the audit rows
        (and new price rows) in a worker thread, then apply. If the audit write fails, the
        change is not applied and ConfigAuditError says why. `change_id` goes on every audit
        row of this change (a fresh one when None), and `reason` too. `changes` may be a
        function of the effective config, called under the lock (a read-modify-write such as
        suspending one more key can then not revert a change made meanwhile)."""
        change_id = change_id or uuid.uuid4().hex
        async with self._config_lock:
            if callable(changes):
                changes = changes(self.cfg)
            plan = self.live.plan(changes, source)
            if reason is not None:  # carried to the listeners (the events the TUI shows)
                with_reason = tuple(dataclasses.replace(c, reason=reason) for c in plan.changes)
                plan = dataclasses.replace(plan, changes=with_reason)
            if plan.changes:
                try:
                    await asyncio.to_thread(
                        self._write_audit,
                        plan.new,
                        list(plan.changes),
                        source,
                        actor,
                        change_id,
                        reason,
                    )
                except ConfigAuditError as exc:
                    if source != "file":  # a reload logs its own rejection
                        log.error("config change from %s (%s) rejected: %s", source, actor, exc)
                    raise
            return self.live.commit(plan, source, actor)

    def _write_audit(
        self,
        new: Config,
        changes: list[FieldChange],
        source: str,
        actor: str | None,
        change_id: str,
        reason: str | None = None,
    ) -> None:
        """Audit rows and price rows in one transaction: both are written or neither."""
        from controlplane.store import sync_prices
        from controlplane.store.audit import ConfigChange, write_changes

        when = datetime.now(UTC)
        entries = [
            ConfigChange(when, source, actor, c.field, c.old, c.new, change_id, reason)
            for c in changes
        ]
        try:
            if self.store.db is None:
                raise RuntimeError("the store is not open")
            with self.store.db.begin() as conn:
                if any(c.field == "prices" for c in changes):
                    sync_prices(conn, new.prices)
                write_changes(conn, self.instance_id, entries)
        except Exception as exc:
            fields = ", ".join(c.field for c in changes)
            raise ConfigAuditError(
                f"could not write the audit log ({type(exc).__name__}: {_first_line(exc)}); "
                f"nothing changed ({fields})"
            ) from exc

    async def reset_prefix_cache(self, source: str, actor: str | None) -> int:
        """Drop every cached block nobody holds (on the step thread). Audited first, like a
        config change (field `engine.prefix_cache_reset`, the evictable block count going to
        0): if the audit row cannot be written, nothing is reset (ConfigAuditError)."""
        stats = self.engine.stats()
        if stats is None:
            raise RuntimeError("the engine is not loaded")
        change = FieldChange("engine.prefix_cache_reset", stats.kv_blocks_evictable, 0)
        async with self._config_lock:
            await asyncio.to_thread(
                self._write_audit, self.cfg, [change], source, actor, uuid.uuid4().hex
            )
            dropped = await self.engine.reset_prefix_cache()
        log.info("prefix cache reset by admin %s: %d blocks dropped", actor, dropped)
        self.events.broadcast({"type": "cache_reset", "dropped_blocks": dropped, "actor": actor})
        return dropped

    async def save_config(self, source: str, actor: str | None) -> dict[str, Any]:
        """Write every live value that differs from the config file into it (POST
        /admin/config/save; controlplane.runtime.persist), audited first (field `config_file`,
        new value the fields saved; ConfigAuditError: nothing written). SaveError when there
        is no file (embedded defaults), it cannot be read or written, or it is not the file
        last applied (config_file.ConfigFile.read_for_save). The file is read before the config
        lock is taken: a stuck read never holds up other changes."""
        from controlplane.runtime.persist import SaveError, plan_save

        file = self.config_file
        if file is None:
            raise SaveError(
                "the daemon runs on embedded defaults (started without --config): "
                "there is no config file to save to"
            )
        path = file.path
        async with file.exclusive():  # no reload applies the file between the read and the write
            read = await file.read_for_save()
            async with self._config_lock:  # no change applied between the plan and the write
                # tomlkit's parse of up to 4 MiB: off the event loop.
                plan = await asyncio.to_thread(plan_save, path, read.text, self.cfg)
                fields = [field for field, _ in plan.saved]
                if fields:
                    change = FieldChange("config_file", None, fields)
                    await asyncio.to_thread(
                        self._write_audit,
                        self.cfg,
                        [change],
                        source,
                        actor,
                        uuid.uuid4().hex,
                        f"written to {path}",
                    )
                    await file.write(plan.text, read)
                    self.live.file_saved(plan.raw, fields)
                    log.info("live values saved to %s by %s (%s): %s", path, actor, source, fields)
        return {"path": str(path), "saved": [{"field": f, "value": v} for f, v in plan.saved]}


# What the kernels are doing while a start has not finished with them: not yet a fallback's
# reason, but not serving either.
_KERNELS_PENDING = {
    "unused": "the model is not loaded yet",
    "building": "building the CPU kernels",
    "waiting": "waiting for another process's build of the CPU kernels",
}


def kernels_summary(cpu_kernels: dict[str, str] | None, loaded: bool) -> dict[str, str | None]:
    """/admin/stats `kernels` (the dashboard's `kernels: ok | fallback: <reason>`): `ok` when
    our C++ kernels serve, or are not needed (a model loaded on another device never asks for
    them: `unused`); else `fallback`, torch's kernels, with why (`cpu_kernels` has the state)."""
    state = (cpu_kernels or {}).get("state", "unused")
    if state == "ready" or (state == "unused" and loaded):
        return {"status": "ok", "reason": None}
    reason = (cpu_kernels or {}).get("reason") or _KERNELS_PENDING.get(state) or state
    return {"status": "fallback", "reason": reason}
