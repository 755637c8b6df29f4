"""The terminal dashboard: Pilot tests against a real daemon on loopback (tiny model, real HTTP,
admin token, `controlplane loadgen` traffic), and snapshots with deterministic data."""

from __future__ import annotations

import argparse
import asyncio
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from textual.geometry import Region
from textual.widgets import Input

from controlplane.config import load_config
from controlplane.tui import add_tui_parser, resolve_token
from controlplane.tui.confirm import ConfirmScreen
from controlplane.tui.dashboard_app import DashboardApp
from controlplane.tui.tables import ChangesTable, RequestsTable, short_id
from controlplane.tui.tune import TuneScreen
from harness import InProcessDaemon, free_port
from tests.admin.test_admin_api import MODEL, TOKEN, admin_cfg, loadgen
from tests.tui.support import T0, FakeClient, fake_app, loaded, screen_text, wait_until

SIZE = (120, 40)


# -- helpers ------------------------------------------------------------------------------------
def stale_age(app: DashboardApp) -> int | None:
    """The age the header shows for stale numbers, in seconds (None without STALE)."""
    m = re.search(r"STALE (\d+)m(\d\d)s", screen_text(app))
    return int(m[1]) * 60 + int(m[2]) if m else None


async def scroll_to(pilot: Any, selector: str) -> None:
    """Bring a panel below the fold into view, as an operator scrolling down would."""
    app = pilot.app
    app.query_one("#main").scroll_to_widget(app.query_one(selector), animate=False, top=True)
    await pilot.pause(0.1)


def start_daemon(tmp: Path, model: Path, port: int = 0, **engine: Any) -> InProcessDaemon:
    path = admin_cfg(
        tmp,
        model,
        engine={"max_num_seqs": 8, "max_model_len": 1024, **engine},
        server={"port": port},
    )
    return InProcessDaemon(load_config(path, env={}), config_path=path).start()


def api(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)


def make_app(url: str) -> DashboardApp:
    return DashboardApp(url, TOKEN, events_interval=0.2, requests_interval=0.3, reconnect_max_s=0.5)


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("tui"), tiny_model_dir)
    yield d
    d.stop()


# -- real daemon --------------------------------------------------------------------------------
def test_live_numbers_match_admin_stats_under_loadgen(daemon):
    gen = loadgen(daemon.url, "--requests", "30", "--prompt-len", "8-32", "--output-len", "150-250")
    c = api(daemon.url)

    async def main() -> None:
        # The first data comes on connecting, not a period later: with a 30 s period it is
        # on screen within 5 s. (A wall-clock bound on the default period measured this
        # machine's load instead: 3.25-4.0 s under loadgen on 2 busy cores.)
        slow = DashboardApp(daemon.url, TOKEN, events_interval=30, reconnect_max_s=0.5)
        async with slow.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: slow.dashboard.stats_received, 5, "first stats")
            assert slow.dashboard.stats_received == 1 and "serving" in screen_text(slow)
        app = make_app(daemon.url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.dashboard.stats_received, 5, "first stats")
            await wait_until(
                pilot,
                lambda: (app.dashboard.stats or {}).get("num_running", 0) > 0,
                30,
                "running > 0",
            )
            await wait_until(pilot, lambda: app.query_one(RequestsTable).row_count > 0, 10)
            api_stats = c.get("/admin/stats").json()
            await scroll_to(pilot, "#kv")  # the detail panels are below the tables at 120x40
            text = screen_text(app)
            assert f"/ {api_stats['max_num_seqs']} max_num_seqs" in text
            assert f"/ {api_stats['kv_blocks_total']}" in text
            await wait_until(pilot, lambda: "map " in screen_text(app), 10, "KV block map")
            kv_map = screen_text(app).split("map ", 1)[1].split()[0]
            assert set(kv_map) & set("▁▂▃▄▅▆▇█"), kv_map  # the blocks in use show up
            assert api_stats["model"] in text and "serving" in text
            # Whether the kernels loaded, as /admin/stats says it: ok, or fallback and why.
            assert f"kernels: {api_stats['kernels']['status']}" in text
            # (The compiled step may finish warming meanwhile: any of its states.)
            assert re.search(r"compiled_step: (off|warming|ready|failed)\b", text)
            shown = app.dashboard.stats["num_running"]
            assert f"running {shown} /" in text and 0 < shown <= api_stats["max_num_seqs"]
            # The table lists the daemon's live requests.
            live_ids = {r["id"] for r in c.get("/admin/requests").json()["live"]}
            table = app.query_one(RequestsTable)
            shown_ids = {str(k.value) for k in table.rows}
            assert shown_ids & live_ids or not live_ids
            # The short ids on screen are the tails of the real ones.
            assert all(short_id(i).lstrip("…") in i for i in shown_ids)
            await pilot.press("o")  # sort by another column, nothing breaks
            await pilot.press("question_mark")
            await wait_until(pilot, lambda: "this help" in screen_text(app), 5)
            await pilot.press("escape")

    try:
        asyncio.run(main())
    finally:
        gen.kill()
        gen.wait(30)


