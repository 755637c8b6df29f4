"""The Litestar app: OpenAI-compatible inference API and /health."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import ServerSentEvent

from controlplane.engine.errors import InvalidSettingError
from controlplane.server import protocol
from controlplane.server.errors import (
    APIError,
    body_too_large,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
    invalid,
    unavailable,
)
from controlplane.store.records import RequestRecord

if TYPE_CHECKING:
    from controlplane.engine import RequestOutput
    from controlplane.engine.async_engine import RequestStream
    from controlplane.server.daemon import Daemon


def _sse(payload: dict[str, Any]) -> str:
    """One SSE `data:` payload; Litestar's ServerSentEvent does the framing."""
    return json.dumps(payload, separators=(",", ":"))


def envelope(
    rec: RequestRecord, obj: str, created: int, choice: dict[str, Any] | None, **extra: Any
) -> dict[str, Any]:
    """The OpenAI response / chunk shape around one choice (none: the usage-only last chunk)."""
    return {
        "id": rec.id,
        "object": obj,
        "created": created,
        "model": rec.model,
        "choices": [] if choice is None else [{"index": 0, **choice}],
        **extra,
    }


def _request_failed(out: RequestOutput) -> APIError:
    """One request failed inside the engine (its row says why); everyone else is served."""
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
    """One admitted request, from admission to its one final record.

    A task of its own (`run`) consumes the engine's stream and writes the final record, so the
    request's end does not depend on the HTTP response: Litestar cancels a streaming body
    whose client has left, possibly before the body's first line ran (so a `finally` in the
    body never runs). The response reads outputs from `outputs`. A client that leaves (seen by
    `watch`), and a response that stops early, call `abort()`; the engine then ends the request
    with an `abort` output, which ends `run` like any other last output.
    """

    daemon: Daemon
    stream: RequestStream
    rec: RequestRecord
    on_end: Callable[[Flight], None]  # called once, right after the final record
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    token_times: list[float] = field(default_factory=list)  # one per output token (ITL metrics)
    last: RequestOutput | None = None
    done: bool = False  # the final record is written
    _abort_sent: bool = False

    async def run(self) -> None:
        error = None
        try:
            async for out in self.stream:
                self.last = out
                self.token_times.extend([out.time] * len(out.new_token_ids))
                self.outputs.put_nowait(out)
        except asyncio.CancelledError:  # the loop is going away: still one final record
            self.stream.cancel()
            raise
        except Exception as exc:  # the engine died: tell the response, record the error
            error = repr(exc)
            self.outputs.put_nowait(EngineFailure(unavailable(f"engine failed: {exc}")))
        finally:
            self.done = True
            self.daemon.finish(self.rec, self.last, self.token_times, error=error)
            self.on_end(self)
            self.outputs.put_nowait(_END)

    def abort(self) -> None:
        """Stop the engine request (idempotent; nothing to do once it has ended)."""
        if not self.done and not self._abort_sent and self.daemon.aengine is not None:
            self._abort_sent = True
            self.daemon.aengine.abort(self.rec.id)

    async def watch(self, receive: Callable[[], Awaitable[Any]]) -> None:
        """Abort when the client disconnects. uvicorn answers every `receive` with
        `http.disconnect` once the client is gone or the response is complete, whoever else
        (Litestar's streaming response) is listening too."""
        while not self.done:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.abort()
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs; EngineFailure if the engine failed it."""
        while (item := await self.outputs.get()) is not _END:
            if isinstance(item, EngineFailure):
                raise item
            if item.finish_reason == "error":  # this request failed, the engine serves on
                raise EngineFailure(_request_failed(item))
            yield item


class InferenceAPI:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps weak ones
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.recently_finished: OrderedDict[str, str] = OrderedDict()  # id -> finish reason

    # -- admission --------------------------------------------------------------------------
    def _admit(self, request: Request, model: str) -> tuple[str | None, str | None]:
        d = self.daemon
        key_name = key_hash = None
        if d.cfg.api_keys:
            found = d.authenticate(request.headers.get("authorization"))
            if found is None:
                raise APIError(
                    401,
                    "invalid or missing API key (Authorization: Bearer <key>)",
                    type="authentication_error",
                    code="invalid_api_key",
                )
            key_name, key_hash = found[0].name, found[1]
        if d.state != "ready" or d.aengine is None:
            raise unavailable(f"server is {d.state}; retry later")
        if not d.aengine.is_running:
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
        if d.queue_length(incoming=1) > limit:
            waiting = d.queue_length()
            raise APIError(
                429,
                f"the waiting queue is full ({waiting} waiting, max_queue_len {limit}); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        return key_name, key_hash

    async def _body(self, request: Request) -> Any:
        return protocol.load_json(await request.body())

    async def _off_loop(self, size: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw), in a worker thread when the input is large (see OFF_LOOP_CHARS)."""
        if size < OFF_LOOP_CHARS:
            return fn(*args, **kw)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, lambda: fn(*args, **kw))

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

    def _start(
        self,
        request: Request,
        parsed: protocol.ParsedRequest,
        prompt_ids: list[int],
        endpoint: str,
        key_name: str | None,
        key_hash: str | None,
    ) -> Flight:
        d = self.daemon
        assert d.aengine is not None
        eng = d.aengine.engine
        if parsed.default_max_tokens:
            # OpenAI chat: no max_tokens means "as much as fits".
            parsed.params.max_tokens = max(1, eng.max_model_len - len(prompt_ids))
        try:
            eng.validate_request(prompt_ids, parsed.params)
        except InvalidSettingError as exc:
            raise invalid(exc.field, str(exc).split(": ", 1)[1]) from None
        prefix = "chatcmpl" if endpoint == "chat.completions" else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"
        stream = d.aengine.add_request(prompt_ids, parsed.params, rid)
        rec = RequestRecord(
            id=rid,
            instance_id=d.instance_id,
            model=d.model_name,
            endpoint=endpoint,
            status="running",
            arrival_time=datetime.now(UTC),
            api_key_name=key_name,
            api_key_hash=key_hash,
            prompt_tokens=len(prompt_ids),
        )
        d.record(rec)
        flight = Flight(d, stream, rec, on_end=self._remember)
        self._spawn(flight.run())
        self._spawn(flight.watch(request.receive))
        return flight

    # -- shared response flow ------------------------------------------------------------------
    async def _respond(self, parsed, flight, render_final, render_chunk, first_chunk=None):
        rec = flight.rec
        if not parsed.stream:
            pieces: list[RequestOutput] = []
            try:
                async for out in flight:
                    pieces.append(out)
            except EngineFailure as exc:
                raise exc.error from None
            finally:
                flight.abort()  # the handler was cancelled: the request goes with it
            return Response(render_final(pieces, flight.last))

        async def events() -> AsyncIterator[str]:
            try:
                if first_chunk is not None:
                    yield _sse(first_chunk)
                async for out in flight:
                    chunk = render_chunk(out)
                    if chunk is not None:
                        yield _sse(chunk)
                if parsed.include_usage and flight.last is not None:
                    yield _sse(self._usage_chunk(rec, flight.last))
                yield "[DONE]"
            except EngineFailure as exc:  # say so in-band, then stop (no [DONE])
                yield _sse(APIError(500, exc.error.message, type="server_error").body())
            finally:
                # A body that stops early (cancelled, closed) aborts; after the end, a no-op.
                # A body that never started is covered by Flight.watch.
                flight.abort()

        return ServerSentEvent(events(), headers={"Cache-Control": "no-cache"})

    def _usage_chunk(self, rec: RequestRecord, last: RequestOutput) -> dict[str, Any]:
        obj = "chat.completion.chunk" if rec.endpoint == "chat.completions" else "text_completion"
        return envelope(rec, obj, protocol.now(), None, usage=self._usage(last))

    @staticmethod
    def _usage(last: RequestOutput) -> dict[str, Any]:
        m = last.metrics
        return protocol.usage(m.num_prompt_tokens, m.num_output_tokens, m.num_cached_tokens)

    def _token_str(self, token_id: int) -> str:
        assert self.daemon.aengine is not None
        return self.daemon.aengine.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        parsed = protocol.parse_completion(await self._body(request))
        self._admit(request, parsed.model)
        tok = self.daemon.aengine.engine.tokenizer
        prompt = parsed.prompt
        if isinstance(prompt, str):
            prompt = await self._off_loop(len(prompt), tok.encode, prompt)
        # Admission again: the queue may have filled (or a drain begun) while tokenizing.
        key_name, key_hash = self._admit(request, parsed.model)
        flight = self._start(request, parsed, prompt, "completions", key_name, key_hash)
        rec = flight.rec
        created = protocol.now()
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

        def final(outs: list[RequestOutput], last: RequestOutput | None) -> dict[str, Any]:
            assert last is not None
            return envelope(
                rec,
                "text_completion",
                created,
                {
                    "text": last.text,
                    "logprobs": logprobs(outs),
                    "finish_reason": last.finish_reason,
                },
                usage=self._usage(last),
            )

        def chunk(out: RequestOutput) -> dict[str, Any] | None:
            if not out.delta_text and not out.finished and not want_lp:
                return None
            return envelope(
                rec,
                "text_completion",
                created,
                {
                    "text": out.delta_text,
                    "logprobs": logprobs([out]),
                    "finish_reason": out.finish_reason if out.finished else None,
                },
            )

        return await self._respond(parsed, flight, final, chunk)

    # -- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        parsed = protocol.parse_chat(await self._body(request))
        self._admit(request, parsed.model)
        tok = self.daemon.aengine.engine.tokenizer
        # "escape": special-token text typed into a message is plain text, not control tokens.
        escape = self.daemon.cfg.server.chat_special_tokens == "escape"
        size = len(await request.body())  # read once, kept by Litestar
        try:
            prompt_ids = await self._off_loop(
                size, tok.encode_chat, parsed.messages, True, escape=escape
            )
        except ValueError as exc:
            raise invalid("messages", str(exc)) from None
        key_name, key_hash = self._admit(request, parsed.model)
        flight = self._start(request, parsed, prompt_ids, "chat.completions", key_name, key_hash)
        rec = flight.rec
        created = protocol.now()

        def logprobs(outs: list[RequestOutput]) -> dict[str, Any] | None:
            if not parsed.chat_logprobs:
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

        def final(outs: list[RequestOutput], last: RequestOutput | None) -> dict[str, Any]:
            assert last is not None
            return envelope(
                rec,
                "chat.completion",
                created,
                {
                    "message": {"role": "assistant", "content": last.text},
                    "logprobs": logprobs(outs),
                    "finish_reason": last.finish_reason,
                },
                usage=self._usage(last),
            )

        def chunk(out: RequestOutput) -> dict[str, Any] | None:
            if not out.delta_text and not out.finished and not parsed.chat_logprobs:
                return None
            delta = {"content": out.delta_text} if out.delta_text else {}
            return envelope(
                rec,
                "chat.completion.chunk",
                created,
                {
                    "delta": delta,
                    "logprobs": logprobs([out]),
                    "finish_reason": out.finish_reason if out.finished else None,
                },
            )

        first = envelope(
            rec,
            "chat.completion.chunk",
            created,
            {
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            },
        )
        return await self._respond(parsed, flight, final, chunk, first_chunk=first)

    def models(self) -> dict[str, Any]:
        d = self.daemon
        data = []
        if d.model_name:
            data.append(
                {
                    "id": d.model_name,
                    "object": "model",
                    "created": int(d.started_at),
                    "owned_by": "controlplane",
                    "max_model_len": d.aengine.engine.max_model_len if d.aengine else None,
                }
            )
        return {"object": "list", "data": data}


