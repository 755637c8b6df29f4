"""A replay against a running daemon (`controlplane replay --url`): the workload's requests as
streamed `/v1/completions` calls at the recorded arrival times, timed by the client, so that the
HTTP front, the daemon's own config (live values included) and its host are part of what is
measured. The daemon records the replayed requests like any others (their rows carry the
replaying key, if one is given).

Client-side figures differ from the engine's in what they include: TTFT runs from the send to
the first streamed token (the HTTP round trip and admission included), the mean ITL from the
first to the last token; the queue wait is not visible to a client (–). With an admin token,
the daemon's `/admin/stats` is read before and after (preemptions) and during the run (the peak
KV use).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx

from controlplane.engine.types import RequestMetrics
from controlplane.planning.replay import ReplayRun, Served
from controlplane.planning.window import PlanningError
from controlplane.planning.workload import ReplayRequest, Workload

_STATS_EVERY_S = 0.25


async def served_model(client: httpx.AsyncClient) -> str:
    try:
        r = await client.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise PlanningError(f"{client.base_url}: no served model ({exc!r})") from None


async def replay_url(
    workload: Workload,
    url: str,
    label: str,
    speed: float = 1.0,
    api_key: str | None = None,
    admin_token: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayRun:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with (
        httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client,
        httpx.AsyncClient(base_url=url, timeout=10.0) as admin,
    ):
        model = await served_model(client)
        admin.headers["Authorization"] = f"Bearer {admin_token}" if admin_token else ""
        before = await _stats(admin) if admin_token else None
        served: list[Served] = []
        peak = [0.0]
        done = asyncio.Event()

        async def watch() -> None:
            while admin_token and not done.is_set():
                stats = await _stats(admin)
                if stats and stats.get("kv_usage_perc") is not None:
                    peak[0] = max(peak[0], float(stats["kv_usage_perc"]) / 100)
                await asyncio.sleep(_STATS_EVERY_S)

        async def one(req: ReplayRequest, at: float) -> None:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            served.append(await _call(client, model, req))
            if progress is not None:
                progress(len(served), len(workload.requests))

        watcher = asyncio.create_task(watch())
        t0 = time.monotonic()
        try:
            await asyncio.gather(
                *(
                    one(r, t0 + r.offset_s / speed if speed != float("inf") else t0)
                    for r in workload.requests
                )
            )
        finally:
            done.set()
            await watcher
        wall = time.monotonic() - t0
        after = await _stats(admin) if admin_token else None
    preemptions = 0
    if before and after:
        preemptions = int(after.get("num_preemptions", 0)) - int(before.get("num_preemptions", 0))
    served.sort(key=lambda s: s.request.offset_s)
    return ReplayRun(
        label=label,
        settings=None,  # the daemon's own, not known here
        speed=speed,
        served=served,
        wall_s=wall,
        peak_kv_usage=peak[0],
        preemptions=preemptions,
        notes=[] if admin_token else ["no admin token: peak KV use and preemptions not read"],
    )


async def _stats(admin: httpx.AsyncClient) -> dict | None:
    try:
        r = await admin.get("/admin/stats")
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _call(client: httpx.AsyncClient, model: str, req: ReplayRequest) -> Served:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "n": req.n,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.time()
    m = RequestMetrics(sent, num_prompt_tokens=len(req.prompt))
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                return Served(req, ok=False, error=f"HTTP {r.status_code}: {text}", metrics=m)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Served(req, ok=False, error=str(chunk["error"]), metrics=m)
                usage = chunk.get("usage")
                if usage:  # the last chunk: the daemon's own counts
                    details = usage.get("prompt_tokens_details") or {}
                    m.num_cached_tokens = details.get("cached_tokens") or 0
                    tokens = usage.get("completion_tokens", tokens)
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.time()
                    m.first_token_time = m.first_token_time or now
                    m.finish_time = now
                    tokens += sum(1 for c in chunk["choices"] if c.get("text"))
    except httpx.HTTPError as exc:
        return Served(req, ok=False, error=repr(exc), metrics=m)
    m.num_output_tokens = tokens
    return Served(
        req,
        ok=tokens > 0,
        error=None if tokens else "no token",
        metrics=m,
        completion_tokens=tokens,
    )
