"""A screen fed by one daemon's admin API: what the dashboard shows, held in reactives, and the
workers that fill them (the SSE stats and config events; the config, its history, the live
requests, the block map and the cost reports polled over REST).

The workers only set reactives; the widgets bound to them (`data_bind`, in dashboard.py)
redraw in their own watchers. Setting `url` follows another daemon: everything the previous
one sent is dropped first, so that no panel ever shows another daemon's numbers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from textual import work
from textual.reactive import var
from textual.screen import Screen

from controlplane.client.admin import APIError, ClientError
from controlplane.tui.history import StatsHistory
from controlplane.tui.tables import ChangesTable


def history_change(entry: dict[str, Any]) -> dict[str, Any]:
    """A GET /admin/config/history entry as a row of the changes table."""
    return {
        "time": entry.get("time"),
        "source": entry.get("source"),
        "actor": entry.get("actor"),
        "field": entry.get("field"),
        "old": entry.get("old_value"),
        "new": entry.get("new_value"),
        "reason": entry.get("reason"),
    }


class DaemonFeedScreen(Screen[None]):
    """`DaemonFeedScreen(url, client_at=...)`: `client_at(url)` gives the admin client for a
    daemon (the app keeps one per URL); `clock` is the wall clock of the cost windows."""

    url: var[str] = var("", init=False)  # the daemon followed
    stats: var[dict[str, Any] | None] = var(None)  # its latest /admin/stats snapshot
    model: var[str] = var("")  # the model it serves
    connected: var[bool] = var(False)
    down_state: var[str] = var("connecting")  # why not connected: unreachable, unauthorized...
    note: var[str] = var("")  # reconnecting in ..., reconnected
    stale_s: var[float | None] = var(None)  # disconnected: the age of the numbers shown
    fields: var[dict[str, Any]] = var(dict)  # GET /admin/config's fields
    changes: var[list[dict[str, Any]]] = var(list)  # config changes, newest first
    live: var[list[dict[str, Any]]] = var(list)  # the live requests
    block_map: var[tuple[list[float], list[float]]] = var(lambda: ([], []))
    costs: var[dict[str, Any] | None] = var(None)  # $ per 1M tokens, the last whole hour
    util: var[dict[str, Any] | None] = var(None)  # utilization over the last hour
    spend: var[dict[str, Any]] = var(dict)  # group_by -> the cost report over spend_window
    spend_window: var[str] = var("")  # the window `spend` was read for (set with it)
    spend_scope: var[str] = var("instance")  # and its scope
    cost_window: var[str] = var("1h")  # the window chosen (the next read is for it)
    cost_scope: var[str] = var("instance")  # instance or fleet, chosen

    def __init__(
        self,
        url: str,
        *,
        client_at: Callable[[str], Any],
        clock: Callable[[], float] = time.time,
        events_interval: float = 0.5,
        requests_interval: float = 1.0,
        reports_interval: float = 30.0,
        reconnect_max_s: float = 5.0,
    ) -> None:
        super().__init__()
        self.set_reactive(DaemonFeedScreen.url, url.rstrip("/"))
        self.client_at = client_at
        self.clock = clock
        self.events_interval = events_interval
        self.requests_interval = requests_interval
        self.reports_interval = reports_interval
        self.reconnect_max_s = reconnect_max_s
        self.history = StatsHistory()  # 15 minutes of snapshots, for the trend lines
        self.stats_received = 0
        self.last_data_at: float | None = None  # monotonic time of the last stats snapshot
        self.reconnects = 0

    @property
    def client(self) -> Any:
        """The admin client of the daemon followed."""
        return self.client_at(self.url)

    def on_mount(self) -> None:
        self.set_interval(1.0, self._update_stale)
        self.follow()

    def follow(self) -> None:
        """Start (or restart) the workers. Each is exclusive in its group: a second call
        replaces the ones that followed the previous daemon."""
        self.stream_events()
        self.poll_requests()
        self.poll_reports()
        self.load_config()

    def watch_url(self) -> None:
        """Another daemon: drop what the previous one sent, then follow this one."""
        self.history.clear()
        self.last_data_at = None  # the other daemon's numbers are not this one's, stale or not
        self.reconnects = 0
        self.connected, self.down_state, self.note = False, "connecting", ""
        self.stats, self.model, self.fields, self.changes = None, "", {}, []
        self.live, self.block_map = [], ([], [])
        self.costs = self.util = None
        self.spend, self.spend_window = {}, ""
        self._update_stale()
        self.follow()

    def watch_connected(self) -> None:
        self._update_stale()

    def _update_stale(self) -> None:
        """Disconnected, the last numbers stay on screen, dimmed, with their age."""
        if self.connected or self.last_data_at is None:
            self.stale_s = None
        else:
            self.stale_s = max(0.0, time.monotonic() - self.last_data_at)

    # -- the event stream ------------------------------------------------------------------
    @work(exclusive=True, group="events")
    async def stream_events(self) -> None:
        """Follow /admin/events forever; reconnect with backoff when it breaks."""
        delay = 0.25
        while True:
            try:
                async for event, data in self.client.events(self.events_interval):
                    if event == "stats":
                        if not self.connected:
                            self.on_reconnected()
                        delay = 0.25
                        self.apply_stats(data)
                    elif event == "config":
                        self.apply_config_event(data)
                reason = "stream ended"
            except APIError as exc:  # e.g. 401: a wrong token; the daemon is up
                reason = f"API error {exc.status}: {exc.message}"
                self.down_state = "unauthorized" if exc.status in (401, 403) else "api error"
            except ClientError as exc:
                reason = str(exc) or "unreachable"
                self.down_state = "unreachable"
            except Exception as exc:  # never crash the dashboard on a bad payload
                reason = f"{type(exc).__name__}: {exc}"
                self.down_state = "unreachable"
            self.reconnects += 1
            self.note = f"reconnecting in {delay:.1f}s ({reason[:70]})"
            self.connected = False
            await asyncio.sleep(delay)
            delay = min(self.reconnect_max_s, delay * 2)

    def on_reconnected(self) -> None:
        was_reconnect = self.reconnects > 0
        self.note = "reconnected" if was_reconnect else ""
        self.connected = True
        if was_reconnect:
            self.history.clear()
            self.load_config()
            self.notify("reconnected to the daemon", timeout=3)

    def apply_stats(self, stats: dict[str, Any]) -> None:
        self.stats_received += 1
        self.last_data_at = time.monotonic()
        self.history.add(stats)  # before `stats`: the bound panels draw their trends from it
        self.model = str(stats.get("model") or "")
        self.stats = stats

    def apply_config_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "autopilot":  # its changes come as config events (with their reasons)
            if self.stats is not None and self.stats.get("autopilot"):
                pilot = {**self.stats["autopilot"], "state": event.get("state")}
                self.stats = {**self.stats, "autopilot": pilot}
            if event.get("state") == "off" and event.get("reason"):
                self.notify(f"autopilot turned itself off: {event['reason']}", severity="warning")
            return
        if kind == "state":
            if self.stats is not None:
                self.stats = {**self.stats, "state": event.get("state")}
            change = {
                "time": event.get("time") or self.clock(),
                "source": event.get("source") or "api",
                "actor": event.get("actor"),
                "field": "state",
                "old": None,
                "new": event.get("state"),
            }
            self.add_changes([change])
            return
        new = [
            {
                "time": event.get("time") or self.clock(),
                "source": event.get("source"),
                "actor": event.get("actor"),
                "field": c.get("field"),
                "old": c.get("old"),
                "new": c.get("new"),
                "reason": c.get("reason"),
            }
            for c in event.get("changes") or []
        ]
        known = [c for c in new if c["field"] in self.fields]
        if known:
            self.fields = {
                **self.fields,
                **{c["field"]: {**self.fields[c["field"]], "value": c["new"]} for c in known},
            }
        self.add_changes(new)

    def add_changes(self, new: list[dict[str, Any]]) -> None:
        if new:
            self.changes = [*reversed(new), *self.changes][: ChangesTable.MAX_ROWS]

    # -- polled --------------------------------------------------------------------------------
    @work(exclusive=True, group="config")
    async def load_config(self) -> None:
        try:
            fields = (await self.client.config()).get("fields") or {}
            entries = (await self.client.history(50)).get("changes") or []
        except ClientError:
            return  # the events worker reports the connection state
        self.fields = fields
        self.changes = [history_change(e) for e in entries]

    @work(exclusive=True, group="requests")
    async def poll_requests(self) -> None:
        while True:
            await self.fetch_requests()
            await asyncio.sleep(self.requests_interval)

    async def fetch_requests(self) -> None:
        try:
            live = (await self.client.requests()).get("live") or []
            used, cached = await self.client.block_map()
        except ClientError:
            return
        self.live = live
        self.block_map = (used, cached)

    @work(exclusive=True, group="reports")
    async def poll_reports(self) -> None:
        while True:
            await self.fetch_reports()
            await asyncio.sleep(self.reports_interval)

    async def fetch_reports(self) -> None:
        # $ per 1M tokens with the GPU's share: the last whole hour, from the hourly rollups
        # (an exact window from the request rows has no GPU cost).
        end = datetime.fromtimestamp(self.clock() // 3600 * 3600, UTC)
        last_hour = ((end - timedelta(hours=1)).isoformat(), end.isoformat())
        try:
            self.costs = await self.client.costs(last_hour[0], until=last_hour[1])
            self.util = await self.client.utilization("1h")
        except ClientError:
            pass
        await self.fetch_costs()

    async def fetch_costs(self) -> None:
        """Spend over the chosen window, grouped three ways; the requests table's grouped view
        shows the same figures per key or user."""
        spend: dict[str, Any] = {}
        try:
            for field in ("api_key", "model", "end_user"):
                spend[field] = await self.client.costs(
                    self.cost_window, group_by=field, scope=self.cost_scope
                )
        except APIError as exc:
            self.notify(f"cost report: {exc.message}", severity="warning", timeout=5)
        except ClientError:
            pass
        if spend:
            self.spend = spend
        # What the figures shown are labelled with: the window and scope they were read for.
        self.spend_window, self.spend_scope = self.cost_window, self.cost_scope

    @work(exclusive=True, group="costs")
    async def refresh_costs(self) -> None:
        await self.fetch_costs()
