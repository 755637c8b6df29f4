"""POST /admin/simulate (controlplane/planning/whatif.py): a change of the live knobs simulated on
the traffic a real daemon has just served, on a cost model fit from its own recent steps, with
nothing applied; refusals that name the field, and a clear answer before there is anything to
simulate."""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from controlplane.engine.types import StepStats
from controlplane.planning.whatif import samples_of
from controlplane.planning.window import PlanningError
from controlplane.tui.dashboard_app import DashboardApp
from controlplane.tui.tune import TuneScreen
from harness import InProcessDaemon, wait_rows
from harness.config import ADMIN_TOKEN
from tests.planning.test_replay import _insert, _row
from tests.tui.test_tui import wait_until

REQUESTS = 8


def _step(n: int, end: float, duration: float, prefill: int = 0, decode: int = 1) -> StepStats:
    return StepStats(n, end, 1, 0, 0, 1, 10, prefill, decode, decode, duration, 0, 0, 40)


def test_samples_are_the_working_steps_priced_with_the_loops_median_overhead() -> None:
    steps = [
        _step(1, 10.000, 0.010),
        _step(2, 10.012, 0.010),  # 2 ms around the step
        _step(3, 10.023, 0.010),  # 1 ms
        _step(4, 10.036, 0.010),  # 3 ms
        _step(5, 12.000, 0.010),  # after an idle gap: its gap says nothing of the loop
        _step(6, 12.001, 0.001, decode=0),  # no work: no sample
        _step(8, 12.040, 0.020, prefill=32, decode=0),  # step 7 unseen: no gap
    ]
    got = samples_of(steps)
    assert [(s.prefill_tokens, s.decode_rows, s.context_tokens) for s in got] == [
        (0, 1, 40)
    ] * 5 + [(32, 0, 40)]
    # Each step's own time plus the median gap (2 ms) of the back-to-back pairs (2, 3, 4).
    assert [s.seconds for s in got] == pytest.approx([0.012] * 5 + [0.022])


