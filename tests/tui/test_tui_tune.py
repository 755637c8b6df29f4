"""The tuning form and the autopilot view: Pilot against a real in-process daemon on loopback
(tiny model, real HTTP, admin token), keys pressed with no delay; a snapshot of the form with
deterministic data."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import httpx
import pytest
from textual.widgets import Input, Static

from controlplane.config import field_limits, load_config
from controlplane.tui.autopilot import AutopilotScreen
from controlplane.tui.dashboard_app import DashboardApp
from controlplane.tui.tune import TuneScreen
from harness import InProcessDaemon
from tests.admin.test_admin_api import MODEL, admin_cfg
from tests.tui.support import T0, FakeClient, loaded, screen_text, wait_until
from tests.tui.test_tui import api, make_app

# Never enough finished requests for a decision: the autopilot holds, with its reason, every
# half second, and never moves a knob under the form's tests.
AUTOPILOT = {
    "enabled": True,
    "ttft_p99_ms": 2000.0,
    "itl_p99_ms": 300.0,
    "interval_s": 0.5,
    "window_s": 1.0,
    "max_window_s": 5.0,
    "min_requests": 1000,
}
DEFAULTS = {
    "engine.max_num_seqs": 8,
    "engine.max_num_batched_tokens": 2048,
    "server.max_queue_len": 256,
    "autopilot.ttft_p99_ms": 2000.0,
    "autopilot.itl_p99_ms": 300.0,
}


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    path = admin_cfg(
        tmp,
        tiny_model_dir,
        engine={"max_num_seqs": 8, "max_num_batched_tokens": 2048, "max_model_len": 1024},
        autopilot=AUTOPILOT,
    )
    d = InProcessDaemon(load_config(path, env={}), config_path=path).start()
    yield d
    d.stop()


@pytest.fixture
def c(daemon):
    client = api(daemon.url)
    r = client.patch("/admin/config", json=DEFAULTS)
    assert r.status_code == 200, r.text
    yield client
    client.patch("/admin/config", json=DEFAULTS)
    client.close()


def values(c: httpx.Client) -> dict[str, Any]:
    return {k: v["value"] for k, v in c.get("/admin/config").json()["fields"].items()}


def last_change(c: httpx.Client) -> int:
    """The id of the daemon's latest config change, 0 before any (a test run alone)."""
    changes = c.get("/admin/config/history", params={"limit": 1}).json()["changes"]
    return changes[0]["id"] if changes else 0


def text(widget: Any) -> str:
    return str(widget.render())


async def open_form(pilot: Any) -> TuneScreen:
    app = pilot.app
    await wait_until(
        pilot, lambda: app.dashboard.fields and app.dashboard.stats_received, 10, "config and stats"
    )
    await pilot.press("t")
    return await wait_until(pilot, lambda: isinstance(app.screen, TuneScreen) and app.screen)


async def focus(pilot: Any, form: TuneScreen, dom: str) -> Input:
    field = form.query_one(f"#in-{dom}", Input)
    field.focus()
    await wait_until(pilot, lambda: field.has_focus, 5, f"focus on {dom}")
    return field


