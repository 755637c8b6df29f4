"""One engine request's output stream (Flight) and one /v1 request's batch of them (Batch):
the fan-out of prompts and choices, their aborts, usage, and best_of's choice of the best."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controlplane.http.errors import (
    APIError,
    unavailable,
)
from controlplane.openai import protocol
from controlplane.store.records import RequestRecord

if TYPE_CHECKING:
    from controlplane.engine import RequestOutput, RequestStream
    from controlplane.runtime.runtime import Runtime


log = logging.getLogger("controlplane.api")


def _request_failed(out: RequestOutput) -> APIError:
    """One request failed inside the engine (its row says why); everyone else is served. A
    failure of the request's own making (its grammar) is a 400 naming the field, not a 500."""
    if out.error_param is not None:
        return APIError(400, f"{out.error_param}: {out.error}", param=out.error_param)
    return APIError(500, f"request failed in the engine: {out.error}", type="server_error")


_END = object()  # the last item of a Flight's output queue


class EngineFailure(Exception):
    """The engine failed this request (it died, or ended the request with an error)."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(eq=False)
class Flight:
    """One admitted engine request (one prompt), from admission to its one final record.

    A task of its own (`run`) consumes the engine's stream and writes the final record, so the
    request's end does not depend on the HTTP response: Litestar cancels a streaming body
    whose client has left, possibly before the body's first line ran (so a `finally` in the
    body never runs). Outputs go to `outputs` as (index, output), the queue its Batch reads.
    A client that leaves (seen by `Batch.watch`), and a response that stops early, call
    `abort()`; the engine then ends the request with an `abort` output, which ends `run` like
    any other last output.
    """

    runtime: Runtime
    stream: RequestStream
    rec: RequestRecord
    on_end: Callable[[Flight], None]  # called once, right after the final record
    outputs: asyncio.Queue  # shared with the other flights of its Batch
    index: int = 0  # the prompt's position
    n: int = 1  # choices the engine samples for it: choice j is the response's index*n + j
    max_tokens: int | None = None  # its max_tokens (request_params_max_tokens metric)
    max_choice_tokens: int = 0  # the most tokens one choice generated (metrics)
    # Its scheduling class (SamplingParams.priority_class): the queue wait's by-class histogram.
    priority_class: int | None = None
    # Choice 0's output token times (ITL metrics: a per-sequence figure, whatever n is).
    token_times: list[float] = field(default_factory=list)
    last: RequestOutput | None = None
    done: bool = False  # the final record is written
    # It ended in an error that is not the request's own: the engine died, or failed it (a
    # 5xx); set with `done` (a request whose grammar could not be followed is a 400: not this).
    failed: bool = False
    _abort_sent: bool = False

    async def run(self) -> None:
        error = None
        try:
            async for out in self.stream:
                self.last = out
                self.max_choice_tokens = max(self.max_choice_tokens, len(out.token_ids))
                if out.index == 0:
                    self.token_times.extend([out.time] * len(out.new_token_ids))
                self.outputs.put_nowait((self.index * self.n + out.index, out))
                self.runtime.ledger.progress(self.rec, out)  # tokens so far, for a kill (bounded)
        except asyncio.CancelledError:  # the loop is going away: still one final record
            self.stream.cancel()
            raise
        except Exception as exc:  # the engine died: tell the response, record the error
            error = repr(exc)
            failure = EngineFailure(unavailable(f"engine failed: {exc}"))
            self.outputs.put_nowait((self.index * self.n, failure))
        finally:
            self.done = True
            last = self.last
            self.failed = error is not None or (
                last is not None and last.finish_reason == "error" and last.error_param is None
            )
            self.runtime.ledger.finish(
                self.rec,
                self.last,
                self.token_times,
                error=error,
                max_tokens=self.max_tokens,
                n=self.n,
                max_choice_tokens=self.max_choice_tokens,
                priority_class=self.priority_class,
            )
            self.on_end(self)
            self.outputs.put_nowait((self.index * self.n, _END))

    def abort(self) -> None:
        """Stop the engine request (idempotent; nothing to do once it has ended)."""
        if not self.done and not self._abort_sent:
            self._abort_sent = True
            self.runtime.engine.abort(self.rec.id)


@dataclass(eq=False)
class Batch:
    """The engine requests of one HTTP request: one Flight per prompt (chat: one), read as one
    stream of (choice index, output) in the order the engine produced them. Every flight ends
    in its own final record, whatever happens to the others."""

    id: str  # the response's id (each flight's row id is this, or this plus "-<index>")
    model: str
    flights: list[Flight]
    outputs: asyncio.Queue

    @property
    def done(self) -> bool:
        return all(f.done for f in self.flights)

    def abort(self) -> None:
        """Stop every flight still running (idempotent)."""
        for f in self.flights:
            f.abort()

    async def watch(self, receive: Callable[[], Awaitable[Any]]) -> None:
        """Abort when the client disconnects, streaming or not. uvicorn answers every `receive`
        with `http.disconnect` once the client is gone or the response is complete, whoever
        else (Litestar's streaming response) is listening too."""
        while not self.done:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.abort()
                return

    def usage(self) -> dict[str, Any] | None:
        """Usage summed over the flights (None before any output)."""
        lasts = [f.last.metrics for f in self.flights if f.last is not None]
        if not lasts:
            return None
        return protocol.usage(
            sum(m.num_prompt_tokens for m in lasts),
            sum(m.num_output_tokens for m in lasts),
            sum(m.num_cached_tokens for m in lasts),
        )

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) until every flight has ended; EngineFailure if the engine failed
        one (the caller aborts the rest)."""
        running = len(self.flights)
        while running:
            index, item = await self.outputs.get()
            if item is _END:
                running -= 1
                continue
            if isinstance(item, EngineFailure):
                raise item
            if item.finish_reason == "error":  # this request failed, the engine serves on
                raise EngineFailure(_request_failed(item))
            yield index, item


def returned(f: Flight, n: int, pieces: dict[int, list[RequestOutput]]) -> list[int]:
    """The choice indices of flight `f` the response returns, in order: all of them, or with
    best_of (the engine sampled more than `n`), the `n` with the highest cumulative logprob
    (ties: the lower index), best first."""
    mine = [i for i in range(f.index * f.n, (f.index + 1) * f.n) if pieces.get(i)]
    if f.n <= n:
        return mine

    def score(i: int) -> float:
        value = pieces[i][-1].cumulative_logprob
        return -math.inf if value is None else value

    return sorted(mine, key=lambda i: (-score(i), i))[:n]