@pytest.fixture(scope="module")
def daemon(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(admin=True, engine={"max_num_seqs": 8, "compile": "off"})


def _simulate(c: httpx.Client, body: dict, **params: object) -> httpx.Response:
    return c.post("/admin/simulate", json=body, params=params, timeout=60)


def test_before_any_traffic_it_says_what_is_missing(daemon: InProcessDaemon) -> None:
    with daemon.client(ADMIN_TOKEN) as c:
        r = _simulate(c, {"engine": {"max_num_seqs": 2}})
    assert r.status_code == 409, r.text
    assert "serve some traffic first" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def served(daemon: InProcessDaemon) -> InProcessDaemon:
    """The daemon once it has served REQUESTS concurrent requests, their rows final."""
    with daemon.client() as c:

        def one(i: int) -> None:
            body = {"model": "model", "prompt": [5 + i, 6, 7, 8] * (4 + i), "max_tokens": 48,
                    "ignore_eos": True, "temperature": 0}  # fmt: skip
            r = c.post("/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text

        with ThreadPoolExecutor(REQUESTS) as pool:
            list(pool.map(one, range(REQUESTS)))
    wait_rows(
        daemon.cfg.store_url,
        lambda rows: len(rows) >= REQUESTS and all(r["status"] != "running" for r in rows),
    )
    return daemon


def test_a_change_is_simulated_on_the_served_traffic_and_not_applied(
    served: InProcessDaemon,
) -> None:
    with served.client(ADMIN_TOKEN) as c:
        r = _simulate(c, {"engine": {"max_num_seqs": 1}, "server": {"max_queue_len": 50}})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["window"]["requests"] == REQUESTS
        assert got["cost_model"]["samples"] >= 32
        assert [(c["field"], c["new"]) for c in got["changed"]] == [
            ("engine.max_num_seqs", 1),
            ("server.max_queue_len", 50),
        ]
        assert got["not_simulated"] == ["server.max_queue_len"]
        now, proposed, recorded = got["now"], got["proposed"], got["recorded"]
        assert now["requests"] == proposed["requests"] == recorded["requests"] == REQUESTS
        assert now["completion_tokens"] == proposed["completion_tokens"] == 48 * REQUESTS
        # One sequence at a time: the last of eight waits for seven whole generations.
        assert proposed["ttft_p99_ms"] > 3 * now["ttft_p99_ms"]
        # Nothing applied.
        assert c.get("/admin/config").json()["fields"]["engine.max_num_seqs"]["value"] == 8

        # The same traffic, the settings in force: the two simulated columns agree.
        same = _simulate(c, {}).json()
        assert same["proposed"]["ttft_p99_ms"] == pytest.approx(same["now"]["ttft_p99_ms"])
        assert same["changed"] == [] and same["not_simulated"] == []


@pytest.mark.parametrize(
    ("body", "params", "status", "names"),
    [
        ({"engine": {"max_num_seqs": 0}}, {}, 422, "engine.max_num_seqs"),
        ({"engine": {"no_such_knob": 1}}, {}, 422, "engine.no_such_knob"),
        ({"engine": {"dtype": "float16"}}, {}, 409, "engine.dtype"),
        ({}, {"window_s": 5}, 422, "window_s"),
        ({}, {"window_s": "nan"}, 422, "window_s"),
        ({}, {"window_s": "-inf"}, 422, "window_s"),
        ({"engine": {"max_num_seqs": 10**40}}, {}, 422, "engine.max_num_seqs"),
        ([1, 2], {}, 400, "body"),
    ],
)
def test_refusals_name_the_field(
    daemon: InProcessDaemon, body: object, params: dict, status: int, names: str
) -> None:
    with daemon.client(ADMIN_TOKEN) as c:
        r = c.post("/admin/simulate", json=body, params=params, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert names in (error.get("param") or "") + error["message"]


def test_the_tuning_form_shows_the_simulators_prediction(served: InProcessDaemon) -> None:
    """Typing a value in the TUI's tuning form asks the simulator once typing pauses: the
    prediction for the whole change sits below the preview, before anything is applied."""

    async def main() -> None:
        app = DashboardApp(served.url, ADMIN_TOKEN)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_until(pilot, lambda: app.dashboard.fields, 5, "config loaded")
            await pilot.press("t")
            form = await wait_until(
                pilot, lambda: isinstance(app.screen, TuneScreen) and app.screen
            )
            sim = form.query_one("#tune-sim")
            form.query_one("#in-max_num_seqs").value = "1"
            await wait_until(pilot, lambda: "->" in str(sim.render()), 30, "prediction shown")
            text = str(sim.render())
            assert f"simulated on the last 15 min ({REQUESTS} requests" in text, text
            ttft = re.search(r"TTFT p99 ([\d,]+) ms -> ([\d,]+) ms", text)
            assert ttft is not None, text
            before, after = (float(g.replace(",", "")) for g in ttft.groups())
            assert after > 3 * before, text
            assert "not simulated" not in text
            # Back to the value in force: nothing to simulate, the line clears.
            form.query_one("#in-max_num_seqs").value = "8"
            await wait_until(pilot, lambda: str(sim.render()) == "", 10, "prediction cleared")
        with served.client(ADMIN_TOKEN) as c:
            assert c.get("/admin/config").json()["fields"]["engine.max_num_seqs"]["value"] == 8

    asyncio.run(main())


def test_a_busy_window_keeps_its_newest_rows(db_url: str) -> None:
    """`read_window(newest=True)`: over `max_rows`, the window starts at the newest rows'
    first arrival rather than refusing (what a live what-if reads)."""
    from controlplane.planning.window import read_window
    from controlplane.store import make_engine, upgrade

    upgrade(db_url)
    t0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    _insert(db_url, [_row(i, t0 + timedelta(seconds=i)) for i in range(10)])
    db = make_engine(db_url)
    try:
        until = t0 + timedelta(minutes=1)
        with pytest.raises(PlanningError, match="more than --max-rows"):
            read_window(db, t0, until, max_rows=4)
        w = read_window(db, t0, until, max_rows=4, newest=True)
    finally:
        db.dispose()
    assert [r.id for r in w.rows] == ["r6", "r7", "r8", "r9"]
    assert w.since == t0 + timedelta(seconds=6)
