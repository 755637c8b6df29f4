"""The Litestar app: OpenAI-compatible inference API and /health."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException
from litestar.response import ServerSentEvent

from controlplane.errors import FieldError
from controlplane.http.body import load_json, openapi_body
from controlplane.http.errors import (
    APIError,
    body_too_large,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
    invalid,
    unavailable,
)
from controlplane.http.request_id import new_id, request_id
from controlplane.openai import protocol, schema
from controlplane.openai.tools import (
    ToolCallStream,
    ToolRequest,
    has_tools_variable,
    parse_auto,
    parse_constrained,
    render_messages,
)
from controlplane.runtime.state import DaemonState
from controlplane.store.records import RequestRecord

if TYPE_CHECKING:
    from controlplane.engine import RequestOutput, RequestStream, SamplingParams
    from controlplane.engine.structured import CompiledGrammar
    from controlplane.runtime.runtime import Runtime


log = logging.getLogger("controlplane.api")


def _sse(payload: dict[str, Any]) -> str:
    """One SSE `data:` payload; Litestar's ServerSentEvent does the framing."""
    return json.dumps(payload, separators=(",", ":"))


def envelope(
    batch: Batch, obj: str, created: int, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """The OpenAI response / chunk shape around choices (none: the usage-only last chunk)."""
    return {
        "id": batch.id,
        "object": obj,
        "created": created,
        "model": batch.model,
        "choices": choices,
        **extra,
    }


def _request_failed(out: RequestOutput) -> APIError:
    """One request failed inside the engine (its row says why); everyone else is served. A
    failure of the request's own making (its grammar) is a 400 naming the field, not a 500."""
    if out.error_param is not None:
        return APIError(400, f"{out.error_param}: {out.error}", param=out.error_param)
    return APIError(500, f"request failed in the engine: {out.error}", type="server_error")


# Prompts at least this long are tokenized in a worker thread: a multi-megabyte prompt takes
# seconds to tokenize, and the event loop must keep answering (/health, other streams) meanwhile.
OFF_LOOP_CHARS = 4096
# Finished request ids remembered so that an admin abort can say "already finished" (409).
RECENTLY_FINISHED = 10_000
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
    # Choice 0's output token times (ITL metrics: a per-sequence figure, whatever n is).
    token_times: list[float] = field(default_factory=list)
    last: RequestOutput | None = None
    done: bool = False  # the final record is written
    _abort_sent: bool = False

    async def run(self) -> None:
        error = None
        try:
            async for out in self.stream:
                self.last = out
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
            self.runtime.ledger.finish(self.rec, self.last, self.token_times, error=error)
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


def _returned(f: Flight, n: int, pieces: dict[int, list[RequestOutput]]) -> list[int]:
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


class InferenceAPI:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps weak ones
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.recently_finished: OrderedDict[str, str] = OrderedDict()  # id -> finish reason

    # -- admission --------------------------------------------------------------------------
    def _admit(
        self, request: Request, model: str, incoming: int = 1
    ) -> tuple[str | None, str | None]:
        """Admission for `incoming` engine requests (one per prompt): the server state, the
        model and the waiting queue. Returns the API key's name and hash, as the route's guard
        found them (`api_key`, before the body was read)."""
        d = self.runtime
        key_name, key_hash = request.state.api_key
        if d.state != DaemonState.READY or not d.engine.loaded:
            raise unavailable(f"server is {d.state}; retry later")
        if not d.engine.running:
            raise unavailable("engine is not running", retry_after=30)
        if model != d.model_name:
            raise APIError(
                404,
                f"the model `{model}` does not exist; this server serves `{d.model_name}`",
                param="model",
                code="model_not_found",
            )
        limit = d.cfg.server.max_queue_len
        # Would this request wait beyond the limit? (This counts the requests accepted since
        # the engine's last step, which that step's statistics do not show yet.)
        if d.queue_length(incoming=incoming) > limit:
            waiting = d.queue_length()
            raise APIError(
                429,
                f"the waiting queue is full ({waiting} waiting, max_queue_len {limit}); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        return key_name, key_hash

    def authenticate(self, request: ASGIConnection) -> tuple[str | None, str | None]:
        """The API key's name and hash ((None, None) on an open API); 401 otherwise. Every /v1
        route runs this first, as a guard: nothing about an anonymous request is parsed,
        validated or counted (its body is not even read)."""
        if not self.runtime.cfg.api_keys:
            return None, None
        found = self.runtime.authenticate(request.headers.get("authorization"))
        if found is None:
            raise APIError(
                401,
                "invalid or missing API key (Authorization: Bearer <key>)",
                type="authentication_error",
                code="invalid_api_key",
            )
        return found[0].name, found[1]

    def _cache_salt(self, parsed: protocol.OpenAIRequest, key_hash: str | None) -> str | None:
        """The request's prefix-cache partition (SamplingParams.cache_salt): its API key's
        (with keys configured and engine.prefix_cache_isolation = key) and its `cache_salt`.
        None: the shared partition (an open API, or isolation none, without a cache_salt)."""
        isolate = key_hash is not None and self.runtime.cfg.engine.prefix_cache_isolation == "key"
        if not isolate and parsed.cache_salt is None:
            return None
        # JSON: unambiguous (no salt can pose as a key's part or the other way round).
        return json.dumps([key_hash if isolate else None, parsed.cache_salt])

    async def _body(self, request: Request) -> Any:
        return load_json(await request.body())

    async def _off_loop(self, size: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw), in a worker thread when the input is large (see OFF_LOOP_CHARS).
        Whatever fn raises reaches the caller: a StopIteration, which asyncio cannot put in a
        future (the handler would wait forever), comes out as a RuntimeError (a clean 500)."""

        def call() -> Any:
            try:
                return fn(*args, **kw)
            except (StopIteration, StopAsyncIteration) as exc:
                raise RuntimeError(f"{type(exc).__name__} raised in tokenization") from exc

        if size < OFF_LOOP_CHARS:
            return call()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, call)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _remember(self, flight: Flight) -> None:
        last = flight.last
        reason = last.finish_reason if last is not None and last.finished else None
        self.recently_finished[flight.rec.id] = reason or "abort"
        while len(self.recently_finished) > RECENTLY_FINISHED:
            self.recently_finished.popitem(last=False)

    def _validate(self, prompt_ids: list[int], params: SamplingParams, where: str | None) -> None:
        """The engine's checks of one prompt (400 naming the field); `where`: which prompt of
        several ("prompt[2]"), said in the error."""
        try:
            self.runtime.engine.validate(prompt_ids, params)
        except FieldError as exc:
            name, message = exc.field, exc.message
            if where is not None:
                name, message = (
                    (where, message) if name == "prompt" else (name, f"{message} ({where})")
                )
            raise invalid(name, message) from None

    def _start(
        self,
        request: Request,
        parsed: protocol.OpenAIRequest,
        prompts_ids: list[list[int]],
        endpoint: str,
        keys: tuple[str | None, str | None],
        grammar: CompiledGrammar | None = None,
    ) -> Batch:
        """Validate every prompt, then queue one engine request (and write one running row)
        per prompt: a request with one bad prompt queues nothing."""
        d = self.runtime
        max_model_len = d.engine.max_model_len
        assert max_model_len is not None  # admitted: the engine is loaded
        n = len(prompts_ids)
        params = []
        salt = self._cache_salt(parsed, keys[1])
        for i, ids in enumerate(prompts_ids):
            p = parsed.params
            if salt is not None:
                p = dataclasses.replace(p, cache_salt=salt)
            if isinstance(parsed, protocol.ChatRequest) and parsed.default_max_tokens:
                # OpenAI chat: no max_tokens means "as much as fits".
                p = dataclasses.replace(p, max_tokens=max(1, max_model_len - len(ids)))
            self._validate(ids, p, f"prompt[{i}]" if n > 1 else None)
            params.append(p)
        rid = request_id(request.scope)
        # The response's id: the generated X-Request-Id (same shape), else a fresh one. Rows
        # take it as their id (one prompt) or with the prompt's index appended (several).
        prefix = "chatcmpl" if endpoint == "chat.completions" else "cmpl"
        response_id = new_id(prefix) if rid.from_client else rid.value
        batch = Batch(response_id, d.model_name, [], asyncio.Queue())
        try:
            for i, (ids, p) in enumerate(zip(prompts_ids, params, strict=True)):
                row_id = response_id if n == 1 else f"{response_id}-{i}"
                # Validated above (once, here at the front): the engine does not check again.
                stream = d.engine.add_validated(ids, p, row_id, grammar)
                rec = RequestRecord(
                    id=row_id,
                    instance_id=d.instance_id,
                    model=d.model_name,
                    endpoint=endpoint,
                    status="running",
                    arrival_time=datetime.now(UTC),
                    api_key_name=keys[0],
                    api_key_hash=keys[1],
                    prompt_tokens=len(ids),
                    end_user=parsed.user,
                    x_request_id=rid.value,
                )
                if grammar is not None:
                    kind = structured_type(parsed)
                    compile_s = None if grammar.cached else grammar.compile_s
                    rec.structured = kind
                    rec.grammar_compile_ms = round((compile_s or 0.0) * 1000, 3)
                    d.metrics.observe_structured(kind, compile_s)
                d.ledger.record(rec)
                flight = Flight(d, stream, rec, self._remember, batch.outputs, i, p.n)
                batch.flights.append(flight)
                self._spawn(flight.run())
        except BaseException:
            batch.abort()  # the ones already queued end (and are recorded) as aborted
            raise
        self._spawn(batch.watch(request.receive))
        return batch

    async def _grammar(self, parsed: protocol.OpenAIRequest) -> CompiledGrammar | None:
        """The request's compiled grammar (None: unconstrained), compiled off the event loop
        and the step thread; 400 naming the field when it is too large, cannot be compiled,
        or takes longer than server.grammar_compile_timeout_s."""
        out = parsed.structured
        if out is None:
            return None
        server = self.runtime.cfg.server
        size = len(out.spec.encode())
        if size > server.max_grammar_bytes:
            raise invalid(
                out.field,
                f"is {size} bytes; the limit is {server.max_grammar_bytes} "
                "(server.max_grammar_bytes)",
            )
        try:
            return await self.runtime.engine.compile_grammar(out, server.grammar_compile_timeout_s)
        except FieldError as exc:
            raise invalid(exc.field, exc.message) from None

    def _note_ignored(self, fields: tuple[str, ...]) -> None:
        """Count the request's ignored fields; log each field name the first time (a debug
        line: clients send them by design, it is no error)."""
        if not fields:
            return
        for label in self.runtime.metrics.ignored_request_fields(fields):
            log.debug(
                "ignoring request field %r: this server does not use it (counted in "
                "controlplane:ignored_request_fields_total)",
                label,
            )

    # -- shared response flow ------------------------------------------------------------------
    async def _respond(
        self,
        parsed: protocol.OpenAIRequest,
        batch: Batch,
        obj: str,
        render_final: Callable[[int, list[RequestOutput], RequestOutput], dict[str, Any]],
        render_chunk: Callable[[int, RequestOutput], dict[str, Any] | list[dict[str, Any]] | None],
        first_chunk: Callable[[int], dict[str, Any]] | None = None,
    ) -> Response:
        """The response: one JSON body with a choice per flight, or SSE chunks (each carrying
        its choice's index) in the order the engine produced them. `first_chunk(index)` is sent
        for each choice before anything else (chat's role delta)."""
        created = protocol.now()
        if not parsed.stream:
            pieces: dict[int, list[RequestOutput]] = defaultdict(list)
            try:
                async for index, out in batch:
                    pieces[index].append(out)
            except EngineFailure as exc:
                raise exc.error from None
            finally:
                batch.abort()  # the handler was cancelled: the requests go with it
            choices = []
            for f in batch.flights:
                for rank, i in enumerate(_returned(f, parsed.n, pieces)):
                    outs = pieces[i]
                    index = f.index * parsed.n + rank
                    choices.append({"index": index, **render_final(index, outs, outs[-1])})
            return Response(envelope(batch, obj, created, choices, usage=batch.usage()))

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return _sse(envelope(batch, obj, created, choices, **extra))

        async def events() -> AsyncIterator[str]:
            try:
                if first_chunk is not None:
                    for f in batch.flights:
                        for i in range(f.index * f.n, (f.index + 1) * f.n):
                            yield chunk([{"index": i, **first_chunk(i)}])
                async for index, out in batch:
                    choice = render_chunk(index, out)
                    for c in [choice] if isinstance(choice, dict) else choice or ():
                        yield chunk([{"index": index, **c}])
                usage = batch.usage()
                if parsed.include_usage and usage is not None:
                    yield chunk([], usage=usage)
                yield "[DONE]"
            except EngineFailure as exc:  # say so in-band, then stop (no [DONE])
                yield _sse(exc.error.body())
            finally:
                # A body that stops early (cancelled, closed) aborts; after the end, a no-op.
                # A body that never started is covered by Batch.watch.
                batch.abort()

        return ServerSentEvent(events(), headers={"Cache-Control": "no-cache"})

    def _token_str(self, token_id: int) -> str:
        return self.runtime.engine.token_text(token_id)

    # -- /v1/completions -----------------------------------------------------------------------
    def _check_request_id(self, request: Request) -> None:
        rid = request_id(request.scope)
        if rid.error is not None:
            raise invalid("X-Request-Id", rid.error)

    def _max_prompts(self) -> int:
        """Most prompts one request may carry: as many as could ever be admitted together (a
        full batch plus a full waiting queue)."""
        cfg = self.runtime.cfg
        return cfg.engine.max_num_seqs + cfg.server.max_queue_len

    def _check_n(self, parsed: protocol.OpenAIRequest) -> None:
        """`n` and `best_of` against server.max_n and their share of the batch."""
        cfg = self.runtime.cfg
        limit = cfg.server.max_n
        seqs, share = cfg.engine.max_num_seqs, cfg.server.max_choices_share
        slots = max(1, int(seqs * share))
        best_of = parsed.best_of if isinstance(parsed, protocol.CompletionRequest) else None
        for name, value in (("n", parsed.n), ("best_of", best_of)):
            if value is not None and value > limit:
                raise invalid(name, f"must be at most {limit} (server.max_n), got {value}")
            if value is not None and value > slots:
                raise invalid(
                    name,
                    f"{value} choices would take more than {slots} of the batch's {seqs} slots "
                    f"(server.max_choices_share {share:g} of engine.max_num_seqs); "
                    f"at most {slots}",
                )

    async def completions(self, request: Request) -> Response:
        self._check_request_id(request)
        parsed = protocol.parse_completion(await self._body(request))
        self._note_ignored(parsed.ignored_fields)
        self._check_n(parsed)
        # Sequences this request adds: one per prompt and choice.
        n = len(parsed.prompts) * parsed.params.n
        if n > (limit := self._max_prompts()):
            raise invalid(
                "prompt",
                f"has {len(parsed.prompts)} prompts x {parsed.params.n} choices = {n} "
                f"sequences; the limit is {limit} per request "
                "(engine.max_num_seqs + server.max_queue_len)",
            )
        self._admit(request, parsed.model, incoming=n)
        rt = self.runtime

        def tokenize() -> list[list[int]]:
            return [rt.engine.tokenize(p) if isinstance(p, str) else p for p in parsed.prompts]

        size = sum(len(p) for p in parsed.prompts if isinstance(p, str))
        prompts_ids = await self._off_loop(size, tokenize)
        grammar = await self._grammar(parsed)
        # Admission again: the queue may have filled (or a drain begun) while tokenizing.
        keys = self._admit(request, parsed.model, incoming=n)
        batch = self._start(request, parsed, prompts_ids, "completions", keys, grammar)
        want_lp = parsed.params.logprobs is not None

        def logprobs(outs: list[RequestOutput]) -> dict[str, Any] | None:
            if not want_lp:
                return None
            lps = [lp for o in outs for lp in o.logprobs if lp is not None]
            tokens = [self._token_str(lp.token_id) for lp in lps]
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            return {
                "tokens": tokens,
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token_str(i): v for i, v in lp.top} for lp in lps],
                "text_offset": offsets,
            }

        def final(_: int, outs: list[RequestOutput], last: RequestOutput) -> dict[str, Any]:
            return {
                "text": last.text,
                "logprobs": logprobs(outs),
                "finish_reason": last.finish_reason,
            }

        def chunk(_: int, out: RequestOutput) -> dict[str, Any] | None:
            if not out.delta_text and not out.finished and not want_lp:
                return None
            return {
                "text": out.delta_text,
                "logprobs": logprobs([out]),
                "finish_reason": out.finish_reason if out.finished else None,
            }

        return await self._respond(parsed, batch, "text_completion", final, chunk)

    # -- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        self._check_request_id(request)
        parsed = protocol.parse_chat(await self._body(request))
        self._note_ignored(parsed.ignored_fields)
        self._check_n(parsed)
        self._admit(request, parsed.model, incoming=parsed.params.n)
        # "escape": special-token text typed into a message is plain text, not control tokens.
        escape = self.runtime.cfg.server.chat_special_tokens == "escape"
        size = len(await request.body())  # read once, kept by Litestar
        tools = parsed.tools
        rt = self.runtime

        def prompt() -> list[int]:  # tools go into the messages here, the template in the runtime
            in_template = has_tools_variable(rt.engine.chat_template)
            messages, extra = render_messages(parsed.messages, tools, in_template)
            return rt.engine.tokenize_chat(messages, True, escape, **extra)

        try:
            prompt_ids = await self._off_loop(size, prompt)
        except ValueError as exc:
            raise invalid("messages", str(exc)) from None
        grammar = await self._grammar(parsed)
        keys = self._admit(request, parsed.model, incoming=parsed.params.n)
        batch = self._start(request, parsed, [prompt_ids], "chat.completions", keys, grammar)
        calling = tools is not None and tools.choice.mode != "none"
        streams: dict[int, ToolCallStream] = {}

        def logprobs(outs: list[RequestOutput]) -> dict[str, Any] | None:
            if not parsed.logprobs:
                return None

            def entry(token_id: int, value: float) -> dict[str, Any]:
                s = self._token_str(token_id)
                return {"token": s, "logprob": value, "bytes": list(s.encode())}

            content = []
            for o in outs:
                for lp in o.logprobs:
                    if lp is not None:
                        content.append(
                            {
                                **entry(lp.token_id, lp.logprob),
                                "top_logprobs": [entry(i, v) for i, v in lp.top],
                            }
                        )
            return {"content": content}

        def final(_: int, outs: list[RequestOutput], last: RequestOutput) -> dict[str, Any]:
            message: dict[str, Any] = {"role": "assistant", "content": last.text}
            reason = last.finish_reason
            if calling and reason == "stop":
                assert tools is not None
                message, reason = tool_message(last.text, tools)
            return {"message": message, "logprobs": logprobs(outs), "finish_reason": reason}

        def chunk(index: int, out: RequestOutput) -> list[dict[str, Any]] | dict[str, Any] | None:
            if calling:
                assert tools is not None
                return tool_chunks(streams, index, out, tools, logprobs([out]))
            if not out.delta_text and not out.finished and not parsed.logprobs:
                return None
            delta = {"content": out.delta_text} if out.delta_text else {}
            return {
                "delta": delta,
                "logprobs": logprobs([out]),
                "finish_reason": out.finish_reason if out.finished else None,
            }

        def first(_: int) -> dict[str, Any]:
            return {
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }

        obj = "chat.completion.chunk" if parsed.stream else "chat.completion"
        return await self._respond(parsed, batch, obj, final, chunk, first_chunk=first)

    def models(self) -> dict[str, Any]:
        d = self.runtime
        data = []
        if d.model_name:
            data.append(
                {
                    "id": d.model_name,
                    "object": "model",
                    "created": int(d.started_at),
                    "owned_by": "controlplane",
                    "max_model_len": d.engine.max_model_len,
                }
            )
        return {"object": "list", "data": data}


def structured_type(parsed: protocol.OpenAIRequest) -> str:
    """What constrained a request (its rows' `structured`, the metrics' `type` label)."""
    out = parsed.structured
    assert out is not None
    tools = parsed.tools if isinstance(parsed, protocol.ChatRequest) else None
    forced = tools is not None and tools.choice.mode in ("required", "named")
    return "tools" if forced else out.kind  # a forced call is the request's only constraint


def tool_message(text: str, tools: ToolRequest) -> tuple[dict[str, Any], str]:
    """A finished chat choice's message and finish reason when tools were offered: tool calls
    parsed from the text (constrained: always, unless cut short; auto: in the formats the
    README lists), or the text itself. Never raises: a malformed call is text."""
    if tools.choice.mode in ("named", "required"):
        calls = parse_constrained(text, tools) or []
        content = None
    else:
        content, calls = parse_auto(text, tools.tools)
    if not calls:
        return {"role": "assistant", "content": text}, "stop"
    if tools.legacy:  # `functions` asked: the deprecated shape, one call
        call = calls[0].to_openai()["function"]
        return {"role": "assistant", "content": content, "function_call": call}, "function_call"
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [c.to_openai() for c in calls],
    }
    return message, "tool_calls"


