"""The dashboard in Textual's idioms: `?` lists the keys from the bindings themselves, the `:`
commands are in the command palette too, and the kernels' state (`kernels: ok | fallback:
<reason>`, `compiled_step`) is shown from /admin/stats, old daemons' fields included. Pure
parts directly, the rest under Textual's pilot with deterministic data."""

from __future__ import annotations

import asyncio
from typing import Any

from rich.text import Text
from textual.binding import Binding

from controlplane.tui.dashboard import DashboardScreen
from controlplane.tui.dashboard_app import DashboardApp
from controlplane.tui.help import HelpScreen, help_rows
from controlplane.tui.kernels import kernels_line, kernels_status
from controlplane.tui.tables import RequestsTable
from tests.tui.support import T0, FakeClient, fake_app, fake_stats, loaded, screen_text, wait_until


def plain(markup: str) -> str:
    return Text.from_markup(markup).plain


# -- the kernels ------------------------------------------------------------------------------
def test_kernels_status_from_the_kernels_field_or_an_older_daemons_cpu_kernels():
    assert kernels_status({"kernels": {"status": "ok", "reason": None}}) == ("ok", None)
    fallback = {"status": "fallback", "reason": "no C++ compiler on PATH"}
    assert kernels_status({"kernels": fallback}) == ("fallback", "no C++ compiler on PATH")
    # The `kernels` field wins over `cpu_kernels` when a daemon sends both.
    both = {"kernels": fallback, "cpu_kernels": {"state": "ready", "reason": ""}}
    assert kernels_status(both) == ("fallback", "no C++ compiler on PATH")
    # A daemon without `kernels`: its `cpu_kernels` state says the same.
    assert kernels_status({"cpu_kernels": {"state": "ready", "reason": ""}}) == ("ok", None)
    failed = {"cpu_kernels": {"state": "failed", "reason": "ninja not found"}}
    assert kernels_status(failed) == ("fallback", "ninja not found")
    timeout = {"cpu_kernels": {"state": "lock_timeout", "reason": ""}}
    assert kernels_status(timeout) == ("fallback", "lock_timeout")  # no reason: the state
    assert kernels_status({"cpu_kernels": {"state": "building", "reason": ""}}) == (
        "building",
        None,
    )
    # Never asked for (not a CPU engine), or not reported at all: nothing to say.
    assert kernels_status({"cpu_kernels": {"state": "unused", "reason": ""}}) is None
    assert kernels_status({"cpu_kernels": None}) is None
    assert kernels_status({}) is None and kernels_status(None) is None


def test_kernels_line_says_ok_or_the_fallbacks_reason_and_the_compiled_step():
    ok = {"kernels": {"status": "ok", "reason": None}, "compiled_step": "ready"}
    assert plain(kernels_line(ok)) == "kernels: ok\ncompiled_step: ready"
    # A reason with brackets is shown as it is, not read as markup.
    fell = {"kernels": {"status": "fallback", "reason": "build failed [g++]"},
            "compiled_step": "off"}  # fmt: skip
    assert plain(kernels_line(fell)) == "kernels: fallback: build failed [g++]\ncompiled_step: off"
    assert plain(kernels_line({"compiled_step": "warming"})) == "compiled_step: warming"
    assert kernels_line({}) == "" and kernels_line(None) == ""
    # The compiled step's ceiling, and a live max_num_seqs above it (those steps run eagerly).
    ready = {"compiled_step": "ready", "compiled_max_rows": 64, "max_num_seqs": 64}
    assert plain(kernels_line(ready)) == "compiled_step: ready, up to 64 rows"
    raised = {**ready, "max_num_seqs": 96}
    assert plain(kernels_line(raised)) == (
        "compiled_step: ready, up to 64 rows (max_num_seqs 96: larger steps eager)"
    )
    assert plain(kernels_line({**raised, "compiled_step": "failed"})) == "compiled_step: failed"


class FallbackClient(FakeClient):
    """A daemon whose kernels fell back (no compiler) and whose compiled step is off."""

    async def events(self, interval: float = 0.5):
        for i in range(60):
            stats = fake_stats(i * 5)
            stats["kernels"] = {"status": "fallback", "reason": "no C++ compiler on PATH"}
            stats["compiled_step"] = "off"
            yield "stats", stats
        await asyncio.Event().wait()


class OlderDaemonClient(FakeClient):
    """A daemon from before the `kernels` field: `cpu_kernels` and `compiled_step` only."""

    async def events(self, interval: float = 0.5):
        for i in range(60):
            stats = fake_stats(i * 5)
            stats["cpu_kernels"] = {"state": "ready", "reason": ""}
            stats["compiled_step"] = "ready"
            yield "stats", stats
        await asyncio.Event().wait()


def header_and_batch(client: FakeClient) -> tuple[str, str]:
    """The header line and the batch panel's text, as drawn."""
    app = DashboardApp("http://127.0.0.1:8000", "token", client=client, clock=lambda: T0)
    out: dict[str, str] = {}

    async def main() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            await loaded(pilot)
            out["header"] = screen_text(app).splitlines()[0]
            out["batch"] = str(app.dashboard.query_one("#batch-body").render())

    asyncio.run(main())
    return out["header"], out["batch"]


