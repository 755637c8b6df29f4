"""/admin/events: Server-Sent Events, a stats snapshot every period and each config change
as it happens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.response import ServerSentEvent, ServerSentEventMessage

from controlplane.admin.support import unprocessable

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime

KEEPALIVE_S = 15.0


class EventsController(Controller):
    path = "/events"

    @get("/", summary="Server-Sent Events: stats snapshots and config changes")
    async def events(
        self, runtime: NamedDependency[Runtime], interval: FromQuery[float | None] = None
    ) -> ServerSentEvent:
        period = runtime.cfg.server.events_interval_s if interval is None else interval
        if not 0.1 <= period <= 60:
            raise unprocessable("interval", f"must be in [0.1, 60] seconds, got {period}")
        return ServerSentEvent(_event_stream(runtime, period))


class _EncodedMessage(ServerSentEventMessage):
    """A message encoded once: the same stats snapshot goes to every subscriber."""

    def __init__(self, data: str, event: str) -> None:
        super().__init__(data=data, event=event)
        self._encoded = super().encode()

    def encode(self) -> bytes:
        return self._encoded


_last_stats: tuple[str, _EncodedMessage] | None = None


def _stats_message(runtime: Runtime) -> _EncodedMessage:
    """The current snapshot (runtime.stats_json: computed at most every 0.1 s), framed once
    for all subscribers: 500 open streams must not cost serving more than a few percent."""
    global _last_stats
    data = runtime.stats_json()
    if _last_stats is None or _last_stats[0] is not data:
        _last_stats = (data, _EncodedMessage(data, "stats"))
    return _last_stats[1]


async def _event_stream(runtime: Runtime, period: float) -> AsyncIterator[ServerSentEventMessage]:
    """Snapshots are taken when sent (shared by all subscribers, at most 0.1 s old), so a slow
    client gets fewer, never a backlog; config events wait in a small per-client queue that
    drops the oldest when full."""
    queue = runtime.events.subscribe()
    loop = asyncio.get_running_loop()
    last_ping = loop.time()
    try:
        while True:
            yield _stats_message(runtime)
            deadline = loop.time() + period
            while (left := deadline - loop.time()) > 0:
                try:  # asyncio.timeout, not wait_for: no task per wait, for 500 subscribers
                    async with asyncio.timeout(left):
                        event = await queue.get()
                except TimeoutError:
                    break
                yield ServerSentEventMessage(data=json.dumps(event), event="config")
                if event.get("type") == "state" and event.get("state") == "stopping":
                    return  # the daemon is shutting down: end the stream cleanly
            if loop.time() - last_ping >= KEEPALIVE_S:
                last_ping = loop.time()
                yield ServerSentEventMessage(comment="keep-alive")
    finally:
        runtime.events.unsubscribe(queue)
