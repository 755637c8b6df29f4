"""A replay without the model: the engine's real Scheduler (and BlockPool, prefix cache,
preemption, chunked prefill, parallel-sampling forks) steps a workload on a virtual clock that
a CostModel advances, so that a sweep over configs takes seconds instead of the traffic's own
duration.

What the simulator does around the scheduler is the engine's bookkeeping after a forward
(engine.py): computed tokens advance, full blocks are registered in the prefix cache, a row
that reaches the end of its sequence samples a token (choice 0 of a parallel request forks its
choices first), and a choice that has its tokens finishes and is removed. Not simulated:
speculative decoding (drafts depend on the text) and structured outputs' masks; the summary
says so when the config asks for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from controlplane.engine.block_pool import BlockPool
from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.scheduler import Scheduler
from controlplane.engine.sequence import Sequence, SequenceStatus
from controlplane.engine.settings import EngineSettings
from controlplane.engine.types import RequestMetrics
from controlplane.planning.costmodel import CostModel
from controlplane.planning.replay import ReplayRun, Served
from controlplane.planning.workload import ReplayRequest, Workload

_TOKEN = 5  # the token every simulated sample appends (its value changes nothing here)


class _Silent:
    """The detokenizer a simulated sequence never uses."""

    def add(self, token: int) -> str:
        return ""


def simulate(
    workload: Workload,
    settings: EngineSettings,
    cost: CostModel,
    label: str,
    speed: float = 1.0,
    num_kv_blocks: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayRun:
    """`workload` through `settings`' scheduler on the cost model's clock; the same ReplayRun a
    real replay returns (its wall_s the virtual span)."""
    blocks = num_kv_blocks or settings.num_kv_blocks or cost.num_kv_blocks
    pool = BlockPool(blocks)
    pool.enable_caching = settings.enable_prefix_caching
    swap = BlockPool(settings.swap_space_bytes // cost.kv_bytes_per_block)
    if settings.block_size != cost.block_size:
        settings = dataclasses.replace(settings, block_size=cost.block_size)
    scheduler = Scheduler(settings, pool, swap, settings.block_size)
    pending = sorted(workload.requests, key=lambda r: r.offset_s)
    arrivals = [r.offset_s / speed for r in pending]
    groups: dict[int, list[Sequence]] = {}
    served: list[Served] = []
    peak = 0.0
    now, nxt = 0.0, 0
    while nxt < len(pending) or scheduler.waiting or scheduler.running or scheduler.swapped:
        while nxt < len(pending) and arrivals[nxt] <= now:
            # Arrived at the step boundary: the engine stamps a request's arrival when its step
            # thread takes it (Engine.add_request), and the recorded queue and TTFT figures are
            # measured from there.
            _admit(scheduler, groups, pending[nxt], nxt, now)
            nxt += 1
        out = scheduler.schedule(now)
        if out.is_empty:
            if nxt < len(pending):
                now = max(now, arrivals[nxt])  # idle until the next arrival
                continue
            break  # nothing can run and nothing will arrive (cannot happen with valid input)
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        context = sum(item.seq.num_computed_tokens for item in out.scheduled)
        now += cost.step_s(out.num_prefill_tokens, out.num_decode_tokens, context)
        peak = max(peak, pool.num_used / pool.num_blocks)
        for item in out.scheduled:
            seq = item.seq
            scheduler.cache_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens or seq.status is SequenceStatus.FINISHED:
                continue  # a prefill chunk short of the end samples nothing
            members = [seq, *scheduler.fork(seq)] if seq.awaits_fork else [seq]
            for member in members:
                _sample(scheduler, member, now)
            i = int(seq.request_id.removeprefix("sim-"))
            group = groups.get(i)
            if group is not None and all(c.status is SequenceStatus.FINISHED for c in group):
                del groups[i]
                m = group[0].metrics
                served.append(
                    Served(pending[i], ok=True, metrics=m, completion_tokens=m.num_output_tokens)
                )
                if progress is not None:
                    progress(len(served), len(pending))
    for i, group in groups.items():  # left waiting: more than the KV cache holds, say
        why = f"never finished: needs more than the {blocks} KV blocks of this config"
        served.append(Served(pending[i], ok=False, error=why, metrics=group[0].metrics))
    served.sort(key=lambda s: s.request.offset_s)
    return ReplayRun(
        label=label,
        settings=settings,
        speed=speed,
        served=served,
        wall_s=now,
        peak_kv_usage=peak,
        preemptions=scheduler.num_preemptions,
    )


def _admit(
    scheduler: Scheduler,
    groups: dict[int, list[Sequence]],
    req: ReplayRequest,
    i: int,
    at: float,
) -> None:
    params = SamplingParams(max_tokens=req.max_tokens, n=req.n, ignore_eos=True)
    metrics = RequestMetrics(at, num_prompt_tokens=len(req.prompt))
    group = [
        Sequence(
            request_id=f"sim-{i}",
            prompt_token_ids=req.prompt,
            params=params,
            metrics=metrics,
            detokenizer=_Silent(),  # type: ignore[arg-type]
            index=index,
            status=SequenceStatus.PENDING,
        )
        for index in range(req.n)
    ]
    for seq in group:
        seq.group = group
    groups[i] = group
    scheduler.add(group[0])


def _sample(scheduler: Scheduler, seq: Sequence, now: float) -> None:
    m = seq.metrics
    if m.first_token_time is None:
        m.first_token_time = now
    seq.append_token(_TOKEN)
    m.num_output_tokens += 1
    if len(seq.output_token_ids) >= seq.params.max_tokens:
        scheduler.remove(seq)
        m.finish_time = now
    else:
        scheduler.cache_blocks(seq)
