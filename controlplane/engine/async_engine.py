"""Run the engine's step loop in a background thread; stream outputs to asyncio callers.

The step thread owns the Engine. Callers on the event loop hand it work through a thread-safe
queue (add, abort) and get outputs back through per-request asyncio queues, filled with one
`call_soon_threadsafe` per step, so the event loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from controlplane.engine.engine import Engine, RequestOutput, StepStats
from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.settings import EngineSettings

if TYPE_CHECKING:
    from controlplane.engine.structured import CompiledGrammar

log = logging.getLogger(__name__)

T = TypeVar("T")
# Steps kept for windowed statistics: at 1 ms per step this is ~16 s of history.
RECENT_STEPS = 16384


class RequestStream:
    """Async iterator over one request's outputs; ends after the last choice's finished output
    (one finished output per choice: `SamplingParams.n` of them).

    A consumer that stops early (client disconnect, cancellation) must call `cancel()` (or use
    `AsyncEngine.generate` under `contextlib.aclosing`): the request is aborted and its KV
    blocks are freed at the next step boundary.
    """

    def __init__(self, request_id: str, engine: AsyncEngine, num_choices: int = 1) -> None:
        self.request_id = request_id
        self._engine = engine
        self.num_choices = num_choices
        self._unfinished_choices = num_choices  # as the consumer has read them
        self._dispatched_finished = 0  # finished outputs queued by the engine thread
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self._unfinished_choices -= item.finished
        self.finished = self._unfinished_choices == 0
        return item

    def cancel(self) -> None:
        """The consumer is gone: abort the request unless it already finished. Idempotent."""
        if not self.finished:
            self.finished = True
            self._engine._streams.pop(self.request_id, None)
            self._engine.abort(self.request_id)


class EngineDeadError(RuntimeError):
    pass


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self._recent: deque[StepStats] = deque(maxlen=RECENT_STEPS)
        self._recent_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: EngineSettings | None = None, **overrides: Any) -> AsyncEngine:
        return cls(Engine(settings, **overrides))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def start(self) -> None:
        """Start the step thread; call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self.engine.close)
        if self.engine.runner.compiled is not None:
            await asyncio.to_thread(self.engine.runner.compiled.stop_warm_up)

    # -- API for the event loop -------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        validated: bool = False,
        grammar: CompiledGrammar | None = None,
    ) -> RequestStream:
        """Validate here (raising ValueError naming the field), then queue for the step thread.

        The step thread never validates again. `validated=True`: the caller has run
        `engine.validate_request` on these ids and params (the HTTP front, see
        controlplane.runtime.runtime), so this check is skipped too: one check per request."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        params = params or SamplingParams()
        prompt_ids = (
            self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        )
        if not validated:
            self.engine.validate_request(prompt_ids, params)
            if params.structured is not None and grammar is None:
                # Errors reach the caller here (the HTTP front compiles off the loop instead).
                grammar = self.engine.grammars.compile(params.structured)
        request_id = request_id or f"areq-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        stream = RequestStream(request_id, self, params.n)
        self._streams[request_id] = stream
        self._commands.put(("add", (prompt_ids, params, request_id, grammar)))
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        async for out in self.add_request(prompt, params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort from outside (admin, shutdown): the stream still gets its final `abort` output."""
        self._commands.put(("abort", request_id))

    def unfinished_ids(self) -> list[str]:
        return list(self._streams)

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not finished (waiting, running or swapped)."""
        return len(self._streams)

    def update_settings(self, **changes: Any) -> EngineSettings:
        return self.engine.update_settings(**changes)

    def stats(self) -> StepStats:
        return self.engine.stats()

    def recent_steps(self, since_step: int = -1) -> list[StepStats]:
        """Stats of the recent steps after `since_step`, oldest first (thread-safe copy).

        The latest snapshot always comes back, even when it is not after `since_step`: an abort
        may have refreshed its gauges since the caller saw it (same step number, so a reader
        that counts steps by number skips it, and takes its gauges; see `_publish_stats`).
        """
        with self._recent_lock:
            steps = list(self._recent)
        if since_step < 0:
            return steps
        return [s for s in steps if s.step > since_step] or steps[-1:]

    async def live_requests(self) -> list[dict[str, Any]]:
        """The requests in the engine (waiting, running, swapped), read at a step boundary:
        id, state, token counts, preemptions and arrival time (time.time())."""

        def snapshot(engine: Engine) -> list[dict[str, Any]]:
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

        return await self.call(snapshot)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) in the step thread at the next step boundary and return its result.

        For reads that must see a consistent engine (the live request list), without locks on
        the hot path.
        """
        if not self.is_running:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._commands.put(("call", (fn, future)))
        # A step takes milliseconds; if the thread died meanwhile, fail instead of hanging.
        return await asyncio.wait_for(future, timeout=30)

    # -- the step thread ---------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # Runs on the event loop.
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(out)
                if out.finished:
                    stream._dispatched_finished += 1
                    if stream._dispatched_finished == stream.num_choices:
                        del self._streams[out.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream._put(exc)
        self._streams.clear()

    def _drain_commands(self, block: bool) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        try:
            cmd, arg = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            while True:
                if cmd == "add":
                    prompt_ids, params, request_id, grammar = arg
                    try:
                        # Checked in add_request above, on the event loop, already.
                        self.engine.add_request(
                            prompt_ids, params, request_id, validated=True, grammar=grammar
                        )
                    except Exception as exc:  # that request fails; the engine goes on
                        if not isinstance(exc, ValueError):
                            log.exception("request %s failed at admission", request_id)
                        loop = self._loop
                        assert loop is not None
                        stream = self._streams.pop(request_id, None)
                        if stream is not None:
                            loop.call_soon_threadsafe(stream._put, exc)
                elif cmd == "abort":
                    aborted = self.engine.abort(arg)
                    if aborted:
                        outputs += aborted
                        self._publish_stats()  # its freed blocks show now, not a step later
                elif cmd == "call":
                    fn, future = arg
                    try:
                        result = fn(self.engine)
                    except Exception as exc:  # hand the error to the caller, keep stepping
                        self._loop.call_soon_threadsafe(_settle, future, None, exc)
                    else:
                        self._publish_stats()  # a call may change gauges (a cache reset)
                        self._loop.call_soon_threadsafe(_settle, future, result, None)
                cmd, arg = self._commands.get_nowait()
        except queue.Empty:
            pass
        return outputs

    def _publish_stats(self) -> None:
        """Put the engine's latest snapshot in the ring. After an abort it is the last step's
        snapshot with refreshed gauges (same step number, same per-step figures): it replaces
        that step's entry instead of adding one, so windows and counters see each step once."""
        stats = self.engine.stats()
        with self._recent_lock:
            if self._recent and self._recent[-1].step == stats.step:
                self._recent[-1] = stats
            else:
                self._recent.append(stats)

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            while not self._stop.is_set():
                self.engine.check_ranks()
                outputs = self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    outputs += self.engine.step()
                    self._publish_stats()
                if outputs:
                    loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as exc:  # the engine is dead: tell every waiter, don't hang them
            log.exception("engine step loop died")
            self.error = exc
            loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine stopped: {exc!r}"))
            # Callers waiting on `call` learn it now rather than at their timeout.
            while True:
                try:
                    cmd, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd == "call":
                    loop.call_soon_threadsafe(_settle, arg[1], None, EngineDeadError(repr(exc)))
