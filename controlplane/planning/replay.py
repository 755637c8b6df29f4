"""Drive a workload through an engine built from a proposed config, in this process, at the
recorded arrival times (scaled by `speed`), and keep what the daemon would have recorded: each
request's engine metrics (the same RequestMetrics the ledger writes to SQL, so recorded and
replayed figures are measured alike) and the engine's step snapshots (peak KV use,
preemptions).

The engine is built and warmed before the clock starts: a compiled decode step that a daemon
compiles in the background (engine.compile = auto on a CPU) is waited for, since the recorded
traffic met a warm daemon (unless it was recorded right after a start).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.engine import AsyncEngine, Engine, SamplingParams
from controlplane.engine.settings import EngineSettings
from controlplane.engine.types import RequestMetrics, RequestOutput
from controlplane.planning.window import PlanningError
from controlplane.planning.workload import ReplayRequest, Workload

WARM_UP_TIMEOUT_S = 600.0  # for the compiled step: a first compile on a slow host
_STATS_EVERY_S = 0.05  # the engine's snapshots are read this often (peak KV use)


@dataclass(slots=True)
class Served:
    """One replayed request, as the ledger would have recorded it."""

    request: ReplayRequest
    ok: bool
    error: str | None = None
    metrics: RequestMetrics | None = None
    completion_tokens: int = 0


@dataclass(slots=True)
class ReplayRun:
    label: str
    settings: EngineSettings | None  # None: a running daemon's (replay --url)
    speed: float  # arrivals this many times faster than recorded (inf: all at once)
    served: list[Served]
    wall_s: float  # first arrival to last finish, on the replay's clock
    peak_kv_usage: float  # the most KV blocks in use at once / total
    preemptions: int
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    gaps: list[float] | None = None  # every inter-token gap (the simulator's; None: not known)


def engine_for(settings: EngineSettings) -> Engine:
    """The engine a daemon would run on `settings` (long-running: a CPU compiles its step in
    the background), with its compiled step warmed up (PlanningError if that takes too long)."""
    engine = Engine(settings, long_running=True)
    deadline = time.monotonic() + WARM_UP_TIMEOUT_S
    while engine.compile_state in ("cold", "warming"):
        if time.monotonic() > deadline:
            engine.close()
            raise PlanningError(
                f"the compiled step was not ready within {WARM_UP_TIMEOUT_S:g} s: replay with "
                "engine.compile = off, or again once the compile cache is warm"
            )
        time.sleep(0.1)
    return engine


async def replay(
    workload: Workload,
    engine: Engine,
    label: str,
    speed: float = 1.0,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayRun:
    """Every request of `workload` submitted at its offset / `speed`, each choice generating
    its recorded length with EOS ignored; returns when all have finished."""
    if speed <= 0:
        raise PlanningError(f"--speed must be positive, got {speed:g}")
    aeng = AsyncEngine(engine)
    aeng.start()
    served: list[Served] = []
    peak = [0.0]
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            s = aeng.stats()
            if s.kv_blocks_total:
                peak[0] = max(peak[0], s.kv_blocks_used / s.kv_blocks_total)
            await asyncio.sleep(_STATS_EVERY_S)

    async def one(req: ReplayRequest, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        params = SamplingParams(
            max_tokens=req.max_tokens, n=req.n, ignore_eos=True, seed=len(served)
        )
        out: Served = Served(req, ok=False)
        last: RequestOutput | None = None
        tokens = 0
        try:
            async for o in aeng.add_request(req.prompt, params):
                tokens += len(o.new_token_ids)
                last = o
        except Exception as exc:  # one request's failure is a figure, not the replay's end
            out.error = repr(exc)
        else:
            out.ok = last is not None and last.finish_reason in ("length", "stop")
            out.error = None if out.ok else (last.error if last is not None else "no output")
        out.metrics = last.metrics if last is not None else None
        out.completion_tokens = tokens
        served.append(out)
        if progress is not None:
            progress(len(served), len(workload.requests))

    before = engine.stats()
    watcher = asyncio.create_task(watch())
    t0 = time.monotonic()
    try:
        await asyncio.gather(
            *(
                one(r, t0 + (0.0 if speed == float("inf") else r.offset_s / speed))
                for r in workload.requests
            )
        )
    finally:
        done.set()
        await watcher
        after = engine.stats()
        await aeng.shutdown()
    wall = time.monotonic() - t0
    served.sort(key=lambda s: s.request.offset_s)
    return ReplayRun(
        label=label,
        settings=engine.settings,
        speed=speed,
        served=served,
        wall_s=wall,
        peak_kv_usage=peak[0],
        preemptions=after.num_preemptions - before.num_preemptions,
        draft_tokens=after.spec_decode_num_draft_tokens_total
        - before.spec_decode_num_draft_tokens_total,
        accepted_draft_tokens=after.spec_decode_num_accepted_tokens_total
        - before.spec_decode_num_accepted_tokens_total,
    )
