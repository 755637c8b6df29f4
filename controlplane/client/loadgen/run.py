"""The run: one request through the openai client (streamed or not, with its timings), the
arrival-driven loop with its concurrency limit and disconnecting clients, and model discovery."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from controlplane.client.loadgen.config import (
    Interrupted,
    LoadConfig,
    LoadError,
    LoadSummary,
    RequestResult,
    RequestSpec,
)
from controlplane.client.loadgen.workload import (
    arrival_offsets,
    error_kind,
    request_specs,
    summarize,
)

# --------------------------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------------------------- #


async def _client(client: Any, model: str, spec: RequestSpec) -> RequestResult:
    """One request as its client behaves: one that hangs up is cancelled after its delay, which
    closes its connection (the daemon sees a disconnect), unless the response came first."""
    if spec.disconnect_after_s is None:
        return await _one_request(client, model, spec, spec.stream)
    task = asyncio.ensure_future(_one_request(client, model, spec, spec.stream))
    done, _ = await asyncio.wait({task}, timeout=spec.disconnect_after_s)
    if done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return RequestResult(index=spec.index, ok=False, max_tokens=spec.max_tokens, disconnected=True)


async def _one_request(client: Any, model: str, spec: RequestSpec, stream: bool) -> RequestResult:
    res = RequestResult(index=spec.index, ok=False, max_tokens=spec.max_tokens)
    t0 = time.perf_counter()
    try:
        if stream:
            usage = None
            chunks = 0
            last = None
            response = await client.completions.create(
                model=model,
                prompt=spec.prompt,
                max_tokens=spec.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            try:
                async for chunk in response:
                    now = time.perf_counter()
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if not chunk.choices:
                        continue
                    choice = chunk.choices[0]
                    if not choice.text and choice.finish_reason is not None:
                        continue  # a finish-only chunk carries no token
                    chunks += 1
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
            finally:
                await response.close()
        else:
            response = await client.completions.create(
                model=model,
                prompt=spec.prompt,
                max_tokens=spec.max_tokens,
                extra_body={"ignore_eos": True},
            )
            usage = response.usage
            chunks = 0
        res.e2e_s = time.perf_counter() - t0
        if usage is not None:
            res.prompt_tokens = usage.prompt_tokens
            res.completion_tokens = usage.completion_tokens
        else:
            res.usage_missing = True
            res.prompt_tokens = len(spec.prompt)
            res.completion_tokens = chunks
        res.ok = True
    except Exception as exc:
        res.error = error_kind(exc)
        res.error_message = f"{type(exc).__name__}: {exc}"
        if exc.__cause__ is not None:
            res.error_message += f" ({type(exc.__cause__).__name__}: {exc.__cause__})"
        res.ttft_s = None
        res.itl_s = []
    return res


async def discover_model(client: Any) -> str:
    try:
        page = await client.models.list()
    except Exception as exc:
        raise LoadError(
            f"cannot list models ({error_kind(exc)}: {exc}); is the daemon up? or pass --model"
        ) from exc
    ids = [m.id for m in page.data]
    if not ids:
        raise LoadError("GET /v1/models returned no model; pass --model")
    return ids[0]


async def run_load(
    config: LoadConfig,
    *,
    stop: asyncio.Event | None = None,
    progress: bool = False,
) -> LoadSummary:
    """Run the load described by `config` and return its summary.

    `stop`: when set, no more requests are sent, the ones in flight are cancelled (counted as
    cancelled) and the partial summary is returned with `interrupted=True`. `progress`: show a
    tqdm bar on stderr. Raises LoadError if no model can be discovered."""
    import openai

    config.validate()
    client = openai.AsyncOpenAI(
        base_url=config.url.rstrip("/") + "/v1",
        api_key=config.api_key or "none",
        max_retries=0,
        timeout=config.timeout_s,
    )
    try:
        model = config.model or await _unless_stopped(discover_model(client), stop)
        return await _drive(client, model, config, stop, progress)
    finally:
        await client.close()


async def _unless_stopped(coro: Any, stop: asyncio.Event | None) -> Any:
    if stop is None:
        return await coro
    task = asyncio.ensure_future(coro)
    waiter = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Interrupted("interrupted before the first request")
    return task.result()


async def _drive(
    client: Any, model: str, config: LoadConfig, stop: asyncio.Event | None, progress: bool
) -> LoadSummary:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.num_requests, unit="req", file=sys.stderr, dynamic_ncols=True)
    results: list[RequestResult] = []
    failed = 0
    sem = asyncio.Semaphore(config.concurrency_limit) if config.concurrency_limit else None
    inflight: set[asyncio.Task[None]] = set()
    sent = 0

    async def send(spec: RequestSpec) -> None:
        nonlocal failed
        try:
            res = await _client(client, model, spec)
            results.append(res)
            if bar is not None:
                failed += not (res.ok or res.disconnected)
                if failed:
                    bar.set_postfix(failed=failed, refresh=False)
                bar.update(1)
        finally:
            if sem is not None:
                sem.release()

    async def dispatch() -> None:
        nonlocal sent
        specs = iter(request_specs(config))
        offsets = arrival_offsets(
            config.rate, config.seed, count=config.num_requests, duration_s=config.duration_s
        )
        for offset in offsets:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
                # closed loop (--duration with --rate inf): stop at the deadline
                if config.duration_s is not None and time.perf_counter() - start >= (
                    config.duration_s
                ):
                    sem.release()
                    break
            task = asyncio.create_task(send(next(specs)))
            sent += 1
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        while inflight:
            await asyncio.gather(*list(inflight))

    start = time.perf_counter()
    interrupted = False
    dispatcher = asyncio.create_task(dispatch())
    try:
        if stop is None:
            await dispatcher
        else:
            waiter = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({dispatcher, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if dispatcher.done():
                dispatcher.result()  # re-raise a failure of the dispatcher itself
            else:
                interrupted = True
    finally:
        if not dispatcher.done():
            dispatcher.cancel()
        for task in list(inflight):
            task.cancel()
        pending = [dispatcher, *inflight]
        await asyncio.gather(*pending, return_exceptions=True)
        if bar is not None:
            bar.close()
    return summarize(
        results,
        wall_s=max(time.perf_counter() - start, 1e-9),
        url=config.url,
        model=model,
        stream=config.stream,
        rate=config.rate,
        requests_sent=sent,
        interrupted=interrupted,
    )
