"""The SLO autopilot in a real daemon under `controlplane loadgen` (tiny model, real HTTP, real
SQLite): it lowers max_num_seqs for an impossible ITL target, raises it for an easy target with
a queue, an operator's change pins the knob, draining turns it off, and the TUI shows it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from controlplane.tui.dashboard_app import DashboardApp
from controlplane.tui.tables import ChangesTable
from harness import InProcessDaemon
from tests.admin.test_admin_api import TOKEN, loadgen
from tests.tui.test_tui import screen_text, wait_until

FAST = {
    "interval_s": 0.5,
    "window_s": 1.0,
    "max_window_s": 5.0,
    "min_requests": 3,
    "max_num_seqs_min": 2,
    "max_num_seqs_max": 16,
}


@pytest.fixture
def pilot_daemon(make_daemon) -> Callable[..., InProcessDaemon]:
    def start(**autopilot: Any) -> InProcessDaemon:
        return make_daemon(
            admin=True,
            engine={"max_num_seqs": 8, "max_model_len": 512},
            autopilot={**FAST, **autopilot},
        )

    return start


def wait(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def seqs(d: InProcessDaemon) -> int:
    """The effective max_num_seqs (the engine takes it at its next step)."""
    return d.daemon.runtime.cfg.engine.max_num_seqs


def autopilot_rows(c: httpx.Client) -> list[dict]:
    rows = c.get("/admin/config/history", params={"limit": 1000}).json()["changes"]
    return [r for r in rows if r["source"] == "autopilot"]


def test_impossible_itl_target_lowers_batch_operator_pins_drain_turns_off(pilot_daemon):
    d = pilot_daemon(enabled=True, itl_p99_ms=1.0)  # 1 ms between tokens: never met
    c = d.client(TOKEN)
    gen = loadgen(
        d.url, "--rate", "40", "--requests", "400", "--prompt-len", "8-32",
        "--output-len", "20-40", "--stream",
    )  # fmt: skip
    try:
        wait(lambda: seqs(d) < 8, 60, "the autopilot lowering max_num_seqs")
        # Prompts of 8-32 tokens sit below the floors of the step budget and the chunk
        # (256 and 64): the batch is what it shrinks.
        row = autopilot_rows(c)[-1]  # newest first: this is its first change
        assert (row["field"], row["old_value"], row["actor"]) == (
            "engine.max_num_seqs",
            8,
            "autopilot",
        )
        assert row["reason"].startswith("itl_p99 ") and "> 1 ms target" in row["reason"]
        assert row["reason"].endswith(": max_num_seqs 8 -> 6")
        state = c.get("/admin/autopilot").json()
        assert state["enabled"] and state["targets"]["itl_p99_ms"] == 1.0
        assert state["decisions"][0]["figures"]["requests"] >= FAST["min_requests"]
        metrics = c.get("/metrics").text
        assert (
            'controlplane:autopilot_decisions_total{direction="latency",knob="max_num_seqs"'
            in metrics
        )
        assert "controlplane:autopilot_enabled{" in metrics

        # An operator sets the knob: the autopilot leaves it alone from then on.
        assert c.patch("/admin/config", json={"engine": {"max_num_seqs": 7}}).status_code == 200
        assert "max_num_seqs" in c.get("/admin/autopilot").json()["pinned"]
        pinned_at = time.time()
        before = len(autopilot_rows(c))

        def next_itl_decision() -> dict | None:
            # The next decision on the missed ITL target: a change of another knob or a hold.
            # Which one depends on the window's step timings (a hold when the chunk cannot go
            # below what prefill steps carry), so the test waits for either, not for a change.
            decisions = c.get("/admin/autopilot").json()["decisions"]  # newest first
            return next(
                (x for x in decisions if x["time"] > pinned_at and "itl_p99" in x["reason"]),
                None,
            )

        decision = wait(next_itl_decision, 30, "the next autopilot decision")
        if decision["knob"] is None:  # a hold: the pin is among its reasons
            assert "max_num_seqs pinned by an operator" in decision["reason"], decision
        else:
            assert decision["knob"] != "max_num_seqs", decision
        assert seqs(d) == 7
        assert all(
            r["field"] != "engine.max_num_seqs" for r in autopilot_rows(c)[: -before or None]
        )

        # Draining turns it off, audited, and says why.
        assert c.post("/admin/drain").status_code == 200
        state = wait(
            lambda: (s := c.get("/admin/autopilot").json())["state"] == "off" and s, 10, "off"
        )
        assert state["off_reason"] == "the daemon is draining" and not state["enabled"]
        off = autopilot_rows(c)[0]
        assert (off["field"], off["new_value"]) == ("autopilot.enabled", False)
        assert off["reason"] == "turned off: the daemon is draining"
    finally:
        gen.kill()
        gen.wait()


def test_easy_target_with_a_queue_raises_batch(pilot_daemon):
    d = pilot_daemon(enabled=True, itl_p99_ms=60_000.0, ttft_p99_ms=600_000.0)
    c = d.client(TOKEN)
    # Start small (an operator's value, not pinned: operator_hold_s 0), with a standing queue.
    r = c.patch("/admin/autopilot", json={"operator_hold_s": 0})
    assert r.status_code == 200, r.text
    assert c.patch("/admin/config", json={"engine": {"max_num_seqs": 2}}).status_code == 200
    gen = loadgen(
        d.url, "--rate", "50", "--requests", "300", "--prompt-len", "8-32",
        "--output-len", "30-60", "--stream",
    )  # fmt: skip
    try:
        wait(lambda: seqs(d) > 2, 60, "the autopilot raising max_num_seqs")
        row = autopilot_rows(c)[-1]
        assert (row["field"], row["old_value"], row["new_value"]) == ("engine.max_num_seqs", 2, 3)
        assert "targets met with headroom and" in row["reason"] and "queued" in row["reason"]
    finally:
        gen.kill()
        gen.wait()
    # Bad input names the field and the limit.
    r = c.patch("/admin/autopilot", json={"headroom": 1.5})
    assert r.status_code == 422 and r.json()["error"]["param"] == "autopilot.headroom"
    r = c.patch("/admin/autopilot", json={"max_num_seqs_min": 0})
    assert r.status_code == 422 and "max_num_seqs_min" in r.json()["error"]["message"]
    r = c.patch("/admin/autopilot", json={"nope": 1})
    assert r.status_code == 422 and r.json()["error"]["param"] == "autopilot.nope"


def test_tui_shows_autopilot_state_and_its_reasons(pilot_daemon):
    d = pilot_daemon(enabled=False, itl_p99_ms=1.0)
    app = DashboardApp(d.url, TOKEN, events_interval=0.2, requests_interval=0.3)
    gen = loadgen(
        d.url, "--rate", "40", "--requests", "400", "--prompt-len", "8-32",
        "--output-len", "20-40", "--stream",
    )  # fmt: skip

    async def main() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_until(pilot, lambda: "autopilot off" in screen_text(app), 20, "off")
            await pilot.press("p")  # asks first
            await pilot.press("y")
            await wait_until(
                pilot, lambda: "autopilot adjusting" in screen_text(app)
                or "autopilot holding" in screen_text(app), 20, "on",
            )  # fmt: skip
            table = app.query_one(ChangesTable)

            def reason_row() -> bool:
                return any(
                    "(itl_p99" in str(table.get_row_at(i)[-1]) for i in range(table.row_count)
                )

            await wait_until(pilot, reason_row, 60, "an autopilot change with its reason")

    try:
        asyncio.run(main())
    finally:
        gen.kill()
        gen.wait()
    rows = autopilot_rows(d.client(TOKEN))
    assert any(r["reason"] and r["reason"].startswith("itl_p99") for r in rows)
