"""The runtime: what the HTTP app, the admin API and the scheduled jobs receive.

The daemon (controlplane.daemon) wires and runs the process: it opens the store, loads
the model, starts and stops everything and fans config changes out. Every layer below it gets
this one object instead, and it is their only handle on the engine: they ask it to tokenize,
validate and queue a request, for statistics, the live request list, the KV block map, the
model's size; nothing above the engine touches `Engine` or its tokenizer, block pool or model
config directly (tests/test_architecture.py checks it).

The runtime also holds the request-side state shared by those layers: the server state
(loading/ready/draining), the in-flight records, the Prometheus metrics, the event streams
and the one path a config change takes (`change_config`: validate, audit, apply).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from controlplane.common import percentile
from controlplane.config import ApiKey, Config
from controlplane.engine.errors import InvalidSettingError
from controlplane.http.auth import AdminAuth, match_bearer
from controlplane.runtime.live_config import ConfigAuditError, FieldChange, LiveConfig
from controlplane.store.records import RequestRecord, hash_api_key
from controlplane.telemetry.metrics import Metrics
from controlplane.telemetry.stats import cache_and_speculation, structured_outputs, summarize

if TYPE_CHECKING:
    from sqlalchemy import Engine as SQLEngine

    from controlplane.engine import AsyncEngine, RequestOutput, RequestStream, SamplingParams
    from controlplane.engine.structured import CompiledGrammar, StructuredOutput
    from controlplane.engine.types import StepStats
    from controlplane.store.recorder import Recorder

log = logging.getLogger("controlplane.daemon")  # same logger as before the split: same log lines
access_log = logging.getLogger("controlplane.access")

LOADING, READY, DRAINING, STOPPED, DEAD = "loading", "ready", "draining", "stopped", "dead"
COUNTER_WINDOW_S = 60.0  # /admin/stats: hit and acceptance rates over the last minute
# StepStats kept (about one a second): the counter window twice over, and the autopilot's
# widest window (autopilot.max_window_s is at most this).
HISTORY_S = 600
# A running request's row is rewritten (still "running") with the tokens generated so far at
# most this often: a process killed outright (SIGKILL after a short `docker stop`, the OOM
# killer) leaves it "interrupted" with the completion tokens of at most this long ago (the
# journal line is written at once; see controlplane.store.journal).
PROGRESS_INTERVAL_S = 1.0


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def log_access(rec: RequestRecord) -> None:
    """The access log line of a finished request (server.access_log): its fields are `extra`s,
    so JSON logs carry them as keys."""
    latency_ms = None if rec.e2e_latency_s is None else round(rec.e2e_latency_s * 1000, 1)
    fields = {
        "request_id": rec.id,
        "x_request_id": rec.x_request_id,
        "api_key_name": rec.api_key_name,
        "user": rec.end_user,
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


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    """A finished request, as the last minute's latency figures and the autopilot see it."""

    time: float  # when it finished (time.time())
    ttft: float | None  # seconds; None: no token
    gaps: list[float]  # inter-token gaps, seconds
    constrained: bool  # its output had a structured-output constraint