def test_tune_form_reaches_engine_and_invalid_value_shows_api_error(daemon):
    c = api(daemon.url)
    c.patch("/admin/config", json={"engine": {"max_num_seqs": 8, "max_num_batched_tokens": 2048}})

    async def main() -> None:
        app = make_app(daemon.url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.dashboard.fields, 5, "config loaded")
            # Invalid: a token budget below max_num_seqs. The API's message appears inline.
            await pilot.press("t")
            form = await wait_until(
                pilot, lambda: isinstance(app.screen, TuneScreen) and app.screen
            )
            form.query_one("#in-max_num_batched_tokens").value = "2"
            await pilot.press("ctrl+s", "ctrl+s")  # 1/1024 of the current value: confirmed
            err = form.query_one("#err-max_num_batched_tokens")
            await wait_until(pilot, lambda: "max_num_seqs" in str(err.render()), 10, "inline error")
            assert ">= max_num_seqs (8)" in str(err.render())
            fields = c.get("/admin/config").json()["fields"]
            assert fields["engine.max_num_batched_tokens"]["value"] == 2048
            assert fields["engine.max_num_seqs"]["value"] == 8
            # Valid: max_num_seqs 8 -> 5.
            form.query_one("#in-max_num_batched_tokens").value = "2048"
            form.query_one("#in-max_num_seqs").value = "5"
            await pilot.press("ctrl+s")
            status = form.query_one("#tune-status")
            await wait_until(pilot, lambda: "applied" in str(status.render()), 10, "applied")
            assert "max_num_seqs = 5" in str(status.render())
            assert str(err.render()) == ""
            await pilot.press("escape")
            # The engine sees it; the dashboard shows the new effective value from the stream.
            await wait_until(
                pilot, lambda: "/ 5 max_num_seqs" in screen_text(app), 10, "new max shown"
            )
            await wait_until(pilot, lambda: "engine.max_num_seqs" in screen_text(app), 10)

    asyncio.run(main())
    fields = c.get("/admin/config").json()["fields"]
    assert fields["engine.max_num_seqs"] | {"type": "int", "min": 1, "max": 4096} == {
        "value": 5,
        "source": "tui",
        "live": True,
        "type": "int",
        "min": 1,
        "max": 4096,
    }
    assert c.get("/admin/stats").json()["max_num_seqs"] == 5
    entry = c.get("/admin/config/history", params={"field": "engine.max_num_seqs"}).json()[
        "changes"
    ][0]
    assert (entry["source"], entry["actor"], entry["old_value"], entry["new_value"]) == (
        "tui",
        "ops",
        8,
        5,
    )
    c.patch("/admin/config", json={"engine": {"max_num_seqs": 8}})


