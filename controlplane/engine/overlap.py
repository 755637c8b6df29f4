"""Asynchronous scheduling: the host prepares step N+1 while the device runs step N.

A synchronous step is: schedule, build the inputs, run the forward, sample, copy the tokens
to the host, append them (stop checks, detokenization, outputs). The host's part of that
(everything but the forward) leaves the device idle; on a GPU it is a large share of a small
model's decode step (benchmarks/host_overhead.py). Here each `Engine.step()` instead

1. schedules step N+1 with step N's tokens still on the device: each sequence sampled in
   step N counts one *pending* token (`Sequence.num_pending`), so the scheduler plans its
   row and its KV slot as if the token were known;
2. launches step N+1 on the device queue (its input rows for pending tokens read step N's
   sampled tokens on the device: `ModelRunner.prepare(fed=...)`), sampling included, the
   tokens copied to the host without blocking (`Sampler.sample`);
3. only then waits for step N's tokens and processes them as the synchronous step does.

So the host's work for N (3) and N+1 (1, 2) overlaps the device's N+1. The device queue is
the caller's thread on CUDA (kernel launches return at once) and one worker thread
elsewhere (a CPU forward does not return until it is done). Exactness, case by case:

* stop conditions (EOS, stop tokens and strings, max_tokens, max_model_len): learnt a step
  late, so a finishing sequence has one more row computed in step N+1, whose token is
  dropped: outputs are those of the synchronous engine. Its position is still inside
  max_model_len (a pending token is at most the last allowed one).
* preemption: the scheduler may preempt a sequence with a pending token (recompute or swap);
  it is not readmitted in the step that preempted it, and by the next one its token is known,
  so a recompute re-prefills real tokens. Freed or swapped blocks are reused only by later
  steps, which the device runs in order after the step that wrote them.
* prefix caching: a block is registered once its tokens are known (`Scheduler.cache_blocks`
  caps at len(token_ids)); a later step reading it runs after the one writing it.
* aborts: the sequence ends at once; its row in the step in flight is dropped.
* what needs the host to know the last token before the next step is scheduled runs
  synchronously (`Overlap.blocked` says which): structured outputs (the next mask follows
  the grammar state after the last token), speculation (drafts extend the last token),
  repetition/presence/frequency penalties (counts include the last token), prompt logprobs
  (scored from the step's logits on the host), scoring with max_tokens 0, and a parallel-
  sampling request until it forks its choices. The step in flight is finished first.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, Protocol

import torch

from controlplane.engine.model_runner import StepInputs
from controlplane.engine.sampler import Sampled
from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.scheduler import SchedulerOutput
from controlplane.engine.sequence import Sequence, SequenceStatus
from controlplane.engine.transfer import to_device
from controlplane.engine.types import RequestOutput

if TYPE_CHECKING:
    from collections.abc import Callable

    from controlplane.engine.model_runner import ModelRunner
    from controlplane.engine.sampler import Sampler
    from controlplane.engine.scheduler import Scheduler
    from controlplane.engine.settings import EngineSettings
    from controlplane.engine.types import TokenLogprobs


class Engine(Protocol):
    """What the asynchronous step uses of controlplane.engine.engine.Engine (which imports
    this module: named here rather than imported back)."""

    device: torch.device
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    _grammar_states: int
    _speculation: str
    _failed_steps: int

    @property
    def settings(self) -> EngineSettings: ...

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprobs | None], dict[int, str]]: ...

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]: ...

    def _fail(self, seq: Sequence, message: str, now: float) -> list[RequestOutput]: ...

    def _take(
        self,
        seqs: list[Sequence],
        tokens: list[int],
        lps: list[TokenLogprobs | None],
        now: float,
        outputs: list[RequestOutput],
        errors: dict[int, str] | None = None,
    ) -> None: ...


def overlap_wanted(mode: str, device: torch.device) -> bool:
    """engine.async_scheduling: auto is on where the forward is asynchronous (CUDA)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


class DeviceQueue:
    """Runs step jobs in order, off the host's critical path: inline where launching is
    already asynchronous (CUDA streams), else on one worker thread."""

    def __init__(self, device: torch.device) -> None:
        self._inline = device.type == "cuda"
        self._jobs: SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        if self._inline:
            _run(job, future)
            return future
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="engine-device", daemon=True)
            self._thread.start()
        self._jobs.put((job, future))
        return future

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            _run(*item)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


def _run(job: Callable[[], Any], future: Future[Any]) -> None:
    try:
        future.set_result(job())
    except BaseException as exc:  # handed to the step that waits for it
        future.set_exception(exc)


@dataclass(slots=True)
class Launched:
    """A step on the device queue: what the host needs to finish it."""

    sched: SchedulerOutput
    samplers: list[Sequence]  # the sampling sequences, in row order
    result: Future[Sampled]
    rows: dict[Sequence, int]  # sampling sequence -> its row in the step's sampled tokens


