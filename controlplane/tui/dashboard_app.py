"""The `controlplane tui` application: the dashboard screen of one daemon (dashboard.py), the
fleet screen (fleet.py), and an admin client per daemon URL; the admin API only (SSE for the
stats, REST for the rest)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, ClassVar

from textual.app import App
from textual.binding import Binding

from controlplane.client.admin import AdminClient
from controlplane.tui.dashboard import DashboardScreen
from controlplane.tui.fleet import FleetScreen


class DashboardApp(App[None]):
    """`DashboardApp(url, token)`: pass `client_for=` (url -> an object with `AdminClient`'s
    async methods; `client=` for the first URL only) and `clock=` to feed it deterministic data
    in tests. `fleet=True` opens on the fleet screen. `dashboard` is the dashboard screen (the
    one at the bottom of the stack), whose reactives hold what it shows."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "controlplane"
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (140, "-wide")]
    # The dashboard's own keys are its screen's; these hold on every screen.
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("l", "toggle_theme", "Theme", show=False, tooltip="switch light / dark theme"),
    ]

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        client: Any = None,
        client_for: Callable[[str], Any] | None = None,
        clock: Callable[[], float] | None = None,
        fleet: bool = False,
        fleet_interval: float = 2.0,
        events_interval: float = 0.5,
        requests_interval: float = 1.0,
        reports_interval: float = 30.0,
        reconnect_max_s: float = 5.0,
    ) -> None:
        super().__init__()
        self.home_url = url.rstrip("/")
        self._client_for = client_for or (lambda u: AdminClient(u, token))
        # One client per instance URL, kept while the app runs (switching back is instant).
        self._clients: dict[str, Any] = {self.home_url: client} if client is not None else {}
        self.fleet_mode = fleet  # escape on the dashboard goes to the fleet screen
        self.fleet_interval = fleet_interval
        self.last_fleet: dict[str, Any] | None = None
        self.dashboard = DashboardScreen(
            self.home_url,
            client_at=self.client_at,
            clock=clock or time.time,
            events_interval=events_interval,
            requests_interval=requests_interval,
            reports_interval=reports_interval,
            reconnect_max_s=reconnect_max_s,
        )
        self.theme = "textual-dark"

    def get_default_screen(self) -> DashboardScreen:
        return self.dashboard

    def on_mount(self) -> None:
        if self.fleet_mode:
            self.action_fleet()

    async def on_unmount(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))

    def on_resize(self) -> None:
        # The dashboard's layout follows the width even under a modal (the tuning form is
        # docked beside it), where its screen gets no resize event of its own.
        self.dashboard.fit_width(self.size.width)

    def client_at(self, url: str) -> Any:
        url = url.rstrip("/")
        if url not in self._clients:
            self._clients[url] = self._client_for(url)
        return self._clients[url]

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.theme == "textual-dark" else "textual-dark"

    # -- the fleet ---------------------------------------------------------------------------
    def fleet_clients(self) -> list[Any]:
        """Where to read the fleet from: the instance the app started on, then the others the
        last list named, live ones first."""
        urls = [self.home_url, self.dashboard.url]
        for m in (self.last_fleet or {}).get("instances") or []:
            if m.get("state") in ("serving", "draining", "loading"):
                urls.append(str(m.get("advertise_url")).rstrip("/"))
        return [self.client_at(u) for u in dict.fromkeys(urls)]

    def action_fleet(self) -> None:
        self.fleet_mode = True
        if not isinstance(self.screen, FleetScreen):
            self.push_screen(FleetScreen(self.fleet_interval))

    def action_back_to_fleet(self) -> None:
        if self.fleet_mode:
            self.action_fleet()

    def open_instance(self, url: str) -> None:
        """Show `url`'s dashboard: leave the fleet screen and follow that daemon instead (the
        dashboard drops the previous daemon's numbers when its `url` changes)."""
        if isinstance(self.screen, FleetScreen):
            self.pop_screen()
        self.dashboard.url = url.rstrip("/")