def create_app(daemon: Daemon) -> Litestar:
    api = InferenceAPI(daemon)
    max_body = daemon.cfg.server.max_body_bytes

    @post(
        "/v1/completions",
        status_code=200,
        summary="OpenAI completions",
        operation_class=protocol.openapi_body(protocol.COMPLETION_SCHEMA),
    )
    async def completions(request: Request) -> Response:
        return await api.completions(request)

    @post(
        "/v1/chat/completions",
        status_code=200,
        summary="OpenAI chat completions",
        operation_class=protocol.openapi_body(protocol.CHAT_SCHEMA),
    )
    async def chat_completions(request: Request) -> Response:
        return await api.chat(request)

    @get("/v1/models", summary="Served models")
    async def models() -> dict[str, Any]:
        return api.models()

    @get("/health", summary="Readiness: 200 only while the engine is loaded and stepping")
    async def health() -> Response:
        d = daemon
        body = {
            "status": d.state if d.state != "ready" or d.healthy else "dead",
            "model": d.model_name or None,
            "uptime_s": round(time.time() - d.started_at, 3),
        }
        return Response(body, status_code=200 if d.healthy else 503)

    from controlplane.admin_api.routes import admin_router, metrics_handler

    return Litestar(
        route_handlers=[
            completions,
            chat_completions,
            models,
            health,
            admin_router(daemon, finished=api.recently_finished.get),
            metrics_handler(daemon),
        ],
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: handle_http_exception,
            413: lambda request, _: handle_api_error(request, body_too_large(max_body)),
            Exception: handle_unexpected,
        },
        request_max_body_size=max_body,
        debug=False,
        logging_config=None,  # the daemon configured logging (text or JSON); keep it
    )