# -- the form against a real daemon ------------------------------------------------------------
def test_form_lists_every_live_field_with_its_range(daemon, c):
    fields = c.get("/admin/config").json()["fields"]
    # The ranges come from the validation's own declarations, next to each value.
    assert fields["engine.max_num_seqs"] | {"value": 0, "source": "?"} == {
        "value": 0,
        "source": "?",
        "live": True,
        "type": "int",
        "min": 1,
        "max": 4096,
    }
    assert (
        fields["server.max_queue_len"]["min"] == 0 and "max" not in fields["server.max_queue_len"]
    )
    assert fields["autopilot.headroom"]["min_exclusive"] is True
    assert fields["engine.preemption_mode"]["choices"] == ["recompute", "swap"]
    assert fields["engine.enable_prefix_caching"]["choices"] == [True, False]
    # Out of the declared range: the API refuses with the same bounds it shows.
    r = c.patch("/admin/config", json={"engine.max_num_seqs": 4097})
    assert r.status_code == 422 and "[1, 4096]" in r.json()["error"]["message"]
    r = c.patch("/admin/config", json={"server.max_queue_len": -1})
    assert r.status_code == 422 and ">= 0" in r.json()["error"]["message"]

    async def main() -> None:
        app = make_app(daemon.url)
        async with app.run_test(size=(120, 40)) as pilot:
            form = await open_form(pilot)
            live = [k for k, v in fields.items() if v["live"] and not isinstance(v["value"], list)]
            for key in live:  # a row for each, numbers as inputs, the rest as selects
                dom = key.removeprefix("engine.").replace(".", "-")
                widget = form.query_one(f"#in-{dom}")
                kind = fields[key]["type"]
                assert (type(widget).__name__ == "Input") == (kind in ("int", "float")), key
            assert form.query_one("#in-server-max_queue_len", Input).value == "256"
            assert form.query_one("#in-autopilot-ttft_p99_ms", Input).value == "2000"
            # Docked right: the dashboard's panels stay visible beside it at 120 columns.
            box = form.query_one("#tune-box")
            assert box.region.x > 40 and box.region.right == 120
            # (Polled: the first frames of the modal can hold the form alone.)
            await wait_until(pilot, lambda: "Live requests" in screen_text(app), 5, "beside")

    asyncio.run(main())


def test_fast_typing_lands_in_the_right_fields_and_applies(daemon, c):
    async def main() -> None:
        app = make_app(daemon.url)
        async with app.run_test(size=(120, 40)) as pilot:
            form = await open_form(pilot)
            seqs = form.query_one("#in-max_num_seqs", Input)
            await wait_until(pilot, lambda: seqs.has_focus, 5, "the first field focused")
            # No delay between keys: each field gets exactly what was typed for it.
            await pilot.press(*"6", "tab", *"4096")
            ttft = await focus(pilot, form, "autopilot-ttft_p99_ms")
            await pilot.press(*"2500", "tab", *"400")
            itl = form.query_one("#in-autopilot-itl_p99_ms", Input)
            budget = form.query_one("#in-max_num_batched_tokens", Input)
            await wait_until(pilot, lambda: itl.value == "400", 5, "the last key")
            assert (seqs.value, budget.value, ttft.value, itl.value) == ("6", "4096", "2500", "400")
            assert form.errors() == {} and form.flags() == {}
            assert form.changes() == {
                "engine.max_num_seqs": 6,
                "engine.max_num_batched_tokens": 4096,
                "autopilot.ttft_p99_ms": 2500.0,
                "autopilot.itl_p99_ms": 400.0,
            }
            await pilot.press("ctrl+s")
            status = form.query_one("#tune-status", Static)
            await wait_until(pilot, lambda: "applied" in text(status), 10, "applied")

    asyncio.run(main())
    fields = c.get("/admin/config").json()["fields"]
    assert fields["server.max_queue_len"]["source"] != "tui"
    got = {k: (fields[k]["value"], fields[k]["source"]) for k in DEFAULTS}
    assert got == {
        "engine.max_num_seqs": (6, "tui"),
        "engine.max_num_batched_tokens": (4096, "tui"),
        "server.max_queue_len": (256, fields["server.max_queue_len"]["source"]),  # not sent
        "autopilot.ttft_p99_ms": (2500.0, "tui"),
        "autopilot.itl_p99_ms": (400.0, "tui"),
    }


