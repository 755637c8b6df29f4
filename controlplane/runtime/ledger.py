"""The request ledger: a request's whole life as the daemon records it.

Created and running (`record`), its progress while it runs (`progress`: a killed process loses
at most PROGRESS_INTERVAL_S of a request's usage), and final (`finish`: success, error, or
aborted, by whom): the SQL row through the recorder, the access log line, the request metrics,
and the last minute of finished requests that /admin/stats and the autopilot read.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from controlplane.store.records import RequestRecord

if TYPE_CHECKING:
    from controlplane.engine import RequestOutput
    from controlplane.runtime.live_config import LiveConfig
    from controlplane.store.recorder import Recorder
    from controlplane.telemetry.metrics import Metrics

access_log = logging.getLogger("controlplane.access")
log = logging.getLogger("controlplane.daemon")

# A running request's row is rewritten (still "running") with the tokens generated so far at
# most this often: a process killed outright (SIGKILL after a short `docker stop`, the OOM
# killer) leaves it "interrupted" with the completion tokens of at most this long ago (the
# journal line is written at once; see controlplane.store.journal).
PROGRESS_INTERVAL_S = 1.0
FINISHED_KEPT = 10_000  # finished requests kept for the latency windows


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


class RequestLedger:
    def __init__(self, live: LiveConfig, metrics: Metrics) -> None:
        self.live = live
        self.metrics = metrics
        self.recorder: Recorder | None = None  # set by the daemon once the store is open
        self.in_flight: dict[str, RequestRecord] = {}  # running, by request id
        self.shutdown_aborted: set[str] = set()  # aborted by the daemon's shutdown
        self.admin_aborted: dict[str, str] = {}  # request id -> admin token name
        self._progress_at: dict[str, float] = {}  # id -> time of its last progress record
        # Recently finished requests: latency percentiles and the structured share over the
        # last minute for /admin/stats, the autopilot's window.
        self._finished: deque[Finished] = deque(maxlen=FINISHED_KEPT)
        # Told of every final record as it is recorded (the runtime: the budgets' own spend,
        # counted at once rather than when the row reaches the database).
        self.on_final: Callable[[RequestRecord], None] | None = None

    def record(self, rec: RequestRecord) -> None:
        if rec.status == "running":
            self.in_flight[rec.id] = rec
        else:
            self.in_flight.pop(rec.id, None)
            self._progress_at.pop(rec.id, None)
        if self.recorder is not None:
            self.recorder.submit(rec)
        if rec.status != "running" and self.on_final is not None:
            try:
                self.on_final(rec)
            except Exception:  # the request's end is recorded whatever its listener does
                log.exception("request %r: the final record's listener failed", rec.id)

    def refused(self, instance_id: str, key_name: str | None, reason: str) -> None:
        """A request refused before anything ran (no record): counted in the `refusals` table
        by the recorder (controlplane.store.recorder.Recorder.refused), per hour, key and
        reason, for the reports."""
        if self.recorder is not None:
            self.recorder.refused(instance_id, key_name, reason)

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
        *,
        max_tokens: int | None = None,
        n: int = 1,
        max_choice_tokens: int | None = None,
        priority_class: int | None = None,
    ) -> None:
        """Record a request's end and count it in the metrics (`max_tokens`, `n`: its
        parameters; `max_choice_tokens`: the most tokens one of its choices generated;
        `priority_class`: the class it was scheduled in, for the queue wait by class)."""
        final = self.final_record(rec, out, error)
        self.record(final)
        if self.live.effective.server.access_log:
            log_access(final)
        if out is not None:
            reason = out.finish_reason if out.finished and out.finish_reason else "abort"
            self.metrics.observe_request(
                reason,
                out.metrics,
                token_times,
                max_tokens=max_tokens,
                n=n,
                max_choice_tokens=max_choice_tokens,
                priority_class=priority_class,
            )
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

    def finished_since(self, since: float) -> list[Finished]:
        """The requests finished after `since`, oldest first."""
        return [f for f in self._finished if f.time > since]
