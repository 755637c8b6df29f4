"""The Litestar app: OpenAI-compatible inference API and /health."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import ServerSentEvent

from controlplane.engine.errors import InvalidSettingError
from controlplane.server import protocol
from controlplane.server.errors import (
    APIError,
    handle_api_error,
    handle_http_exception,
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


class InferenceAPI:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

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
        waiting = d.queue_length()
        limit = d.cfg.server.max_queue_len
        if waiting >= limit:
            raise APIError(
                429,
                f"the waiting queue is full ({waiting} waiting, max_queue_len {limit}); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        return key_name, key_hash

    async def _body(self, request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise invalid("body", f"is not valid JSON ({exc})") from None

    def _start(
        self,
        parsed: protocol.ParsedRequest,
        prompt_ids: list[int],
        endpoint: str,
        key_name: str | None,
        key_hash: str | None,
    ) -> tuple[RequestStream, RequestRecord]:
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
        return stream, rec

    # -- shared response flow ------------------------------------------------------------------
    async def _respond(self, parsed, stream, rec, render_final, render_chunk, first_chunk=None):
        d = self.daemon
        token_times: list[float] = []  # one per output token: inter-token latency metrics
        if not parsed.stream:
            last: RequestOutput | None = None
            pieces: list[RequestOutput] = []
            try:
                async for out in stream:
                    pieces.append(out)
                    token_times += [out.time] * len(out.new_token_ids)
                    last = out
            except Exception as exc:
                d.finish(rec, last, token_times, error=repr(exc))
                raise unavailable(f"engine failed: {exc}") from exc
            finally:
                stream.cancel()
            d.finish(rec, last, token_times)
            return Response(render_final(pieces, last))

        async def events() -> AsyncIterator[str]:
            last = None
            error = None
            try:
                if first_chunk is not None:
                    yield _sse(first_chunk)
                async for out in stream:
                    last = out
                    token_times.extend([out.time] * len(out.new_token_ids))
                    chunk = render_chunk(out)
                    if chunk is not None:
                        yield _sse(chunk)
                if parsed.include_usage and last is not None:
                    yield _sse(self._usage_chunk(rec, last))
                yield "[DONE]"
            except Exception as exc:  # the engine died mid-stream: say so in-band, then stop
                error = repr(exc)
                yield _sse(APIError(500, f"engine failed: {exc}", type="server_error").body())
            finally:
                stream.cancel()  # a client that went away aborts its request here
                d.finish(rec, last, token_times, error=error)

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
        key_name, key_hash = self._admit(request, parsed.model)
        tok = self.daemon.aengine.engine.tokenizer
        prompt_ids = tok.encode(parsed.prompt) if isinstance(parsed.prompt, str) else parsed.prompt
        stream, rec = self._start(parsed, prompt_ids, "completions", key_name, key_hash)
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

        return await self._respond(parsed, stream, rec, final, chunk)

    # -- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        parsed = protocol.parse_chat(await self._body(request))
        key_name, key_hash = self._admit(request, parsed.model)
        tok = self.daemon.aengine.engine.tokenizer
        try:
            text = tok.apply_chat_template(parsed.messages, add_generation_prompt=True)
        except ValueError as exc:
            raise invalid("messages", str(exc)) from None
        # The template already holds the special tokens (bos included): don't add them twice.
        prompt_ids = tok.encode(text, add_special_tokens=False)
        stream, rec = self._start(parsed, prompt_ids, "chat.completions", key_name, key_hash)
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
        return await self._respond(parsed, stream, rec, final, chunk, first_chunk=first)

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

    @post("/v1/completions", status_code=200, summary="OpenAI completions")
    async def completions(request: Request) -> Response:
        return await api.completions(request)

    @post("/v1/chat/completions", status_code=200, summary="OpenAI chat completions")
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
            admin_router(daemon),
            metrics_handler(daemon),
        ],
        exception_handlers={APIError: handle_api_error, HTTPException: handle_http_exception},
        debug=False,
        logging_config=None,  # the daemon configured logging (text or JSON); keep it
    )
