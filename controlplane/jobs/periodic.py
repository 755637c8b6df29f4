"""Scheduled jobs inside the daemon (APScheduler 3.x on the daemon's asyncio loop).

- utilization sampler (jobs.utilization_interval_s): engine busy fraction, batch fill, KV usage,
  token rates, queue length, plus NVML readings per GPU, into `utilization_samples`;
- cost rollup (jobs.rollup_interval_s): hourly buckets by model and API key into
  `cost_rollups` (idempotent, watermarked), then retention pruning; once more at shutdown,
  after the recorder's last flush;
- the SLO autopilot (autopilot.interval_s; controlplane/autopilot/pilot.py).

Database and NVML work runs in a worker thread: the event loop never waits on either.
Intervals are live: a config change reschedules the job without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime

log = logging.getLogger("controlplane.jobs")

SAMPLE_JOB, ROLLUP_JOB, AUTOPILOT_JOB = "utilization_sampler", "cost_rollup", "autopilot"


class Jobs:
    def __init__(self, runtime: Runtime) -> None:
        from controlplane.accounting.gpu import GpuTelemetry

        self.runtime = runtime
        self.gpus = GpuTelemetry()
        self.scheduler = AsyncIOScheduler(timezone=UTC)
        # One worker: samples and rollups are written in order, never concurrently.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jobs")
        self._last_sample_end = time.time()
        self._last_snapshot = None  # the engine's StepStats at the previous sample
        self.runs: dict[str, int] = {SAMPLE_JOB: 0, ROLLUP_JOB: 0}

    def start(self) -> None:
        j = self.runtime.cfg.jobs
        common: dict[str, Any] = {"coalesce": True, "max_instances": 1, "misfire_grace_time": None}
        self._last_snapshot = self.runtime.engine.stats()
        self._last_sample_end = time.time()
        self.scheduler.add_job(
            self.sample, IntervalTrigger(seconds=j.utilization_interval_s), id=SAMPLE_JOB, **common
        )
        self.scheduler.add_job(
            self.rollup, IntervalTrigger(seconds=j.rollup_interval_s), id=ROLLUP_JOB, **common
        )
        if self.runtime.autopilot is not None:
            # On the loop like the others; it decides nothing while autopilot.enabled is off.
            self.scheduler.add_job(
                self.runtime.autopilot.tick,
                IntervalTrigger(seconds=self.runtime.cfg.autopilot.interval_s),
                id=AUTOPILOT_JOB,
                **common,
            )
        self.scheduler.start()
        log.info(
            "jobs started: utilization every %.1fs, cost rollup every %.1fs",
            j.utilization_interval_s,
            j.rollup_interval_s,
        )

    def reschedule(self, job_id: str, seconds: float) -> None:
        self.scheduler.reschedule_job(job_id, trigger=IntervalTrigger(seconds=seconds))
        log.info("job %s now runs every %.1fs", job_id, seconds)

    def intervals(self) -> dict[str, float]:
        return {job.id: job.trigger.interval.total_seconds() for job in self.scheduler.get_jobs()}

    async def stop(self) -> None:
        """No scheduled run starts after this; `close` runs the last rollup."""
        self.scheduler.shutdown(wait=False)

    async def close(self) -> None:
        """At shutdown, once the recorder has written its last rows: a last cost rollup, so
        a daemon stopped before its first interval (or inside one) leaves every request
        rolled up; then the worker and NVML are released."""
        if await self.rollup():
            log.info("final cost rollup written")
        await asyncio.to_thread(self._worker.shutdown, True)
        self.gpus.close()

    def num_gpus(self) -> int:
        configured = self.runtime.cfg.jobs.num_gpus
        return configured or self.gpus.num_gpus or 1

    async def _in_worker(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def sample(self) -> None:
        from controlplane.accounting.samples import write_sample
        from controlplane.accounting.utilization import make_sample

        d = self.runtime
        cur, end = d.engine.stats(), time.time()
        if cur is None or d.store.db is None:
            return
        prev, start = self._last_snapshot or cur, self._last_sample_end
        self._last_snapshot, self._last_sample_end = cur, end
        if end <= start:  # the clock stepped back: skip rather than divide by a bad interval
            return
        s = d.cfg.engine
        sample = make_sample(
            prev,
            cur,
            start=start,
            end=end,
            model=d.model_name,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            queue_length=d.queue_length(),
            flops_per_token=d.engine.flops_per_token(),
        )
        try:
            gpus = await self._in_worker(self.gpus.read)
            await self._in_worker(write_sample, d.store.db, d.instance_id, sample, gpus)
        except Exception:
            log.exception("utilization sample not written")
            return
        self.runs[SAMPLE_JOB] += 1

    async def rollup(self) -> bool:
        """One rollup and pruning run; False if it failed (logged) or there is no store."""
        from controlplane.accounting.prune import prune
        from controlplane.accounting.rollup import run_rollup

        d = self.runtime
        if d.store.db is None:
            return False
        j = d.cfg.jobs
        now = datetime.now(UTC)
        try:
            result = await self._in_worker(
                lambda: run_rollup(
                    d.store.db,
                    d.instance_id,
                    now=now,
                    gpu_hourly_usd=j.gpu_hourly_usd,
                    num_gpus=self.num_gpus(),
                    peak_flops=j.peak_flops,
                )
            )
            pruned = await self._in_worker(
                lambda: prune(
                    d.store.db,
                    now=now,
                    sample_retention_days=j.sample_retention_days,
                    request_retention_days=j.request_retention_days,
                )
            )
        except Exception:
            log.exception("cost rollup failed; it will run again at the next interval")
            return False
        self.runs[ROLLUP_JOB] += 1
        log.debug("cost rollup: %s; pruned %s", result, pruned)
        return True
