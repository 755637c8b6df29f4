"""The dashboard's fleet screen: a Pilot test against real daemons sharing one PostgreSQL
(plus the row a killed daemon leaves behind), and snapshots with deterministic data."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.config import load_config
from controlplane.fleet.registry import Heartbeat, register
from controlplane.store import make_engine
from controlplane.tui.dashboard_app import DashboardApp
from controlplane.tui.fleet import FleetScreen, FleetTable
from harness import InProcessDaemon
from tests.fleet.test_fleet import TOKEN, fleet_config
from tests.tui.support import T0, FakeClient, screen_text, wait_until


def test_fleet_screen_against_real_daemons(tiny_model_dir, tmp_path, pg_url) -> None:
    from controlplane.store import upgrade

    upgrade(pg_url)
    # The row a SIGKILLed daemon leaves: live state, heartbeat long ago.
    db = make_engine(pg_url)
    register(
        db,
        "ghost",
        advertise_url="http://127.0.0.1:9",
        hostname="h",
        pid=1,
        version="0.1.0",
        beat=Heartbeat("serving", model="m", config={"engine.max_num_seqs": 8}),
        now=datetime.now(UTC) - timedelta(minutes=5),
    )
    db.dispose()
    daemons = {}
    for name, seqs in (("alpha", 8), ("beta", 4)):
        path = fleet_config(tmp_path, name, tiny_model_dir, pg_url, max_num_seqs=seqs)
        daemons[name] = InProcessDaemon(load_config(path, env={}), config_path=path).start()
    urls = {n: d.url for n, d in daemons.items()}
    app = DashboardApp(
        urls["alpha"],
        TOKEN,
        fleet=True,
        fleet_interval=0.3,
        events_interval=0.2,
        requests_interval=0.3,
    )

    def rows() -> list[dict[str, Any]]:
        screen = app.screen
        return screen.query_one(FleetTable).rows_data if isinstance(screen, FleetScreen) else []

    async def main() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_until(
                pilot,
                lambda: (
                    {r["id"]: r["state"] for r in rows()}
                    == {"ghost": "unreachable", "alpha": "serving", "beta": "serving"}
                ),
                30,
                "three instances",
            )
            assert rows()[0]["id"] == "ghost"  # worst first
            # The rows are in; the screen shows them at its next refresh.
            text = await wait_until(
                pilot,
                lambda: "unreachable since" in (t := screen_text(app)) and "beta = 4" in t and t,
                10,
                "the rows and the drift on screen",
            )
            assert "2 serving" in text and "1 unreachable" in text
            # alpha and the ghost have 8 sequences, beta 4: beta is the odd one out.
            assert "engine.max_num_seqs: most have 8; beta = 4" in text
            await pilot.press("o")  # sort by instance id
            assert [r["id"] for r in app.screen.query_one(FleetTable)._sorted()] == [
                "alpha",
                "beta",
                "ghost",
            ]
            table = app.screen.query_one(FleetTable)
            table.move_cursor(row=1)  # beta
            await pilot.press("enter")
            await wait_until(
                pilot,
                lambda: (
                    not isinstance(app.screen, FleetScreen)
                    and app.dashboard.stats is not None
                    and app.dashboard.stats.get("max_num_seqs") == 4
                ),
                20,
                "beta's dashboard",
            )
            # The header names the instance followed (host and port; the scheme is left out).
            assert app.dashboard.url == urls["beta"]
            assert urls["beta"].removeprefix("http://") in screen_text(app)
            await pilot.press("escape")
            await wait_until(pilot, lambda: isinstance(app.screen, FleetScreen), 5, "fleet again")
            await wait_until(pilot, lambda: len(rows()) == 3, 10, "the list again")
            # Escape again: home, to the instance the app started on, with its own numbers.
            home = app.home_url
            await pilot.press("escape")
            await wait_until(
                pilot,
                lambda: (
                    not isinstance(app.screen, FleetScreen)
                    and app.dashboard.url == home
                    and app.dashboard.stats is not None
                ),
                20,
                "home again",
            )
            assert app.dashboard.stats.get("max_num_seqs") != 4  # not beta's

    try:
        asyncio.run(main())
    finally:
        for d in daemons.values():
            d.stop()


# -- deterministic snapshots --------------------------------------------------------------------
def fake_fleet() -> dict[str, Any]:
    def m(iid: str, state: str, kv: float | None, tok: float | None, **extra: Any) -> dict:
        return {
            "id": iid,
            "advertise_url": f"http://{iid}.internal:8000",
            "state": state,
            "model": "SmolLM2-135M-Instruct",
            "num_running": None if tok is None else 6,
            "num_waiting": None if tok is None else 2,
            "kv_usage": kv,
            "output_tokens_per_s": tok,
            "ttft_p50_s": None if tok is None else 0.084,
            "heartbeat_age_s": 2.0,
            "unreachable_since": None,
            "ttft_p99_ms": None,
            "oldest_waiting_s": None,
            "slo_met": None,
            **extra,
        }

    return {
        "instances": [
            m(
                "gpu-3",
                "unreachable",
                0.91,
                410.0,
                heartbeat_age_s=95.0,
                unreachable_since="2026-11-25T03:12:05+00:00",
                ttft_p99_ms=2900.0,
                oldest_waiting_s=12.5,
            ),
            # Missing its SLO (marked in its TTFT p99 cell), with a request waiting 38 s.
            m(
                "gpu-2",
                "draining",
                0.12,
                95.5,
                ttft_p99_ms=14_200.0,
                oldest_waiting_s=38.2,
                slo_met=False,
            ),
            m(
                "gpu-0",
                "serving",
                0.81,
                1520.0,
                ttft_p99_ms=310.0,
                oldest_waiting_s=0.4,
                slo_met=True,
            ),
            m("gpu-1", "serving", 0.35, 1310.5, ttft_p99_ms=180.0, slo_met=True),
        ],
        "totals": {
            "instances": 4,
            "serving": 2,
            "unreachable": 1,
            "output_tokens_per_s": 2926.0,
            "requests_per_s": 3.42,
            "gpu_cost_per_hour_usd": 8.0,
            "list_cost_per_hour_usd": 21.37,
        },
        "config_drift": {"engine.max_num_seqs": {"majority": 32, "instances": {"gpu-2": 16}}},
        "self": "gpu-0",
        "unreachable_after_s": 15.0,
    }


class FleetFake(FakeClient):
    def __init__(self, url: str) -> None:
        self.url = url

    async def fleet(self) -> dict[str, Any]:
        return fake_fleet()


def fake_fleet_app() -> DashboardApp:
    return DashboardApp(
        "http://gpu-0.internal:8000", "t", client_for=FleetFake, clock=lambda: T0, fleet=True
    )


async def fleet_loaded(pilot: Any) -> None:
    await wait_until(
        pilot,
        lambda: isinstance(pilot.app.screen, FleetScreen) and pilot.app.screen.polls >= 1,
        10,
        "fleet data",
    )
    await pilot.pause(0.1)


def test_snapshot_fleet_80x24(snap_compare):
    assert snap_compare(fake_fleet_app(), terminal_size=(80, 24), run_before=fleet_loaded)


def test_snapshot_fleet_160x48(snap_compare):
    assert snap_compare(fake_fleet_app(), terminal_size=(160, 48), run_before=fleet_loaded)


def test_enter_opens_the_instance_and_the_list_survives_its_source_going_away():
    """Reading the fleet falls back to the other instances the last list named."""
    asked: list[str] = []

    class Flaky(FleetFake):
        async def fleet(self) -> dict[str, Any]:
            asked.append(self.url)
            if self.url == "http://gpu-0.internal:8000" and len(asked) > 1:
                from controlplane.client.admin import Unreachable

                raise Unreachable("ConnectError")
            return fake_fleet()

    app = DashboardApp(
        "http://gpu-0.internal:8000", "t", client_for=Flaky, clock=lambda: T0, fleet=True,
        fleet_interval=0.05,
    )  # fmt: skip

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: app.screen.polls >= 3, 10, "three polls")
            # After the first answer, gpu-0 is down: the live instances it named answer.
            assert "http://gpu-2.internal:8000" in asked[1:]
            assert "http://gpu-3.internal:8000" not in asked  # unreachable: not asked
            await pilot.press("enter")  # the first row: gpu-3
            await wait_until(pilot, lambda: not isinstance(app.screen, FleetScreen), 5, "dash")
            assert app.dashboard.url == "http://gpu-3.internal:8000"

    asyncio.run(main())
