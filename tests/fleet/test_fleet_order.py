"""The fleet's "worst first" order (controlplane.fleet.order): unreachable, then missing the
SLO, then waiting requests and the oldest waiting age, then draining / loading / serving, then
KV use; on the members the registry reads from SQL, and on the dashboard's fleet screen (which
marks the instance it is on)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine

from controlplane.fleet.order import WORST_FIRST, slo_missed, worst_first_key
from controlplane.fleet.registry import Heartbeat, heartbeat, members, register
from controlplane.tui.fleet import FLEET_KEYS, HERE, SLO_MISSED, FleetScreen, FleetTable
from tests.tui.test_tui import wait_until
from tests.tui.test_tui_fleet import fake_fleet_app


def inst(iid: str, state: str = "serving", **figures: Any) -> dict[str, Any]:
    return {"id": iid, "state": state, **figures}


def order(*found: dict[str, Any]) -> list[str]:
    return [m["id"] for m in sorted(found, key=worst_first_key)]


def test_a_long_queue_with_a_slow_ttft_ranks_above_a_fuller_kv_cache() -> None:
    queued = inst("queued", num_waiting=146, ttft_p99_ms=140_000.0, kv_usage=0.40)
    full = inst("full", num_waiting=12, kv_usage=0.97)
    assert order(full, queued) == ["queued", "full"]
    # The same with the figures an older heartbeat lacks (no TTFT, no SLO flag): the queue.
    assert order(full, inst("queued", num_waiting=146, kv_usage=0.4)) == ["queued", "full"]
    # And with the SLO flag: missing it outranks any queue.
    missing = inst("missing", slo_met=False, num_waiting=0, kv_usage=0.1)
    assert order(full, queued, missing) == ["missing", "queued", "full"]


def test_the_whole_order() -> None:
    found = [
        inst("stopped", "stopped", num_waiting=500, slo_met=False),
        inst("idle", kv_usage=0.2),
        inst("fuller", kv_usage=0.9),
        inst("draining", "draining", kv_usage=0.1),
        inst("loading", "loading"),
        inst("old-wait", num_waiting=3, oldest_waiting_s=40.0),
        inst("new-wait", num_waiting=3, oldest_waiting_s=2.0),
        inst("long-queue", num_waiting=50, kv_usage=0.5),
        # SLO missed by the target in its own live settings (no flag sent).
        inst("over-target", ttft_p99_ms=900.0, config={"autopilot.ttft_p99_ms": 500.0}),
        inst("under-target", ttft_p99_ms=400.0, config={"autopilot.ttft_p99_ms": 500.0}),
        inst("no-target", ttft_p99_ms=9000.0, config={"autopilot.ttft_p99_ms": 0.0}),
        inst("gone", "unreachable", kv_usage=0.0),
        inst("b-gone", "unreachable", num_waiting=1),
    ]
    assert order(*found) == [
        "b-gone",  # unreachable first (then the same order among them)
        "gone",
        "over-target",  # missing the SLO
        "long-queue",  # most waiting
        "old-wait",  # same queue, older oldest waiting request
        "new-wait",
        "draining",  # nothing waiting: draining, loading, then serving by KV use
        "loading",
        "fuller",
        "idle",
        "no-target",  # no target: cannot miss it; an idle serving instance, id order
        "under-target",
        "stopped",  # last, whatever its figures
    ]
    assert [slo_missed(m) for m in found[8:11]] == [True, False, None]
    # The flag, when sent, is what counts; figures in a "stats" mapping are read too.
    assert slo_missed({"slo_met": True, "ttft_p99_ms": 1e9, "config": {"autopilot.ttft_p99_ms": 1}}) is False  # fmt: skip
    assert order(inst("a"), inst("b", stats={"num_waiting": 2})) == ["b", "a"]
    # Junk in a row (a hand-written or newer one) never breaks the sort.
    assert order(inst("x", num_waiting="many", kv_usage=float("nan")), inst("w")) == ["w", "x"]
    assert "unreachable; then missing its SLO; then most waiting" in WORST_FIRST


T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)


def test_members_come_worst_first_from_sql(db_engine: Engine) -> None:
    def reg(iid: str, beat: Heartbeat, at: datetime = T0) -> None:
        register(db_engine, iid, advertise_url=f"http://{iid}:8000", hostname=iid, pid=7,
                 version="0.1.0", beat=beat, now=at)  # fmt: skip

    reg("full-kv", Heartbeat("serving", num_running=8, num_waiting=12, kv_usage=0.97))
    reg("queued", Heartbeat("serving", num_running=8, num_waiting=146, kv_usage=0.40))
    reg("draining", Heartbeat("draining", num_running=1, num_waiting=0, kv_usage=0.99))
    reg("silent", Heartbeat("serving", num_waiting=0), at=T0 - timedelta(minutes=5))
    got = members(db_engine, now=T0 + timedelta(seconds=1), unreachable_after_s=15)
    assert [m.id for m in got] == ["silent", "queued", "full-kv", "draining"]
    assert got == sorted(got, key=worst_first_key)  # the Member objects, not only dicts


def test_fleet_screen_marks_the_instance_the_dashboard_is_on() -> None:
    app = fake_fleet_app()  # on http://gpu-0.internal:8000

    def first_cells() -> dict[str, str]:
        table = app.screen.query_one(FleetTable)
        return {str(row.value): str(table.get_cell(row, "id")) for row in list(table.rows)}

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(
                pilot,
                lambda: isinstance(app.screen, FleetScreen) and app.screen.polls >= 1,
                10,
                "fleet data",
            )
            cells = first_cells()
            assert cells["gpu-0"] == HERE + "gpu-0"
            assert [c for c in cells.values() if c.startswith(HERE)] == [HERE + "gpu-0"]
            # Worst first, as the order says: unreachable, then the one missing its SLO (its
            # TTFT p99 cell marked, in red), then the older oldest wait (same queue).
            assert list(cells) == ["gpu-3", "gpu-2", "gpu-0", "gpu-1"]
            table = app.screen.query_one(FleetTable)
            p99 = {str(r.value): table.get_cell(r, "ttft_p99_ms") for r in list(table.rows)}
            assert str(p99["gpu-2"]) == SLO_MISSED + "14.2 s"
            assert p99["gpu-2"].style == "bold red"
            assert [k for k, c in p99.items() if str(c).startswith(SLO_MISSED)] == ["gpu-2"]
            assert str(p99["gpu-0"]) == "310 ms"
            waits = {str(r.value): str(table.get_cell(r, "oldest_waiting_s")) for r in list(table.rows)}  # fmt: skip
            assert waits == {"gpu-3": "12 s", "gpu-2": "38 s", "gpu-0": "0.4 s", "gpu-1": "–"}

    asyncio.run(main())
    assert ("worst", WORST_FIRST) in FLEET_KEYS


# -- the incident figures in the fleet table ---------------------------------------------------
def test_heartbeats_carry_the_incident_figures_and_clear_them(db_engine: Engine) -> None:
    """oldest_waiting_s, ttft_p99_ms and slo_met go into the row, out on Member and its dict
    (GET /admin/fleet), and the order reads them from SQL; a beat with nothing waiting clears
    the last oldest wait (None there is a reading, not "unknown")."""

    def reg(iid: str, beat: Heartbeat) -> None:
        register(db_engine, iid, advertise_url=f"http://{iid}:8000", hostname=iid, pid=7,
                 version="0.1.0", beat=beat, now=T0)  # fmt: skip

    reg("a-queued", Heartbeat("serving", num_waiting=9, oldest_waiting_s=4.5, kv_usage=0.9))
    reg("b-old-wait", Heartbeat("serving", num_waiting=9, oldest_waiting_s=61.0))
    reg("c-missing", Heartbeat("serving", num_waiting=0, ttft_p99_ms=4200.0, slo_met=False))
    now = T0 + timedelta(seconds=1)
    got = members(db_engine, now=now, unreachable_after_s=15)
    assert [m.id for m in got] == ["c-missing", "b-old-wait", "a-queued"]
    missing = got[0].to_dict()
    assert (missing["slo_met"], missing["ttft_p99_ms"], missing["oldest_waiting_s"]) == (
        False,
        4200.0,
        None,
    )
    assert got[1].oldest_waiting_s == 61.0 and got[1].slo_met is None
    # The SLO met again, the queue empty: every beat writes these, None included.
    assert heartbeat(db_engine, "c-missing", Heartbeat("serving", num_waiting=0, ttft_p99_ms=90.0,
                     slo_met=True), now=now)  # fmt: skip
    assert heartbeat(db_engine, "b-old-wait", Heartbeat("serving", num_waiting=0), now=now)
    got = {m.id: m for m in members(db_engine, now=now, unreachable_after_s=15)}
    assert got["c-missing"].slo_met is True and got["c-missing"].ttft_p99_ms == 90.0
    assert (got["b-old-wait"].num_waiting, got["b-old-wait"].oldest_waiting_s) == (0, None)
    assert members(db_engine, now=now, unreachable_after_s=15)[0].id == "a-queued"


MIGRATION = "0011"  # instances.oldest_waiting_s, ttft_p99_ms, slo_met


def test_migration_adds_the_incident_columns_from_the_previous_head(db_url: str) -> None:
    """From the revision before it, with a row an older daemon wrote: the row reads None for the
    new figures (and sorts as met / nothing waiting), new heartbeats write them, and the
    downgrade drops them again."""
    from alembic.script import ScriptDirectory
    from sqlalchemy import inspect, text

    from controlplane.store import make_engine
    from controlplane.store.migrate import alembic_config, check, current, downgrade, upgrade

    previous = ScriptDirectory.from_config(alembic_config()).get_revision(MIGRATION).down_revision
    assert isinstance(previous, str)
    upgrade(db_url, previous)
    eng = make_engine(db_url)
    try:
        with eng.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO instances (id, advertise_url, hostname, pid, version, state, "
                    "started_at, heartbeat_at, num_waiting, kv_usage) VALUES ('old', "
                    "'http://old:8000', 'h', 1, '0.1.0', 'serving', :t, :t, 3, 0.5)"
                ),
                {"t": T0},
            )
        upgrade(db_url, MIGRATION)
        assert current(db_url) == MIGRATION
        upgrade(db_url, "head")
        check(db_url)  # the models describe the migrated schema
        (old,) = members(eng, now=T0, unreachable_after_s=15)
        assert (old.oldest_waiting_s, old.ttft_p99_ms, old.slo_met) == (None, None, None)
        assert slo_missed(old) is None
        register(eng, "new", advertise_url="http://new:8000", hostname="h", pid=2,
                 version="0.2.0", now=T0, beat=Heartbeat("serving", num_waiting=3,
                 oldest_waiting_s=2.5, ttft_p99_ms=900.0, slo_met=False))  # fmt: skip
        got = members(eng, now=T0, unreachable_after_s=15)
        assert [m.id for m in got] == ["new", "old"]
        assert (got[0].oldest_waiting_s, got[0].ttft_p99_ms, got[0].slo_met) == (2.5, 900.0, False)
        downgrade(db_url, previous)
        columns = {c["name"] for c in inspect(eng).get_columns("instances")}
        assert not {"oldest_waiting_s", "ttft_p99_ms", "slo_met"} & columns
        assert {"num_waiting", "config"} <= columns
        upgrade(db_url, "head")
        check(db_url)
    finally:
        eng.dispose()


def test_two_daemons_the_overloaded_one_first_with_its_incident_figures(
    tiny_model_dir, tmp_path, make_daemon
) -> None:
    """Two real daemons on one SQLite file: one flooded (one sequence at a time, a dozen long
    requests, an SLO target no request meets), one idle. GET /admin/fleet lists the flooded one
    first with its oldest wait and its /admin/stats SLO verdict; once its queue is empty it is
    still first (by id the idle one would be), on its `slo_met` alone."""
    import threading

    import httpx

    from harness import InProcessDaemon
    from tests.fleet.test_fleet import TOKEN, admin_get, fleet_config

    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    daemons: dict[str, InProcessDaemon] = {}
    for name, seqs in (("a-idle", 4), ("b-busy", 1)):
        path = fleet_config(tmp_path, name, tiny_model_dir, url, max_num_seqs=seqs)
        daemons[name] = make_daemon.from_file(path)
    idle, busy = daemons["a-idle"].url, daemons["b-busy"].url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    statuses: list[int] = []

    def view() -> list[dict]:
        return admin_get(idle, "/admin/fleet")["instances"]

    def wait_for(what: str, ok: Any, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while not ok(found := view()):
            assert time.monotonic() < deadline, f"never {what}: {found}"
            time.sleep(0.1)
        return found

    def complete(max_tokens: int) -> None:
        body = {"model": "model", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
                "ignore_eos": True}  # fmt: skip
        statuses.append(httpx.post(busy + "/v1/completions", json=body, timeout=120).status_code)

    # A TTFT target no request meets (0.01 ms): its minute's p99 misses it.
    r = httpx.patch(busy + "/admin/config", json={"autopilot": {"ttft_p99_ms": 0.01}},
                    headers=auth, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    complete(4)
    flood = [threading.Thread(target=complete, args=(200,)) for _ in range(12)]
    for t in flood:
        t.start()
    found = wait_for(
        "a queue in b-busy's heartbeat",
        lambda f: (
            f[0]["id"] == "b-busy"
            and (f[0]["num_waiting"] or 0) > 0
            and (f[0]["oldest_waiting_s"] or 0) > 0
        ),
    )
    stats = admin_get(busy, "/admin/stats")
    top, other = found
    assert top["id"] == "b-busy" and other["id"] == "a-idle"
    assert top["slo_met"] is False and stats["slo"]["met"] is False
    assert top["ttft_p99_ms"] > 0.01 and stats["ttft_p99_ms"] > 0.01
    assert (other["oldest_waiting_s"], other["ttft_p99_ms"], other["slo_met"]) == (
        None,
        None,
        None,
    )
    assert other["num_waiting"] == 0
    for t in flood:
        t.join(300)
    assert statuses == [200] * 13
    # The queue drained: the oldest wait clears; missing the SLO keeps it first.
    found = wait_for(
        "b-busy's queue empty in the table",
        lambda f: (
            {m["id"]: (m["num_waiting"], m["oldest_waiting_s"]) for m in f}
            == {"a-idle": (0, None), "b-busy": (0, None)}
        ),
    )
    assert [m["id"] for m in found] == ["b-busy", "a-idle"]
    assert found[0]["slo_met"] is False and admin_get(busy, "/admin/stats")["slo"]["met"] is False
