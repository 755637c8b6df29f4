"""Serving /v1 requests: admission (state, model, queue, key), parsing off the event loop,
validation, queueing one engine request per prompt, and the completion and chat flows."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.response import ServerSentEvent

from controlplane.engine.sampling_params import LOWEST_PRIORITY_CLASS
from controlplane.engine.structured import GrammarEngineError
from controlplane.errors import FieldError
from controlplane.http.errors import (
    APIError,
    invalid,
    unavailable,
)
from controlplane.http.request_id import new_id, request_id
from controlplane.openai import protocol
from controlplane.openai.tools import (
    ToolCallStream,
    ToolRequest,
    has_tools_variable,
    render_messages,
)
from controlplane.runtime.state import DaemonState
from controlplane.store.records import RequestRecord
from controlplane.tenants.limits import RateLimits, decision_headers
from controlplane.tenants.usage import OPEN, REASON_OF_CODE

if TYPE_CHECKING:
    from controlplane.engine import RequestOutput, SamplingParams
    from controlplane.engine.structured import CompiledGrammar
    from controlplane.runtime.runtime import Runtime


from controlplane.openai import scoring
from controlplane.openai.flight import Batch, EngineFailure, Flight, returned
from controlplane.openai.render import (
    FORCED,
    cut_tool_message,
    envelope,
    sse,
    structured_type,
    tool_chunks,
    tool_message,
)

log = logging.getLogger("controlplane.api")


# Prompts at least this long are tokenized in a worker thread: a multi-megabyte prompt takes
# seconds to tokenize, and the event loop must keep answering (/health, other streams) meanwhile.
OFF_LOOP_CHARS = 4096
# Finished request ids remembered so that an admin abort can say "already finished" (409).
RECENTLY_FINISHED = 10_000
# Set on a request's state once an engine request is queued for it: its end is counted when
# its engine requests end (InferenceAPI.serve, _start).
_ADMITTED = "traffic_admitted"
# Set on a request's state by the rate limits (InferenceAPI._admit_limits): its lease on its
# key's counters (given back when it ends) and the x-ratelimit-* headers of its response.
LEASE = "ratelimit_lease"
RATELIMIT_HEADERS = "ratelimit_headers"
# Set on a request's state by the rate limits when they refuse it: which limit (a reason of
# controlplane.tenants.usage.REASONS; the four share one error code), for `serve`'s count.
THROTTLED_BY = "throttled_by"


def _redis_limiter(url: str, failure: str) -> Any:
    """The Redis backend of the rate limits (imported only when [limits] asks for it)."""
    from controlplane.tenants.redis_limits import RedisLimiter

    return RedisLimiter(url, failure)


class InferenceAPI:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps weak ones
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.recently_finished: OrderedDict[str, str] = OrderedDict()  # id -> finish reason
        # A table key's own limits over the [limits] defaults (config file keys: the defaults).
        self.limits = RateLimits(
            lambda: self.runtime.cfg.limits,
            redis=_redis_limiter,
            overrides=lambda name: self.runtime.keys.limits_of(name),
        )

    # -- traffic: the one place requests are counted -------------------------------------------
    async def serve(
        self, request: Request, handle: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """One /v1 generation request (`handle`: `completions` or `chat`), counted in
        runtime.traffic: it arrived, then ends once, as rejected (429 or 503 before anything
        was queued: `_admit`'s answers) or finished. An admitted request finishes when its
        last engine request ends (`_start`), streamed or not; any other, here. Its key's
        usage (runtime.usage) is counted at the same points: admitted and finished in
        `_start`, refused here (`_refused`)."""
        traffic = self.runtime.traffic
        traffic.arrived(time.time())
        try:
            return await handle(request)
        except BaseException as exc:
            if not getattr(request.state, _ADMITTED, False):
                self._give_back(request, None)  # nothing ran: its reservation goes back whole
                status = (
                    exc.status if isinstance(exc, APIError) else getattr(exc, "status_code", 500)
                )
                if isinstance(exc, APIError) and status in (429, 503):
                    reason = getattr(request.state, THROTTLED_BY, None) or REASON_OF_CODE.get(
                        exc.code or ""
                    )
                    if reason is not None:  # a key's refusal (not a drain's or a load's 503)
                        self._refused(request.state.api_key[0], reason)
                if status in (429, 503):
                    traffic.rejected(status, time.time())
                else:  # a client that left (cancelled) did not fail
                    failed = status >= 500 and not isinstance(exc, asyncio.CancelledError)
                    traffic.finished(failed, time.time())
            raise

    def _refused(self, key_name: str | None, reason: str) -> None:
        """A request of `key_name` refused for `reason` (controlplane.tenants.usage.REASONS):
        its key's live usage, controlplane:requests_throttled_total and the `refusals` table
        (the reports' throttled counts). Called by `serve` and, for a suspended key's 403, by
        `authenticate` (the route's guard answers it before `serve` runs)."""
        self.runtime.usage.refused(key_name, reason)
        self.runtime.ledger.refused(self.runtime.instance_id, key_name, reason)
        self.runtime.metrics.request_throttled(OPEN if key_name is None else key_name, reason)

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

    async def _admit_limits(
        self, request: Request, parsed: protocol.OpenAIRequest, prompts_ids: list[list[int]]
    ) -> None:
        """The key's rate limits ([limits], controlplane.tenants.limits), once the prompts are
        tokenized: one request, and prompt + max_tokens (times its choices) tokens reserved;
        429 naming the limit with Retry-After. The lease goes back when the request ends
        (`_give_back`), corrected to the tokens it used."""
        key_name = request.state.api_key[0]
        prompt = sum(len(ids) for ids in prompts_ids)
        reserve = self._reserve(parsed, prompts_ids)
        decision, backend = await self.limits.admit(key_name, reserve, prompt)
        if decision is None:
            return
        hdrs = decision_headers(decision)
        if not decision.allowed:
            if decision.status == 429 and decision.limit:
                setattr(request.state, THROTTLED_BY, decision.limit)
            raise APIError(
                decision.status,
                decision.message,
                type="rate_limit_error" if decision.status == 429 else "service_unavailable",
                code=decision.code,
                headers=hdrs,
            )
        setattr(request.state, RATELIMIT_HEADERS, hdrs)
        setattr(request.state, LEASE, (decision.lease, backend))

    def _admit_budget(self, request: Request) -> None:
        """The key's spend budget (controlplane.tenants.budgets): at the budget a key with
        budget_action reject gets 429 insufficient_quota (OpenAI's type and code; Retry-After
        until the period resets, x-should-retry false: the openai SDK's own retries could not
        succeed), one with deprioritize is admitted with `request.state.budget_deprioritized`
        set (its requests then run at the lowest priority class)."""
        key_name = request.state.api_key[0]
        verdict = self.runtime.budgets.check(key_name)
        request.state.budget_deprioritized = verdict is not None and verdict.action != "reject"
        if verdict is None:
            return
        if verdict.action == "reject":
            self.runtime.metrics.budget_request(key_name, "rejected")
            raise APIError(
                429,
                verdict.message,
                type="insufficient_quota",
                code="insufficient_quota",
                headers={"Retry-After": str(verdict.retry_after_s), "x-should-retry": "false"},
            )
        self.runtime.metrics.budget_request(key_name, "deprioritized")

    def _reserve(self, parsed: protocol.OpenAIRequest, prompts_ids: list[list[int]]) -> int:
        """Tokens a request may use: its prompts plus the most completion tokens of every
        choice (OpenAI chat without max_tokens: what fits in the context, as `_start` sets)."""
        max_model_len = self.runtime.engine.max_model_len or 0
        p = parsed.params
        choices = max(p.n, getattr(parsed, "best_of", None) or 1)
        total = 0
        for ids in prompts_ids:
            most = p.max_tokens or 0
            if isinstance(parsed, protocol.ChatRequest) and parsed.default_max_tokens:
                most = max(1, max_model_len - len(ids))
            total += len(ids) + most * choices
        return total

    def _give_back(self, request: Request, batch: Batch | None) -> None:
        """The request's lease on its key's counters, returned once, corrected to the tokens
        it used (`batch`'s usage; None: nothing ran)."""
        held = getattr(request.state, LEASE, None)
        if held is None:
            return
        lease, backend = held
        setattr(request.state, LEASE, None)
        used = 0
        if batch is not None and (usage := batch.usage()) is not None:
            used = usage["prompt_tokens"] + usage["completion_tokens"]
        self._spawn(backend.release(lease, used))

    def authenticate(self, request: ASGIConnection) -> tuple[str | None, str | None]:
        """The API key's name and hash ((None, None) on an open API); 401 otherwise. Every /v1
        route runs this first, as a guard: nothing about an anonymous request is parsed,
        validated or counted (its body is not even read)."""
        rt = self.runtime
        if not rt.cfg.api_keys and not rt.keys.closed:  # no key anywhere: an open API
            return None, None
        address = request.client.host if request.client else ""
        wait = rt.auth_failures.retry_after(address)
        if wait is not None:  # this address failed too often: not even a right key is tried
            raise APIError(
                429,
                "too many failed authentications from this address; retry later",
                type="rate_limit_error",
                code="too_many_authentication_failures",
                headers={"Retry-After": str(wait)},
            )
        authorization = request.headers.get("authorization")
        found = rt.authenticate(authorization)
        if found is None:
            if authorization:  # a wrong key (a guess) counts; no key at all guesses nothing
                rt.auth_failures.failed(address, authorization.encode())
            raise APIError(
                401,
                "invalid or missing API key (Authorization: Bearer <key>)",
                type="authentication_error",
                code="invalid_api_key",
            )
        if found[0].name in self.runtime.cfg.server.suspended_keys:
            # server.suspended_keys (live): checked per request, so running ones go on.
            self._refused(found[0].name, "suspended")
            raise APIError(
                403,
                f"api key {found[0].name!r} is suspended by the operator",
                type="permission_error",
                code="api_key_suspended",
            )
        models = getattr(found[0], "allowed_models", None)  # a table key's (None: every model)
        if models is not None and rt.model_name not in models:
            # This daemon serves one model: a key not allowed it may use no /v1 route here.
            raise APIError(
                403,
                f"api key {found[0].name!r} may not use the model `{rt.model_name}` "
                f"(allowed_models: {', '.join(models)})",
                type="permission_error",
                param="model",
                code="model_not_allowed",
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

    def _tenancy(self, request: Request, key_name: str | None) -> dict[str, Any]:
        """The request's scheduling identity (engine.scheduling_policy): its key's name (fair
        shares are per key) and priority class (a table key's; config file keys and an open
        API: 0), the lowest class once the key is over a deprioritizing budget."""
        if getattr(request.state, "budget_deprioritized", False):
            cls = LOWEST_PRIORITY_CLASS
        else:
            cls = self.runtime.keys.priority_class_of(key_name) if key_name else 0
        return {"tenant": key_name, "priority_class": cls}

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
        tenancy = self._tenancy(request, keys[0])
        for i, ids in enumerate(prompts_ids):
            p = dataclasses.replace(parsed.params, **tenancy)
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
        prefix = {"chat.completions": "chatcmpl", "responses": "resp"}.get(endpoint, "cmpl")
        response_id = new_id(prefix) if rid.from_client else rid.value
        batch = Batch(response_id, d.model_name, [], asyncio.Queue())

        def ended(flight: Flight) -> None:  # the batch's last flight counts the request
            self._remember(flight)
            if batch.done:
                d.traffic.finished(any(f.failed for f in batch.flights), time.time())
                usage = batch.usage()
                d.usage.finished(keys[0], 0 if usage is None else usage["completion_tokens"])
                self._give_back(request, batch)

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
                    n=p.n,
                    max_tokens=p.max_tokens,
                )
                if grammar is not None:
                    kind = structured_type(parsed)
                    compile_s = None if grammar.cached else grammar.compile_s
                    rec.structured = kind
                    rec.grammar_compile_ms = round((compile_s or 0.0) * 1000, 3)
                    d.metrics.observe_structured(kind, compile_s)
                d.ledger.record(rec)
                flight = Flight(d, stream, rec, ended, batch.outputs, i, p.n, p.max_tokens)
                flight.priority_class = p.priority_class
                batch.flights.append(flight)
                if i == 0:  # admitted from here on: `ended` counts it finished, once
                    setattr(request.state, _ADMITTED, True)
                    d.usage.admitted(keys[0], sum(len(ids) for ids in prompts_ids))
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
        except GrammarEngineError as exc:  # the server's llguidance, not the request
            raise APIError(
                500, str(exc), type="server_error", code="structured_outputs_unavailable"
            ) from None

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
                for rank, i in enumerate(returned(f, parsed.n, pieces)):
                    outs = pieces[i]
                    index = f.index * parsed.n + rank
                    choices.append({"index": index, **render_final(index, outs, outs[-1])})
            return Response(envelope(batch, obj, created, choices, usage=batch.usage()))

        # stream_options.continuous_usage_stats: every chunk carries the usage so far (the
        # prompts, the tokens of the outputs read so far), request-wide like the last chunk's.
        seen: dict[str, RequestOutput] = {}  # each engine request's latest output read
        sent = [0]  # output tokens read so far, every choice (metrics are live: ahead of it)

        def usage_so_far() -> dict[str, Any]:
            return protocol.usage(
                sum(f.rec.prompt_tokens for f in batch.flights),
                sent[0],
                sum(o.metrics.num_cached_tokens for o in seen.values()),
            )

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            if parsed.continuous_usage and "usage" not in extra:
                extra["usage"] = usage_so_far()
            return sse(envelope(batch, obj, created, choices, **extra))

        async def events() -> AsyncIterator[str]:
            try:
                if first_chunk is not None:
                    for f in batch.flights:
                        for i in range(f.index * f.n, (f.index + 1) * f.n):
                            yield chunk([{"index": i, **first_chunk(i)}])
                async for index, out in batch:
                    seen[out.request_id] = out
                    sent[0] += len(out.new_token_ids)
                    choice = render_chunk(index, out)
                    for c in [choice] if isinstance(choice, dict) else choice or ():
                        yield chunk([{"index": index, **c}])
                usage = batch.usage()
                if parsed.include_usage and usage is not None:
                    yield chunk([], usage=usage)
                yield "[DONE]"
            except EngineFailure as exc:  # say so in-band, then stop (no [DONE])
                yield sse(exc.error.body())
            finally:
                # A body that stops early (cancelled, closed) aborts; after the end, a no-op.
                # A body that never started is covered by Batch.watch.
                batch.abort()

        return ServerSentEvent(events(), headers={"Cache-Control": "no-cache"})

    def _check_scoring(self, prompts_ids: list[list[int]], field: str) -> None:
        """Prompts to be scored (echo with logprobs, prompt_logprobs) against
        server.max_prompt_logprobs_tokens: a 400 naming `field` and the limit."""
        limit = self.runtime.cfg.server.max_prompt_logprobs_tokens
        scoring.check_limit(prompts_ids, field, limit)

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
        parsed = protocol.parse_completion_bytes(await request.body())
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
        if parsed.params.prompt_logprobs is not None:  # echo or prompt_logprobs: scored
            field = "prompt_logprobs" if parsed.prompt_logprobs is not None else "echo"
            self._check_scoring(prompts_ids, field)
        grammar = await self._grammar(parsed)
        # Admission again: the queue may have filled (or a drain begun) while tokenizing.
        keys = self._admit(request, parsed.model, incoming=n)
        self._admit_budget(request)
        await self._admit_limits(request, parsed, prompts_ids)
        batch = self._start(request, parsed, prompts_ids, "completions", keys, grammar)
        want_lp = parsed.params.logprobs is not None
        echo = parsed.echo
        echoed: set[int] = set()  # streamed choices whose prompt part was sent

        def prompt_text(index: int) -> str:
            p = parsed.prompts[index // parsed.n]
            return p if isinstance(p, str) else rt.engine.detokenize(p)

        def logprobs(
            outs: list[RequestOutput], prompt: RequestOutput | None = None
        ) -> dict[str, Any] | None:
            if not want_lp:
                return None
            lps = [lp for o in outs for lp in o.logprobs if lp is not None]
            tokens = [self._token_str(lp.token_id) for lp in lps]
            values: list[float | None] = [lp.logprob for lp in lps]
            tops: list[dict[str, float] | None] = [
                {self._token_str(i): v for i, v in lp.top} for lp in lps
            ]
            if prompt is not None:  # echo: the prompt's tokens first (the first unscored)
                assert parsed.params.logprobs is not None
                p_tokens, p_values, p_tops = scoring.echo_logprobs(
                    prompt, parsed.params.logprobs, self._token_str
                )
                tokens, values, tops = p_tokens + tokens, p_values + values, p_tops + tops
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            return {
                "tokens": tokens,
                "token_logprobs": values,
                "top_logprobs": tops,
                "text_offset": offsets,
            }

        def extra(out: RequestOutput) -> dict[str, Any]:
            if parsed.prompt_logprobs is None:
                return {}
            lps = scoring.vllm_prompt_logprobs(out, parsed.prompt_logprobs, self._token_str)
            return {"prompt_logprobs": lps}

        def final(index: int, outs: list[RequestOutput], last: RequestOutput) -> dict[str, Any]:
            return {
                "text": (prompt_text(index) if echo else "") + last.text,
                "logprobs": logprobs(outs, last if echo else None),
                "finish_reason": last.finish_reason,
                **extra(last),
            }

        def chunk(index: int, out: RequestOutput) -> dict[str, Any] | None:
            first = index not in echoed and (echo or parsed.prompt_logprobs is not None)
            if not first and not out.delta_text and not out.finished and not want_lp:
                return None
            echoed.add(index)
            prefix = prompt_text(index) if first and echo else ""
            return {
                "text": prefix + out.delta_text,
                "logprobs": logprobs([out], out if first and echo else None),
                "finish_reason": out.finish_reason if out.finished else None,
                **(extra(out) if first else {}),
            }

        return await self._respond(parsed, batch, "text_completion", final, chunk)

    # -- /v1/chat/completions -----------------------------------------------------------------
    async def chat_prompt(
        self,
        size: int,
        messages: list[dict[str, Any]],
        tools: ToolRequest | None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """A chat's prompt token ids (off the event loop when the body's `size` is large):
        the tools rendered into the messages (or the template's `tools` variable), then the
        model's chat template. The one path of /v1/chat/completions and POST /tokenize; a 400
        naming `messages` for messages the template cannot render."""
        rt = self.runtime
        # "escape": special-token text typed into a message is plain text, not control tokens.
        escape = rt.cfg.server.chat_special_tokens == "escape"

        def prompt() -> list[int]:  # tools go into the messages here, the template in the runtime
            in_template = has_tools_variable(rt.engine.chat_template)
            rendered, extra = render_messages(messages, tools, in_template)
            return rt.engine.tokenize_chat(
                rendered, add_generation_prompt, escape, continue_final_message, **extra
            )

        try:
            return await self._off_loop(size, prompt)
        except ValueError as exc:
            raise invalid("messages", str(exc)) from None

    async def chat(self, request: Request) -> Response:
        self._check_request_id(request)
        parsed = protocol.parse_chat_bytes(await request.body())
        self._note_ignored(parsed.ignored_fields)
        self._check_n(parsed)
        self._admit(request, parsed.model, incoming=parsed.params.n)
        size = len(await request.body())  # read once, kept by Litestar
        tools = parsed.tools
        prompt_ids = await self.chat_prompt(size, parsed.messages, tools)
        if parsed.prompt_logprobs is not None:
            self._check_scoring([prompt_ids], "prompt_logprobs")
        grammar = await self._grammar(parsed)
        keys = self._admit(request, parsed.model, incoming=parsed.params.n)
        self._admit_budget(request)
        await self._admit_limits(request, parsed, [prompt_ids])
        batch = self._start(request, parsed, [prompt_ids], "chat.completions", keys, grammar)
        calling = tools is not None and tools.choice.mode != "none"
        streams: dict[int, ToolCallStream] = {}

        def logprobs(outs: list[RequestOutput]) -> dict[str, Any] | None:
            if not parsed.logprobs:
                return None

            def entry(token_id: int, value: float) -> dict[str, Any]:
                s = self._token_str(token_id)
                # The token's own bytes: for part of a multi-byte character, not U+FFFD's.
                raw = self.runtime.engine.token_bytes(token_id)
                return {"token": s, "logprob": value, "bytes": list(raw)}

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
            elif reason == "length" and tools is not None and tools.choice.mode in FORCED:
                # A forced call cut by max_tokens: the call so far, as streaming sends it.
                message = cut_tool_message(last.text, tools)
            choice = {"message": message, "logprobs": logprobs(outs), "finish_reason": reason}
            if parsed.prompt_logprobs is not None:  # vLLM's, of the rendered prompt
                choice["prompt_logprobs"] = scoring.vllm_prompt_logprobs(
                    last, parsed.prompt_logprobs, self._token_str
                )
            return choice

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