class HeldSimulator:
    """The dashboard's client, whose simulator answer (the daemon's real one) is held until
    `release` is set: to close the tuning form while the answer is on its way."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.form: TuneScreen | None = None  # the form it answers, once made
        self.asked, self.release = asyncio.Event(), asyncio.Event()
        self.widgets_at_cancel: int | None = None  # the form's widgets left when cancelled

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def simulate(self, body: dict[str, Any], window_s: float = 900.0) -> Any:
        try:
            answer = await self.client.simulate(body, window_s)
        except Exception as exc:  # 409 with no traffic: the form shows that too
            answer = exc
        self.asked.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.widgets_at_cancel = len(self.form.query("*")) if self.form else None
            raise
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_closing_the_tune_form_cancels_its_simulator_before_its_widgets_go(daemon):
    # CI (stop 66): the simulator's answer reached the form while Textual was removing its
    # widgets, which comes before the screen's own workers are cancelled: NoMatches, the app
    # failed. Closing now cancels them first, while every widget is still there.
    async def main() -> None:
        app = make_app(daemon.url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.dashboard.fields, 5, "config loaded")
            held = HeldSimulator(app.dashboard.client)
            form = TuneScreen(held, app.dashboard.fields, simulate_after=0.05)
            held.form = form
            await app.push_screen(form)
            whole = len(form.query("*"))
            sim = form.query_one("#tune-sim")
            form.query_one("#in-max_num_seqs", Input).value = "5"
            await wait_until(pilot, held.asked.is_set, 10, "the simulator asked")
            (worker,) = [w for w in app.workers if w.node is form and w.group == "simulate"]
            await pilot.press("escape")
            deadline = time.monotonic() + 10
            while sim.is_attached and time.monotonic() < deadline:
                await asyncio.sleep(0)  # the answer is let go the moment the widgets go
            held.release.set()
            await wait_until(pilot, lambda: worker.is_finished, 5, "the simulator's worker")
            assert worker.is_cancelled
            assert held.widgets_at_cancel == whole
            assert not isinstance(app.screen, TuneScreen)

    asyncio.run(main())  # a worker's NoMatches would fail the app, and this, with WorkerFailed


def test_abort_selected_request_after_confirmation(daemon, monkeypatch):
    result: dict = {}

    def long_request(key: str) -> None:
        result[key] = httpx.post(
            daemon.url + "/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": "long", "max_tokens": 1000, "ignore_eos": True},
        ).json()

    # The target must outlast the UI's round trips (table refresh, key presses, confirmation)
    # on any machine. The tiny model decodes its 1,000 tokens (max_model_len is 1024 here) in
    # about a second, less on a fast CPU: with seven more long requests sharing the steps, CI
    # on a Zen 5 still saw it end ("length") before the confirmed abort reached it. So the
    # engine's steps are paced at 10 ms for this test, as a bigger model's would be: the target
    # then lasts at least 10 s.
    engine = daemon.daemon.aengine.engine
    step = engine.step

    def paced_step() -> list:
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", paced_step)
    t = threading.Thread(target=long_request, args=("r",))

    async def main() -> None:
        app = make_app(daemon.url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.dashboard.stats_received, 5)
            t.start()
            table = app.query_one(RequestsTable)
            await wait_until(pilot, lambda: table.row_count == 1, 15, "the request in the table")
            rid = table.selected_id()
            table.focus()
            await pilot.press("a")
            await wait_until(pilot, lambda: "Abort request" in screen_text(app), 5)
            await pilot.press("y")
            await wait_until(pilot, lambda: "r" in result, 20, "the request ends")
            assert result["r"]["choices"][0]["finish_reason"] == "abort"
            assert rid and rid.startswith("cmpl")
            # Drain and resume, each after a confirmation; "n" changes nothing.
            await pilot.press("d")
            await pilot.press("n")
            await pilot.pause(0.2)
            assert httpx.get(daemon.url + "/health").json().get("status") != "draining"
            await pilot.press("d")
            await pilot.press("y")
            # The aborted request was the only one: nothing is in flight, so the header says
            # "drained: safe to stop". This waited for "draining", on screen only while the
            # dashboard's last snapshot still counted the aborted request: under load (a press
            # waits for the process to idle, up to 2 s a key) the wait found the later words.
            await wait_until(
                pilot, lambda: "drained: safe to stop" in screen_text(app), 10, "drained"
            )
            assert httpx.get(daemon.url + "/health").json().get("status") == "draining"
            await pilot.press("r")
            await pilot.press("y")
            await wait_until(pilot, lambda: "serving" in screen_text(app), 10, "serving")

    try:
        asyncio.run(main())
    finally:
        if t.ident is not None:  # started
            t.join(60)


def test_reconnects_after_daemon_restart(tiny_model_dir, tmp_path):
    port = free_port()
    first = start_daemon(tmp_path, tiny_model_dir, port)

    async def main() -> None:
        nonlocal first
        app = make_app(first.url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.dashboard.connected, 5)
            main = app.query_one("#main")
            assert not main.has_class("-stale")
            # A live fix the restart will drop (the file says max_num_seqs 8).
            r = api(first.url).patch("/admin/config", json={"engine": {"max_num_seqs": 6}})
            assert r.status_code == 200, r.text
            await asyncio.to_thread(first.stop)
            await wait_until(pilot, lambda: "unreachable" in screen_text(app), 15, "unreachable")
            assert "reconnecting" in screen_text(app)
            # The last numbers stay on screen, dimmed, with their age; the age grows.
            assert main.has_class("-stale") and main.styles.opacity < 1
            # Read the age, then see it grow. Not "0m01s" then "0m02s": each is on screen for one
            # second only, and under load the daemon's stop (after its stream already ended)
            # or a late 1 s tick can carry the age past one of them before it is read.
            first_age = await wait_until(pilot, lambda: stale_age(app), 5, "stale age")
            assert first_age < 60
            await wait_until(pilot, lambda: (stale_age(app) or 0) > first_age, 5, "age grows")
            assert "in " in screen_text(app) and "queue " in screen_text(app)  # still shown
            second = await asyncio.to_thread(start_daemon, tmp_path, tiny_model_dir, port)
            try:
                await wait_until(pilot, lambda: app.dashboard.connected, 20, "reconnected")
                await wait_until(pilot, lambda: "reconnected" in screen_text(app), 5)
                await wait_until(pilot, lambda: "serving" in screen_text(app), 20)
                assert not main.has_class("-stale") and "STALE" not in screen_text(app)
                # The change history shows the restart and what it dropped.
                await wait_until(
                    pilot,
                    lambda: any(
                        c["source"] == "restart" and "max_num_seqs 6" in str(c["new"])
                        for c in app.dashboard.changes
                    ),
                    10,
                    "restart in the history",
                )
                await scroll_to(pilot, "#changes")
                assert "restart" in screen_text(app)
                # W writes the live values to the file: the next restart keeps them.
                api(second.url).patch("/admin/config", json={"engine": {"max_num_seqs": 5}})
                await pilot.press("W")
                await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5)
                await pilot.press("y")
                config = tmp_path / "cp.toml"
                await wait_until(
                    pilot, lambda: "max_num_seqs = 5" in config.read_text(), 10, "saved"
                )
            finally:
                await asyncio.to_thread(second.stop)

    asyncio.run(main())


def test_token_resolution(tmp_path):
    assert resolve_token("t1", env={"CONTROLPLANE_ADMIN_TOKEN": "t2"}) == "t1"
    assert resolve_token(None, env={"CONTROLPLANE_ADMIN_TOKEN": "t2"}) == "t2"
    (tmp_path / "admin_token").write_text("t3\n")
    assert resolve_token(None, env={"CONTROLPLANE_DATA_DIR": str(tmp_path)}) == "t3"
    assert resolve_token(None, env={"CONTROLPLANE_DATA_DIR": str(tmp_path / "none")}) is None
    parser = argparse.ArgumentParser()
    add_tui_parser(parser.add_subparsers())
    args = parser.parse_args(["tui", "--url", "http://h:1", "--token", "x"])
    assert (args.url, args.token, args.func.__name__) == ("http://h:1", "x", "_cmd_tui")


def test_wrong_token_is_reported_not_fatal(daemon):
    async def main() -> None:
        app = DashboardApp(daemon.url, "wrong-token-wrong-token", reconnect_max_s=0.5)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: "API error 401" in screen_text(app), 5, "401 shown")
            assert "unauthorized" in screen_text(app) and not app.dashboard.connected
            await pilot.press("t", "escape", "g", "a", "d", "n")  # nothing crashes

    asyncio.run(main())


# -- deterministic snapshots --------------------------------------------------------------------
def test_an_answer_arriving_during_shutdown_does_not_crash_the_app():
    # Textual removes a panel's children before the panel, and the workers stop last: the
    # block map answered mid-shutdown found the KV panel but not its map line (NoMatches).
    class LateClient(FakeClient):
        app: DashboardApp | None = None
        answered_late = 0

        async def block_map(self, buckets: int = 48) -> tuple[list[float], list[float]]:
            out = await super().block_map(buckets)
            app = self.app
            if (
                app is not None and app.dashboard.stats_received >= 60
            ):  # loaded: hold until the exit
                while app.is_running:
                    await asyncio.sleep(0)
                await asyncio.sleep(0)  # the pruning has begun
                self.answered_late += 1
            return out

    client = LateClient()
    app = DashboardApp("http://x", "t", client=client, clock=lambda: T0, requests_interval=0.01)
    client.app = app

    async def main() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await loaded(pilot)

    asyncio.run(main())  # a worker's NoMatches would fail the app, and this, with WorkerFailed
    assert client.answered_late >= 1  # the map came back after the app stopped running


def test_a_table_painted_before_it_measured_its_rows_widens_its_columns():
    # Under load the screen can paint a table between add_row and the table's idle handler
    # (which measures the new rows): Textual cached the cells cut at the header labels' widths
    # ("11:0  tui  ops  engin") until the next change, and a suite run failed waiting for
    # "engine.max_num_seqs" on screen. Here the paint is made to come first.
    class NoHistory(FakeClient):
        async def history(self, limit: int = 50) -> dict[str, Any]:
            return {"changes": []}  # no row yet: the columns are as wide as their labels

    app = DashboardApp("http://x", "t", client=NoHistory(), clock=lambda: T0)

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(
                pilot, lambda: app.dashboard.stats_received and app.dashboard.costs, 10, "fake data"
            )
            table = app.query_one(ChangesTable)
            change = {"time": T0, "source": "tui", "actor": "ops",
                      "field": "engine.max_num_seqs", "old": 8, "new": 5}  # fmt: skip
            table.show([change])
            table.render_lines(Region(0, 0, table.size.width, table.size.height))  # the paint
            await wait_until(
                pilot, lambda: "engine.max_num_seqs" in screen_text(app), 5, "the field in full"
            )
            assert "8 → 5" in screen_text(app)

    asyncio.run(main())


@pytest.mark.parametrize(
    "size", [(80, 24), (120, 40), (160, 48)], ids=["80x24", "120x40", "160x48"]
)
def test_snapshot_dashboard(snap_compare, size):
    assert snap_compare(fake_app(), terminal_size=size, run_before=loaded)


def test_snapshot_dashboard_no_color(snap_compare, monkeypatch):
    """NO_COLOR: severity still shows (critical values in reverse video, warnings in bold)."""
    monkeypatch.setenv("NO_COLOR", "1")
    assert snap_compare(fake_app(), terminal_size=(80, 24), run_before=loaded)


def test_snapshot_requests_grouped_by_key(snap_compare):
    async def grouped(pilot: Any) -> None:
        await loaded(pilot)
        await pilot.press("v")
        await wait_until(pilot, lambda: "by key" in screen_text(pilot.app), 5, "grouped")
        await pilot.pause(0.1)

    assert snap_compare(fake_app(), terminal_size=(120, 40), run_before=grouped)


def test_snapshot_tune_form(snap_compare):
    async def open_form(pilot: Any) -> None:
        await loaded(pilot)
        await pilot.press("t")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, TuneScreen), 5, "form")
        # The cursor blinks every 0.5 s: on a loaded machine the shot caught it either way.
        for field in pilot.app.screen.query(Input):
            field.cursor_blink = False
        await pilot.pause(0.2)

    assert snap_compare(fake_app(), terminal_size=(80, 24), run_before=open_form)


def test_batch_panel_line_for_structured_outputs():
    from controlplane.tui.panels import structured_line

    assert "none" in structured_line({"structured_share": None, "grammar_states": 0})
    line = structured_line(
        {
            "structured_share": 0.25,
            "grammar_states": 3,
            "grammar_mask_ms_per_step": 1.26,
            "grammar_mask_wait_ms_per_step": 0.04,
        }
    )
    plain = re.sub(r"\[/?[a-z ]*\]", "", line)  # without rich markup
    assert plain == "structured 25% of requests  mask 1.3 ms/step (wait 0.0)", plain
