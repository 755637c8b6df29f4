"""The daemon's event stream (/admin/events): state changes, config changes, autopilot
decisions, cache resets, fanned out to every subscriber."""

from __future__ import annotations

import asyncio
from typing import Any

QUEUE_LEN = 64  # events a subscriber may fall behind before it loses its oldest


class Events:
    def __init__(self) -> None:
        self._queues: set[asyncio.Queue] = set()

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_LEN)
        self._queues.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._queues.discard(queue)

    def broadcast(self, event: dict[str, Any]) -> None:
        for queue in self._queues:
            if queue.full():  # a slow client loses its oldest event, never slows anyone
                queue.get_nowait()
            queue.put_nowait(event)