class Runtime:
    """One per daemon. `aengine` is None until the model has loaded (state "loading")."""

    def __init__(
        self, live: LiveConfig, instance_id: str, admin_auth: AdminAuth, model_name: str = ""
    ) -> None:
        self.live = live
        self.instance_id = instance_id
        self.admin_auth = admin_auth
        self.model_name = model_name
        self.state = LOADING
        self.started_at = time.time()
        self.aengine: AsyncEngine | None = None  # set by the daemon once loaded
        self.recorder: Recorder | None = None
        # The daemon's SLO autopilot (controlplane.autopilot.runner.Autopilot; not imported
        # here, even for typing: it is built on this module, not the other way round).
        self.autopilot: Any = None
        self.db: SQLEngine | None = None  # the store, once open
        self.shutting_down = False  # set by the daemon: a drain can no longer be resumed
        self.shutdown_aborted: set[str] = set()
        self.admin_aborted: dict[str, str] = {}  # request id -> admin token name
        self._keys = [(k, hash_api_key(k.key)) for k in live.effective.api_keys]
        self.metrics = Metrics(model_name or "loading")
        self.request_meta: dict[str, RequestRecord] = {}  # in flight, by request id
        self._progress_at: dict[str, float] = {}  # id -> time of its last progress record
        # Grammar compiles (structured outputs) run here: off the event loop and the step
        # thread. Two workers: one slow schema does not hold up every other compile.
        self._grammar_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._event_queues: set[asyncio.Queue] = set()
        self._metrics_step = -1
        # Recently finished requests: latency percentiles and the structured share over the
        # last minute for /admin/stats, the autopilot's window.
        self._finished: deque[Finished] = deque(maxlen=10_000)
        # StepStats kept about once a second (pump_metrics) for a minute: the cumulative
        # counters differenced over the last minute (hit rate, acceptance rate).
        self._history: deque[StepStats] = deque(maxlen=HISTORY_S)
        # One config change at a time: each is planned, audited, then applied (see
        # change_config), and a second one planned meanwhile would revert the first.
        self._config_lock = asyncio.Lock()
        self._stats_json: tuple[float, str] = (-1.0, "")  # (monotonic time, serialized)

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
            self._progress_at.pop(rec.id, None)
        if self.recorder is not None:
            self.recorder.submit(rec)

    def progress(self, rec: RequestRecord, out: RequestOutput) -> None:
        """A running request produced `out`: at most every PROGRESS_INTERVAL_S, record it again
        as running with its tokens so far, so that a kill loses at most that much of its usage."""
        if out.finished or self.recorder is None:
            return
        now = time.time()
        last = self._progress_at.get(rec.id)
        if last is None:
            last = rec.arrival_time.timestamp()
        if now - last < PROGRESS_INTERVAL_S:
            return
        self._progress_at[rec.id] = now
        m = out.metrics
        first = m.first_token_time
        self.recorder.submit(
            dataclasses.replace(
                rec,
                first_token_time=None if first is None else datetime.fromtimestamp(first, UTC),
                ttft_s=m.ttft,
                prompt_tokens=m.num_prompt_tokens,
                cached_prompt_tokens=m.num_cached_tokens,
                completion_tokens=m.num_output_tokens,
                preemptions=m.num_preemptions,
            )
        )

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
            self._finished.append(
                Finished(time.time(), out.metrics.ttft, gaps, final.structured is not None)
            )

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
            rec.draft_tokens, rec.accepted_draft_tokens = m.num_draft_tokens, m.num_accepted_tokens
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
            self.broadcast({"type": "state", "state": self.state, "actor": actor})

    def resume(self, actor: str) -> None:
        if self.state == DRAINING and not self.shutting_down:
            self.state = READY
            log.info("resumed: admitting requests (admin %s)", actor, extra={"event": "ready"})
            self.broadcast({"type": "state", "state": self.state, "actor": actor})

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
        recent = self.finished_since(now - 60.0)
        ttfts = [f.ttft for f in recent if f.ttft is not None]
        gaps = [g for f in recent for g in f.gaps]

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
        # The counters as of the last snapshot before the window (none: the daemon is younger
        # than the window, so since start).
        older = [h for h in self._history if h.time < now - COUNTER_WINDOW_S]
        latest, base = steps[-1] if steps else None, older[-1] if older else None
        body.update(cache_and_speculation(latest, base))
        constrained = sum(f.constrained for f in recent)
        body.update(structured_outputs(latest, base, constrained, len(recent)))
        body.update(
            counter_window_s=COUNTER_WINDOW_S,
            enable_prefix_caching=s.enable_prefix_caching,
            speculative_method=s.speculative_method,
            speculative_num_tokens=s.speculative_num_tokens,
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
            memory=self.memory(),
            autopilot=self.autopilot.brief() if self.autopilot is not None else None,
        )
        return body

    def finished_since(self, since: float) -> list[Finished]:
        """The requests finished after `since`, oldest first."""
        return [f for f in self._finished if f.time > since]

    def snapshots(self) -> list[StepStats]:
        """The engine's StepStats kept about once a second (HISTORY_S of them), oldest first."""
        return list(self._history)

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
        if self.aengine is None:
            return []

        now = time.time()
        rows = await self.aengine.live_requests()
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

    def broadcast(self, event: dict[str, Any]) -> None:
        for queue in self._event_queues:
            if queue.full():  # a slow client loses its oldest event, never slows anyone
                queue.get_nowait()
            queue.put_nowait(event)

    def pump_metrics(self) -> None:
        if self.autopilot is not None:  # however it was switched (API, file, itself)
            self.metrics.autopilot_enabled.set(float(self.autopilot.state != "off"))
        if self.aengine is None:
            return
        steps = self.aengine.recent_steps(self._metrics_step)
        if steps:
            self._metrics_step = steps[-1].step
            self.metrics.observe_steps(steps)
            if not self._history or steps[-1].time - self._history[-1].time >= 1.0:
                self._history.append(steps[-1])

    def check_config(self, changes: Mapping[str, Any], source: str) -> list[FieldChange]:
        """What `change_config` would change, validated the same way; applies nothing (a fleet
        change asks every instance this before any applies)."""
        return list(self.live.plan(changes, source).changes)

    async def change_config(
        self,
        changes: Mapping[str, Any],
        source: str,
        actor: str | None = None,
        change_id: str | None = None,
        reason: str | None = None,
    ) -> list[FieldChange]:
        """The one way a running daemon changes its config: validate, write the audit rows
        (and new price rows) in a worker thread, then apply. If the audit write fails, the
        change is not applied and ConfigAuditError says why. `change_id` goes on every audit
        row of this change (a fresh one when None), and `reason` too."""
        change_id = change_id or uuid.uuid4().hex
        async with self._config_lock:
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

    # -- the engine: the one handle the layers above it have --------------------------------------
    @property
    def _engine(self) -> AsyncEngine:
        if self.aengine is None:
            raise RuntimeError("the engine is not loaded")
        return self.aengine

    @property
    def engine_loaded(self) -> bool:
        return self.aengine is not None

    @property
    def engine_running(self) -> bool:
        """The step loop runs (False once it has died)."""
        return self.aengine is not None and self.aengine.is_running

    @property
    def max_model_len(self) -> int | None:
        return self.aengine.engine.max_model_len if self.aengine else None

    def tokenize(self, text: str) -> list[int]:
        return self._engine.engine.tokenizer.encode(text)

    @property
    def chat_template(self) -> str:
        """The model's chat template (Jinja text; empty when it has none)."""
        return self._engine.engine.tokenizer.chat_template or ""

    def tokenize_chat(
        self, messages: Any, add_generation_prompt: bool, escape: bool, **template_vars: Any
    ) -> list[int]:
        """A chat's prompt tokens (its template); ValueError for messages it cannot render.
        Tools are rendered into the messages and `template_vars` by the /v1 surface
        (controlplane.openai.tools)."""
        tok = self._engine.engine.tokenizer
        return tok.encode_chat(messages, add_generation_prompt, escape=escape, **template_vars)

    def warm_grammars(self) -> None:
        """Build the grammar engine's view of the vocabulary now, in the background (0.4 s for
        SmolLM2's 49k tokens), rather than in the first constrained request."""
        self._grammar_pool.submit(self._engine.engine.grammars.warm)

    async def compile_grammar(self, output: StructuredOutput, timeout_s: float) -> Any:
        """Compile (or find cached) a request's grammar in a worker thread, never on the
        step thread or the event loop. InvalidSettingError naming the field when it cannot be
        compiled or takes longer than `timeout_s` (the compile then finishes in the
        background and is cached)."""
        grammars = self._engine.engine.grammars
        hit = grammars.cached(output)
        if hit is not None:
            return hit
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._grammar_pool, grammars.compile, output)
        try:
            return await asyncio.wait_for(asyncio.shield(work), timeout_s)
        except TimeoutError:
            raise InvalidSettingError(
                output.field,
                f"compiling its grammar took longer than {timeout_s:g} s "
                "(server.grammar_compile_timeout_s); simplify the schema",
            ) from None

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (logprobs)."""
        return self._engine.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's checks of one request (InvalidSettingError naming the field): run once,
        at the front, before anything is queued."""
        # The /v1 parser built `params` (SamplingParams checks itself as it is built), so only
        # the model-dependent checks run here: each check once per request.
        self._engine.engine.validate_request(prompt_ids, params, check_params=False)

    def add_validated(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        grammar: CompiledGrammar | None = None,
    ) -> RequestStream:
        """Queue a request `validate` has accepted: the engine does not check it again."""
        return self._engine.add_request(
            prompt_ids, params, request_id, validated=True, grammar=grammar
        )

    def abort(self, request_id: str) -> None:
        if self.aengine is not None:
            self.aengine.abort(request_id)

    def stats(self) -> Any:
        """The engine's latest StepStats (controlplane.engine.types); None before it loads."""
        return self.aengine.stats() if self.aengine else None

    def kv_block_map(self, buckets: int) -> tuple[list[float], list[float]]:
        """Fraction of KV blocks in use, and of blocks cached but unused (evictable), per range
        of block ids: a compact map of the cache."""
        if self.aengine is None:
            return [], []
        pool = self.aengine.engine.block_pool
        return pool.occupancy(buckets), pool.cached_occupancy(buckets)

    async def reset_prefix_cache(self, source: str, actor: str | None) -> int:
        """Drop every cached block nobody holds (on the step thread). Audited first, like a
        config change (field `engine.prefix_cache_reset`, the evictable block count going to
        0): if the audit row cannot be written, nothing is reset (ConfigAuditError)."""
        if self.aengine is None:
            raise RuntimeError("the engine is not loaded")
        before = self.aengine.stats().kv_blocks_evictable
        change = FieldChange("engine.prefix_cache_reset", before, 0)
        async with self._config_lock:
            await asyncio.to_thread(
                self._write_audit, self.cfg, [change], source, actor, uuid.uuid4().hex
            )
            dropped = await self.aengine.call(lambda engine: engine.reset_prefix_cache())
        log.info("prefix cache reset by admin %s: %d blocks dropped", actor, dropped)
        self.broadcast({"type": "cache_reset", "dropped_blocks": dropped, "actor": actor})
        return dropped

    def flops_per_token(self) -> float:
        return self._engine.engine.model_config.flops_per_token()

    def memory(self) -> dict[str, Any] | None:
        return dataclasses.asdict(self.aengine.engine.memory) if self.aengine else None

    def describe_model(self) -> str:
        """The start-up line's model part: architecture, dtype, device and KV cache size."""
        eng = self._engine.engine
        kv, bs = eng.block_pool.num_blocks, eng.settings.block_size
        return (
            f"model {self.model_name} ({eng.model_config.architecture}, {eng.dtype}, "
            f"{eng.device}), KV cache {kv} blocks x {bs} tokens = {kv * bs} tokens"
        )

    def update_settings(self, **changes: Any) -> None:
        if self.aengine is not None:
            self.aengine.update_settings(**changes)
