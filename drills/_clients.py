"""Streaming clients that tag every request with an X-Request-Id, so a drill can hold each one it
saw admitted against the request rows afterwards."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import httpx


@dataclass
class Tally:
    admitted: set[str] = field(default_factory=set)  # got a 200: the daemon took it
    completed: set[str] = field(default_factory=set)  # read to [DONE]
    rejected: dict[int, int] = field(default_factory=dict)  # status -> count
    broken: int = 0  # connection failed or cut (a killed daemon, a restart)


async def stream_clients(
    url: str,
    tag: str,
    stop: asyncio.Event,
    concurrency: int = 32,
    max_tokens: tuple[int, int] = (8, 64),
    seed: int = 0,
) -> Tally:
    """`concurrency` clients sending streaming completions one after another until `stop`."""
    tally = Tally()
    rng = random.Random(seed)
    counter = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal counter
        while not stop.is_set():
            counter += 1
            rid = f"{tag}-{counter}"
            body = {
                "model": "tiny",
                "prompt": [rng.randrange(10, 1000) for _ in range(rng.randint(8, 48))],
                "max_tokens": rng.randint(*max_tokens),
                "stream": True,
                "ignore_eos": True,
            }
            try:
                async with http.stream(
                    "POST", "/v1/completions", json=body, headers={"X-Request-Id": rid}
                ) as r:
                    if r.status_code != 200:
                        tally.rejected[r.status_code] = tally.rejected.get(r.status_code, 0) + 1
                        await asyncio.sleep(0.05)
                        continue
                    tally.admitted.add(rid)
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            tally.completed.add(rid)
            except (httpx.HTTPError, OSError):
                tally.broken += 1
                await asyncio.sleep(0.1)

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return tally