class Overlap:
    """The engine's asynchronous step (see the module doc); one per engine."""

    def __init__(self, engine: Engine) -> None:
        # A proxy, not a reference: the engine holds this object, and a cycle would keep an
        # engine dropped by its caller (its weights and KV cache) until the cyclic collector
        # ran (tests that build engine after engine grew past 12 GB).
        self.engine = weakref.proxy(engine)
        self.queue = DeviceQueue(engine.device)
        self.inflight: Launched | None = None
        # Steps run ahead, and steps run synchronously while it was on, by reason (blocked).
        self.steps = 0
        self.synchronous: Counter[str] = Counter()
        self.num_special = 0  # requests in flight that `special` says may need them

    @staticmethod
    def special(params: SamplingParams) -> bool:
        """Whether a request may need synchronous steps while it is in flight (`blocked`)."""
        return (
            params.needs_penalties
            or params.prompt_logprobs is not None
            or params.max_tokens == 0
            or params.n > 1
        )

    def blocked(self) -> str | None:
        """Why the next step must run synchronously, or None."""
        e = self.engine
        s = e.settings
        if e._grammar_states:
            return "structured outputs"
        sch = e.scheduler
        if s.speculative_method != "off" and len(sch.running) <= s.speculative_max_batch_size:
            return "speculation"
        if not self.num_special:  # plain traffic: no sequence to look through
            return None
        for seq in (*sch.running, *sch.waiting, *sch.swapped):
            p = seq.params
            if p.needs_penalties:
                return "penalties"
            if seq.prompt_logprobs is not None and not seq.output_token_ids:
                return "prompt logprobs"
            if p.max_tokens == 0:
                return "scoring"
            if seq.awaits_fork:
                return "parallel sampling before its fork"
        return None

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight, if any (before a synchronous step, or to stop)."""
        launched, self.inflight = self.inflight, None
        return self._finish(launched) if launched is not None else []

    def step(self) -> tuple[list[RequestOutput], SchedulerOutput | None, int]:
        """Schedule and launch the next step, then finish the one in flight. Returns the
        outputs, the launched step's schedule (None if nothing ran) and the tokens sampled."""
        e = self.engine
        prev = self.inflight
        self.steps += 1
        e._speculation = "off" if e.settings.speculative_method == "off" else "paused"
        sched = e.scheduler.schedule(time.time())
        launched = None if sched.is_empty else self._launch(sched, prev)
        outputs: list[RequestOutput] = []
        sampled = 0
        if prev is not None:
            outputs = self._finish(prev)
            sampled = sum(len(o.new_token_ids) for o in outputs)
        self.inflight = launched
        return outputs, (sched if launched is not None else None), sampled

    def _launch(self, sched: SchedulerOutput, prev: Launched | None) -> Launched:
        e = self.engine
        fed = prev.rows if prev is not None else None
        inputs = e.runner.prepare(sched, fed)
        samplers = inputs.samplers
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            e.scheduler.cache_blocks(seq)
        for seq in samplers:
            seq.num_pending += 1
        prev_result = prev.result if prev is not None else None
        job = _StepJob(e, inputs, prev_result)
        rows = {seq: i for i, seq in enumerate(samplers)}
        return Launched(sched, samplers, self.queue.submit(job), rows)

    def _finish(self, launched: Launched) -> list[RequestOutput]:
        e = self.engine
        for seq in launched.samplers:
            seq.num_pending -= 1
        try:
            sampled = launched.result.result()
            tokens, lps = sampled.result()
        except Exception as exc:
            # The forward failed (or the step it feeds from did): as a synchronous step
            # would, fail the requests it touched (their KV is unknown) and go on.
            return e._fail_step(launched.sched, exc)
        now = time.time()
        outputs: list[RequestOutput] = []
        if not len(tokens) == len(lps) == len(launched.samplers):
            raise RuntimeError(
                f"{len(tokens)} tokens and {len(lps)} logprobs for {len(launched.samplers)} rows"
            )
        # A row whose sequence finished (aborted, or ended by its previous token) is dropped.
        e._take(launched.samplers, tokens, lps, now, outputs, sampled.errors)
        for seq in launched.samplers:
            if seq.status is SequenceStatus.RUNNING:
                e.scheduler.cache_blocks(seq)
        e._failed_steps = 0
        return outputs

    def close(self) -> None:
        self.queue.close()


class _StepJob:
    """One step on the device queue: the forward over `inputs` and the sampling of its
    rows; the tokens start their copy to the host before the job returns."""

    __slots__ = ("engine", "inputs", "prev")

    def __init__(self, engine: Engine, inputs: StepInputs, prev: Future[Sampled] | None) -> None:
        self.engine, self.inputs, self.prev = engine, inputs, prev

    def __call__(self) -> Sampled:
        e = self.engine
        fed = None
        if self.inputs.fed_rows:
            assert self.prev is not None
            fed = self.prev.result().tokens  # done: the queue runs jobs in order
        logits = e.runner.run(self.inputs, fed)
        seqs = self.inputs.samplers
        try:
            sampled = e.sampler.sample(logits, seqs)
        except Exception:
            # Row by row, so that only the rows that fail on their own fail (Engine._sample).
            tokens, lps, errors = e._sample(logits, seqs)
            sampled = Sampled.known(to_device(tokens, logits.device), lps, errors)
        sampled.start_copy()
        return sampled