def test_a_kernels_fallback_shows_in_the_header_and_the_batch_panel_with_its_reason():
    header, batch = header_and_batch(FallbackClient())
    assert "kernels fallback" in header
    assert batch.splitlines()[-2:] == [
        "kernels: fallback: no C++ compiler on PATH",
        "compiled_step: off",
    ]


def test_an_older_daemons_cpu_kernels_read_as_ok_and_the_header_keeps_quiet():
    header, batch = header_and_batch(OlderDaemonClient())
    assert "kernels" not in header  # only a fallback earns the header's room
    assert batch.splitlines()[-2:] == ["kernels: ok", "compiled_step: ready"]


def test_a_daemon_reporting_neither_gets_no_kernels_line():
    _, batch = header_and_batch(FakeClient())
    assert "kernels" not in batch and "compiled_step" not in batch
    assert batch.splitlines()[-1].startswith("structured outputs")


# -- `?` from the bindings ---------------------------------------------------------------------
def test_help_rows_come_from_the_bindings_tooltips_sharing_a_row_when_they_share_one():
    bindings = [
        Binding("f", "fleet", "Fleet", tooltip="the fleet"),
        Binding("s", "suspend", tooltip="suspend / unsuspend"),
        Binding("u", "unsuspend", tooltip="suspend / unsuspend"),
        Binding("z", "hidden"),  # no tooltip: not listed
        *(Binding(str(i), f"jump({i})", tooltip="a panel") for i in range(1, 9)),
        *(Binding(k, "move", tooltip="moves") for k in "jkgG"),
        Binding("escape,q", "close", tooltip="close"),
    ]
    assert help_rows(bindings, lambda b: b.key.upper()) == [
        ("F", "the fleet"),
        ("S / U", "suspend / unsuspend"),
        ("1 .. 8", "a panel"),
        ("J K G G", "moves"),
        ("ESCAPE / Q", "close"),
    ]


def test_every_dashboard_key_has_a_tooltip_so_help_lists_it():
    missing = [b.key for b in (*DashboardScreen.BINDINGS, *RequestsTable.BINDINGS)
               if not b.tooltip]  # fmt: skip
    assert missing == []


def test_question_mark_lists_the_dashboards_bindings():
    async def main() -> None:
        app = fake_app()
        async with app.run_test(size=(120, 50)) as pilot:
            await loaded(pilot)
            await pilot.press("question_mark")
            await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), 5, "help")
            rows = dict(app.screen.keys)
            # Each from a binding's tooltip: the dashboard's, the table's, the app's.
            assert rows["?"] == "this help"
            assert rows["s / u"].startswith("suspend / unsuspend")
            assert rows["1 .. 8"].startswith("jump to a panel")
            assert rows["j k g G"].startswith("down, up, top, bottom")
            assert rows["l"] == "switch light / dark theme"
            await pilot.press("escape")
            await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen), 5, "closed")

    asyncio.run(main())


# -- `:` commands in the palette ---------------------------------------------------------------
def test_the_palette_runs_a_command_typed_whole_and_asks_for_a_missing_argument():
    async def main() -> None:
        app = fake_app()
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot)
            await pilot.press("ctrl+p", *"cost 10m")
            await wait_until(pilot, lambda: ":cost 10m" in screen_text(app), 5, "the hit")
            await pilot.press("enter")
            dashboard = app.dashboard
            await wait_until(pilot, lambda: dashboard.cost_window == "10m", 5, "window set")
            assert dashboard.query_one("#cost").border_title == "Cost, last 10m (instance)"
            # abort-key needs a KEY: choosing it opens the `:` prompt with its name typed.
            await pilot.press("ctrl+p", *"abort-key")
            await wait_until(pilot, lambda: ":abort-key KEY" in screen_text(app), 5, "the hit")
            await pilot.press("enter")
            await wait_until(
                pilot,
                lambda: screen_text(app).splitlines()[-2].strip().startswith(":abort-key"),
                5,
                "the prompt",
            )
            assert dashboard.query_one("#prompt").value == "abort-key "

    asyncio.run(main())


def test_colon_completes_a_command_name_as_typed():
    async def main() -> None:
        app = fake_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await loaded(pilot)
            await pilot.press("colon", *"sus")
            prompt: Any = app.dashboard.query_one("#prompt")
            # Typed `sus`, shown `:suspend`: the rest of the name ahead of the cursor.
            await wait_until(
                pilot,
                lambda: screen_text(app).splitlines()[-2].strip().startswith(":suspend"),
                5,
                "the name completed",
            )
            assert prompt.value == "sus"
            await pilot.press("right", *" bad-tenant", "enter")  # the right arrow takes it
            await wait_until(pilot, lambda: "Suspend API key bad-tenant" in screen_text(app), 5)
            await pilot.press("n")

    asyncio.run(main())