def test_dropped_tab_is_flagged_and_needs_a_second_apply(daemon, c):
    before = last_change(c)

    async def main() -> None:
        app = make_app(daemon.url)
        async with app.run_test(size=(120, 40)) as pilot:
            form = await open_form(pilot)
            ttft = await focus(pilot, form, "autopilot-ttft_p99_ms")
            await pilot.press(*"2000", *"400")  # "2000⇥400" with the tab lost
            await wait_until(pilot, lambda: ttft.value == "2000400", 5, "typed")
            note = form.query_one("#err-autopilot-ttft_p99_ms", Static)
            # Flagged next to the field as typed, before any apply.
            await wait_until(
                pilot,
                lambda: "1,000x the current 2000: intended?" in text(note),
                5,
                "the 10x flag",
            )
            assert form.query_one("#in-autopilot-itl_p99_ms", Input).value == "300"
            await pilot.press("ctrl+s")
            status = form.query_one("#tune-status", Static)
            await wait_until(pilot, lambda: "ctrl+s again" in text(status), 5, "held back")
            assert "not applied" in text(status)
            await pilot.pause(0.5)  # were anything sent, it would have landed by now
            assert values(c)["autopilot.ttft_p99_ms"] == 2000.0
            assert last_change(c) == before
            # Corrected: nothing flagged, and the flag is gone from the field.
            await pilot.press("end", "ctrl+u", *"2200")
            await wait_until(pilot, lambda: ttft.value == "2200" and not text(note), 5, "fixed")
            # Flagged again, and this time confirmed with a second ctrl+s: it applies.
            await pilot.press("end", "ctrl+u", *"25000")
            await wait_until(pilot, lambda: "12.5x the current 2000" in text(note), 5, "flag")
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: "ctrl+s again" in text(status), 5, "held back")
            assert values(c)["autopilot.ttft_p99_ms"] == 2000.0
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: "applied" in text(status), 10, "applied")

    asyncio.run(main())
    fields = c.get("/admin/config").json()["fields"]
    assert (
        fields["autopilot.ttft_p99_ms"]["value"],
        fields["autopilot.ttft_p99_ms"]["source"],
    ) == (
        25000.0,
        "tui",
    )


def test_out_of_range_and_garbage_are_field_errors_and_nothing_applies(daemon, c):
    before = last_change(c)

    async def main() -> None:
        app = make_app(daemon.url)
        async with app.run_test(size=(120, 40)) as pilot:
            form = await open_form(pilot)
            await wait_until(pilot, lambda: form.query_one("#in-max_num_seqs").has_focus, 5)
            await pilot.press(*"5000", "tab", *"4o96")  # over 4096; a letter o for a zero
            seqs_note = form.query_one("#err-max_num_seqs", Static)
            budget_note = form.query_one("#err-max_num_batched_tokens", Static)
            await wait_until(
                pilot,
                lambda: (
                    "out of range: must be in [1, 4096], got 5000" in text(seqs_note)
                    and "not a whole number: '4o96'" in text(budget_note)
                ),
                5,
                "both errors as typed",
            )
            queue = await focus(pilot, form, "server-max_queue_len")
            await pilot.press(*"-3")
            queue_note = form.query_one("#err-server-max_queue_len", Static)
            await wait_until(pilot, lambda: ">= 0" in text(queue_note), 5, "negative refused")
            assert queue.value == "-3"
            await pilot.press("ctrl+s")
            status = form.query_one("#tune-status", Static)
            await wait_until(pilot, lambda: "not applied" in text(status), 5, "refused")
            assert "max_num_seqs" in text(status) and "server.max_queue_len" in text(status)
            await pilot.pause(0.5)
            # Fixing one field is not enough: apply stays refused while another is in error.
            await pilot.press("end", "ctrl+u", *"64")
            await wait_until(pilot, lambda: not text(queue_note), 5, "one fixed")
            status.update("")
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: "not applied" in text(status), 5, "still refused")

    asyncio.run(main())
    got = values(c)
    assert (got["engine.max_num_seqs"], got["engine.max_num_batched_tokens"]) == (8, 2048)
    assert got["server.max_queue_len"] == 256
    assert last_change(c) == before


def test_max_queue_len_through_the_form_reaches_the_daemon(daemon, c):
    async def main() -> None:
        app = make_app(daemon.url)
        async with app.run_test(size=(120, 40)) as pilot:
            form = await open_form(pilot)
            await focus(pilot, form, "server-max_queue_len")
            await pilot.press(*"64")
            preview = form.query_one("#tune-preview", Static)
            await wait_until(
                pilot, lambda: "lowering max_queue_len to 64" in text(preview), 5, "preview"
            )
            await pilot.press("ctrl+s")
            status = form.query_one("#tune-status", Static)
            await wait_until(pilot, lambda: "applied" in text(status), 10, "applied")
            assert "server.max_queue_len = 64" in text(status)
            # The dashboard's own copy of the fields keeps the ranges (the next form has them).
            assert app.dashboard.fields["server.max_queue_len"]["value"] == 64
            assert app.dashboard.fields["server.max_queue_len"]["min"] == 0

    asyncio.run(main())
    fields = c.get("/admin/config").json()["fields"]
    assert (fields["server.max_queue_len"]["value"], fields["server.max_queue_len"]["source"]) == (
        64,
        "tui",
    )
    assert c.get("/admin/stats").json()["max_queue_len"] == 64
    entry = c.get("/admin/config/history", params={"field": "server.max_queue_len"}).json()[
        "changes"
    ][0]
    assert (entry["source"], entry["actor"], entry["old_value"], entry["new_value"]) == (
        "tui",
        "ops",
        256,
        64,
    )


