"""The engine's scheduling without its model: the real Scheduler (and BlockPool, prefix cache,
chunked prefill, recompute and swap preemption, parallel-sampling forks) stepping requests on a
virtual clock that a step-cost function advances. Capacity planning's simulator
(controlplane/planning/simulate.py) is built on it; keeping it here keeps the scheduler's
internals inside the engine package.

After each step it does what the engine does after a forward (engine.py): computed tokens
advance, full blocks are registered in the prefix cache, a row that reaches the end of its
sequence samples a token (choice 0 of a parallel request forks its choices first), and a choice
that has its tokens finishes and is removed. Not simulated: speculative decoding (drafts depend
on the text) and structured outputs' masks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from controlplane.engine.block_pool import BlockPool
from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.scheduler import Scheduler, SchedulerOutput
from controlplane.engine.sequence import Sequence, SequenceStatus
from controlplane.engine.settings import EngineSettings
from controlplane.engine.types import RequestMetrics

if TYPE_CHECKING:
    from controlplane.engine.engine import Engine

_TOKEN = 5  # the token every simulated sample appends (its value changes nothing here)


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float  # on the virtual clock
    prompt: list[int]
    max_tokens: int  # each choice's, EOS ignored
    n: int = 1


@dataclass(slots=True)
class SimResult:
    metrics: list[RequestMetrics]  # per request, in the input's order
    finished: list[bool]
    wall_s: float  # the clock when the last request finished
    peak_kv_usage: float  # the most blocks in use at once / total
    preemptions: int
    num_kv_blocks: int
    steps: int = 0
    errors: dict[int, str] = field(default_factory=dict)  # request index -> why unfinished
    # Every gap between two tokens of one sequence (seconds): what an ITL p99 over gaps reads
    # (a prefill chunk riding in a decode step stretches one gap, not a request's mean).
    gaps: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a simulation needs to know of a model, read from its config alone."""

    vocab_size: int
    max_model_len: int
    device: str
    name: str  # the model directory's or file's name


def model_shape(settings: EngineSettings) -> ModelShape:
    """The shape of the model `settings` serve (no weights loaded)."""
    from controlplane.engine.loader import load_model_config
    from controlplane.engine.parts import resolve_device, resolve_model_path

    path = resolve_model_path(settings.model)
    cfg = load_model_config(path)
    limit = min(settings.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    return ModelShape(cfg.vocab_size, limit, resolve_device(settings.device).type, Path(path).name)


class _Silent:
    """The detokenizer a simulated sequence never uses."""

    def add(self, token: int) -> str:
        return ""


def run_schedule(
    requests: list[SimRequest],
    settings: EngineSettings,
    step_s: Callable[[int, int, int], float],
    num_kv_blocks: int,
    num_swap_blocks: int,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """`requests` (sorted by arrival) through `settings`' scheduler; `step_s(prefill tokens,
    decode rows, context tokens)` prices each step."""
    pool = BlockPool(num_kv_blocks)
    pool.enable_caching = settings.enable_prefix_caching
    scheduler = Scheduler(settings, pool, BlockPool(num_swap_blocks), settings.block_size)
    groups: dict[int, list[Sequence]] = {}
    metrics: list[RequestMetrics | None] = [None] * len(requests)
    finished = [False] * len(requests)
    done = steps = 0
    peak = 0.0
    gaps: list[float] = []
    last_token: dict[Sequence, float] = {}  # each sequence's latest token time
    now, nxt = 0.0, 0
    while nxt < len(requests) or scheduler.waiting or scheduler.running or scheduler.swapped:
        while nxt < len(requests) and requests[nxt].arrival_s <= now:
            # Arrived at the step boundary: the engine stamps a request's arrival when its step
            # thread takes it (Engine.add_request), and its queue and TTFT figures start there.
            metrics[nxt] = _admit(scheduler, groups, requests[nxt], nxt, now)
            nxt += 1
        out = scheduler.schedule(now)
        if out.is_empty:
            if nxt < len(requests):
                now = max(now, requests[nxt].arrival_s)  # idle until the next arrival
                continue
            break  # what is left can never be scheduled (more KV than the cache holds)
        steps += 1
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        now += step_s(out.num_prefill_tokens, out.num_decode_tokens, out.num_context_tokens)
        peak = max(peak, pool.num_used / pool.num_blocks)
        for item in out.scheduled:
            seq = item.seq
            scheduler.cache_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens or seq.status is SequenceStatus.FINISHED:
                continue  # a prefill chunk short of the end samples nothing
            members = [seq, *scheduler.fork(seq)] if seq.awaits_fork else [seq]
            for member in members:
                if member in last_token:  # a choice's first token is its TTFT, not a gap
                    gaps.append(now - last_token[member])
                last_token[member] = now
                _sample(scheduler, member, now)
            i = int(seq.request_id)
            group = groups.get(i)
            if group is not None and all(c.status is SequenceStatus.FINISHED for c in group):
                del groups[i]
                finished[i] = True
                done += 1
                if progress is not None:
                    progress(done, len(requests))
    errors = {
        i: f"never finished: needs more than the {num_kv_blocks} KV blocks of this config"
        for i in groups
    }
    return SimResult(
        metrics=[m for m in metrics if m is not None],
        finished=finished,
        wall_s=now,
        peak_kv_usage=peak,
        preemptions=scheduler.num_preemptions,
        num_kv_blocks=num_kv_blocks,
        steps=steps,
        errors=errors,
        gaps=gaps,
    )


def _admit(
    scheduler: Scheduler, groups: dict[int, list[Sequence]], req: SimRequest, i: int, at: float
) -> RequestMetrics:
    params = SamplingParams(max_tokens=req.max_tokens, n=req.n, ignore_eos=True)
    metrics = RequestMetrics(at, num_prompt_tokens=len(req.prompt))
    group = [
        Sequence(
            request_id=str(i),
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
    return metrics


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


def with_block_size(settings: EngineSettings, block_size: int) -> EngineSettings:
    return (
        settings
        if settings.block_size == block_size
        else dataclasses.replace(settings, block_size=block_size)
    )


@contextmanager
def timed_schedule(engine: Engine) -> Iterator[list[tuple[float, int, int, int]]]:
    """While inside, each non-empty scheduler call of `engine` appends (perf_counter at the
    call, prefill tokens, decode rows, context tokens after the step): what calibrating a step
    cost model reads (controlplane/planning/costmodel.py). The scheduler itself is unchanged."""
    calls: list[tuple[float, int, int, int]] = []
    scheduler = engine.scheduler
    real = scheduler.schedule

    def recording(now: float) -> SchedulerOutput:
        t = time.perf_counter()
        out = real(now)
        if not out.is_empty:
            calls.append((t, out.num_prefill_tokens, out.num_decode_tokens, out.num_context_tokens))
        return out

    scheduler.schedule = recording  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        scheduler.schedule = real  # type: ignore[method-assign]