def _legacy_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A tool-call delta in the deprecated `function_call` shape (one call: index 0)."""
    calls = delta.get("tool_calls")
    if not calls:
        return delta
    fn = calls[0]["function"]
    return {"function_call": {k: v for k, v in fn.items() if k in ("name", "arguments")}}


def tool_chunks(
    streams: dict[int, ToolCallStream],
    index: int,
    out: RequestOutput,
    tools: ToolRequest,
    logprobs: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """One output of a streamed chat choice with tools: its deltas in OpenAI's shape (tool-call
    headers, then argument pieces; or content)."""
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = ToolCallStream(tools, tools.tools)
    deltas = stream.feed(out.delta_text) if out.delta_text else []
    reason = None
    if out.finished:
        rest, called = stream.finish()
        deltas += rest
        called_reason = "function_call" if tools.legacy else "tool_calls"
        reason = called_reason if called and out.finish_reason == "stop" else out.finish_reason
    if tools.legacy:
        deltas = [_legacy_delta(d) for d in deltas]
    chunks = [{"delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if logprobs is not None and chunks:
        chunks[0]["logprobs"] = logprobs
    if out.finished:
        chunks.append({"delta": {}, "logprobs": None, "finish_reason": reason})
    return chunks


def create_app(runtime: Runtime) -> Litestar:
    """The HTTP app over `runtime` (its only view of the daemon and the engine)."""
    api = InferenceAPI(runtime)
    max_body = runtime.cfg.server.max_body_bytes

    def api_key(connection: ASGIConnection, _: Any) -> None:
        """Guard of every /v1 route: the key is checked before the body is read, once."""
        connection.state.api_key = api.authenticate(connection)

    @post(
        "/v1/completions",
        status_code=200,
        summary="OpenAI completions",
        guards=[api_key],
        operation_class=openapi_body(schema.COMPLETION_SCHEMA),
    )
    async def completions(request: Request) -> Response:
        return await api.completions(request)

    @post(
        "/v1/chat/completions",
        status_code=200,
        summary="OpenAI chat completions",
        guards=[api_key],
        operation_class=openapi_body(schema.CHAT_SCHEMA),
    )
    async def chat_completions(request: Request) -> Response:
        return await api.chat(request)

    @get("/v1/models", summary="Served models", guards=[api_key])
    async def models() -> dict[str, Any]:
        return api.models()

    @get("/health", summary="Readiness: 200 only while the engine is loaded and stepping")
    async def health() -> Response:
        d = runtime
        body = {
            "status": d.reported_state,
            "model": d.model_name or None,
            "uptime_s": round(time.time() - d.started_at, 3),
        }
        return Response(body, status_code=200 if d.healthy else 503)

    # Probes for orchestrators (deploy/kubernetes.yaml). Liveness fails only when restarting
    # helps (the step loop died); readiness fails whenever requests would get 503.
    @get("/health/live", summary="Liveness: 200 while the step loop runs (or the model loads)")
    async def health_live() -> Response:
        alive = runtime.alive
        body = {"status": "alive" if alive else "dead", "state": runtime.state}
        return Response(body, status_code=200 if alive else 503)

    @get("/health/ready", summary="Readiness: 200 only when loaded and admitting requests")
    async def health_ready() -> Response:
        d = runtime
        body = {"status": d.reported_state}
        return Response(body, status_code=200 if d.healthy else 503)

    from controlplane.admin.routes import admin_router, metrics_handler

    async def add_request_id(message: Any, scope: Any) -> None:
        """Every /v1 response carries X-Request-Id (errors and unknown routes included): the
        client's, or the one generated for the request (see controlplane.http.request_id)."""
        if message["type"] == "http.response.start" and scope.get("path", "").startswith("/v1/"):
            value = request_id(scope).value.encode("ascii")
            message["headers"] = [*message.get("headers", ()), (b"x-request-id", value)]

    return Litestar(
        route_handlers=[
            completions,
            chat_completions,
            models,
            health,
            health_live,
            health_ready,
            admin_router(runtime, finished=api.recently_finished.get),
            metrics_handler(runtime),
        ],
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: handle_http_exception,
            413: lambda request, _: handle_api_error(request, body_too_large(max_body)),
            Exception: handle_unexpected,
        },
        request_max_body_size=max_body,
        before_send=[add_request_id],
        debug=False,
        logging_config=None,  # the daemon configured logging (text or JSON); keep it
    )