def test_preview_of_lowering_max_num_seqs_names_the_running_requests(daemon, c):
    done: dict[str, Any] = {}

    def long_request(i: int) -> None:
        done[i] = httpx.post(
            daemon.url + "/v1/completions",
            timeout=120,
            json={"model": MODEL, "prompt": "long", "max_tokens": 900, "ignore_eos": True},
        ).status_code

    # Three times the slots (max_num_seqs 8): on a fast core one round of 900 tokens is over in
    # about 1.5 s, and the preview must still see them running after the keystroke (a full run
    # once saw them all finished: "0 running, none preempted"); the rest are aborted below.
    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(24)]

    async def main() -> None:
        app = make_app(daemon.url)
        async with app.run_test(size=(120, 40)) as pilot:
            form = await open_form(pilot)
            for t in threads:
                t.start()
            await wait_until(
                pilot,
                lambda: (app.dashboard.stats or {}).get("num_running", 0) >= 4,
                30,
                "running >= 4",
            )
            await wait_until(pilot, lambda: form.query_one("#in-max_num_seqs").has_focus, 5)
            await pilot.press(*"2")
            preview = form.query_one("#tune-preview", Static)

            def names_running() -> bool:
                n = app.dashboard.stats["num_running"]
                return f"preempts about {n - 2} of the {n} running requests" in text(preview)

            await wait_until(pilot, names_running, 10, "the running count in the preview")
            assert "lowering max_num_seqs to 2" in text(preview)
            await pilot.press("escape")  # closed without applying
            await wait_until(pilot, lambda: not isinstance(app.screen, TuneScreen), 5)

    try:
        asyncio.run(main())
        assert values(c)["engine.max_num_seqs"] == 8
    finally:
        for r in c.get("/admin/requests").json()["live"]:
            c.post(f"/admin/requests/{r['id']}/abort")
        for t in threads:
            if t.ident is not None:
                t.join(60)


def test_autopilot_view_shows_full_reasons_and_pins(daemon, c):
    # An operator's change pins the knob (operator_hold_s: 600 s by default).
    assert c.patch("/admin/config", json={"engine.max_num_seqs": 7}).status_code == 200
    state = c.get("/admin/autopilot").json()
    assert "max_num_seqs" in state["pinned"]

    def held_reason() -> str | None:
        decisions = c.get("/admin/autopilot").json()["decisions"]
        return decisions[0]["reason"] if decisions else None

    async def main() -> None:
        app = make_app(daemon.url)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: app.dashboard.stats_received, 10, "stats")
            app.push_screen(AutopilotScreen(app.dashboard.client, interval=0.5))
            view = await wait_until(
                pilot, lambda: isinstance(app.screen, AutopilotScreen) and app.screen
            )
            await wait_until(pilot, lambda: view.fetches, 10, "the first answer")
            reason = await asyncio.to_thread(held_reason)
            assert reason and reason.startswith("too few samples") and len(reason) > 60

            def flat() -> str:  # the screen's text, borders and line breaks removed
                return " ".join(re.sub(r"[█▀▄▌▐│┃]", " ", screen_text(app)).split())

            # The whole reason, wrapped over lines at 80 columns, never cut off.
            await wait_until(pilot, lambda: reason in flat(), 10, "the full reason")
            assert "HELD" in flat() and "…" not in flat()
            assert "Autopilot ON" in flat() and "TTFT p99 ≤ 2000 ms" in flat()
            await wait_until(
                pilot,
                lambda: re.search(r"max_num_seqs pinned by api \(ops\), 9m \d\ds left", flat()),
                10,
                "the pin, by whom, time left",
            )
            await pilot.press("escape")
            await wait_until(pilot, lambda: not isinstance(app.screen, AutopilotScreen), 5)

    asyncio.run(main())


# -- deterministic: layout and snapshot --------------------------------------------------------
class TuneFake(FakeClient):
    """The snapshot's daemon: the fields GET /admin/config lists, with their ranges."""

    async def config(self) -> dict[str, Any]:
        limits = field_limits()
        values = {
            "engine.max_num_seqs": (8, "tui"),
            "engine.max_num_batched_tokens": (2048, "default"),
            "engine.prefill_chunk_size": (512, "default"),
            "engine.preemption_mode": ("recompute", "default"),
            "engine.speculative_method": ("ngram", "api"),
            "engine.speculative_num_tokens": (3, "default"),
            "engine.enable_prefix_caching": (True, "default"),
            "autopilot.enabled": (True, "api"),
            "autopilot.ttft_p99_ms": (2000.0, "api"),
            "autopilot.itl_p99_ms": (80.0, "api"),
            "server.max_queue_len": (256, "file"),
            "server.max_n": (16, "default"),
            "engine.block_size": (16, "default"),  # restart-only: not in the form
        }
        return {
            "fields": {
                k: {"value": v, "source": s, "live": k != "engine.block_size", **limits[k]}
                for k, (v, s) in values.items()
            }
        }


def tune_app() -> DashboardApp:
    return DashboardApp("http://127.0.0.1:8000", "token", client=TuneFake(), clock=lambda: T0)


async def typed_form(pilot: Any) -> None:
    await loaded(pilot)
    await pilot.press("t")
    form = await wait_until(
        pilot, lambda: isinstance(pilot.app.screen, TuneScreen) and pilot.app.screen
    )
    await wait_until(pilot, lambda: form.query_one("#in-max_num_seqs").has_focus, 5)
    # Lower the batch, raise the budget 15x (flagged), a typo in the chunk size, a queue
    # limit below the queue.
    await pilot.press(*"2", "tab", *"30000", "tab", *"5x2")
    await focus(pilot, form, "server-max_queue_len")
    await pilot.press(*"16")
    preview = form.query_one("#tune-preview", Static)
    await wait_until(pilot, lambda: "max_queue_len 16 <" in text(preview), 5, "preview")
    for field in form.query(Input):
        field.cursor_blink = False
    await pilot.pause(0.2)


def test_form_content_with_fake_stats():
    async def main() -> None:
        app = tune_app()
        async with app.run_test(size=(120, 40)) as pilot:
            await typed_form(pilot)
            form = app.screen
            assert isinstance(form, TuneScreen)
            lines = text(form.query_one("#tune-preview", Static))
            queue = app.dashboard.stats["queue_length"]
            assert "preempts about 4 of the 6 running requests" in lines
            assert f"max_queue_len 16 < queue {queue}: the {queue} waiting stay queued" in lines
            assert "raising max_num_batched_tokens to 30000 lengthens prefill steps" in lines
            assert "14.6x the current 2048: intended?" in text(
                form.query_one("#err-max_num_batched_tokens", Static)
            )
            assert "not a whole number: '5x2'" in text(
                form.query_one("#err-prefill_chunk_size", Static)
            )
            assert not form.query("#in-block_size")  # restart-only fields stay out

    asyncio.run(main())


def test_form_takes_the_full_width_at_80_columns():
    async def main() -> None:
        app = tune_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await loaded(pilot)
            await pilot.press("t")
            form = await wait_until(
                pilot, lambda: isinstance(app.screen, TuneScreen) and app.screen
            )
            box = form.query_one("#tune-box")
            await wait_until(pilot, lambda: box.region.width == 80, 5, "full width")

    asyncio.run(main())


def test_snapshot_tune_form_beside_the_dashboard(snap_compare):
    assert snap_compare(tune_app(), terminal_size=(120, 40), run_before=typed_form)
