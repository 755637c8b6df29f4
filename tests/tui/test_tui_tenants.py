"""The tenants screen (`K`, `:keys`) under Pilot against a real in-process daemon (tiny model,
SQLite, real HTTP): a key created from the form with its secret shown once in a dialog that
escape does not close, its requests and its 429 in the table (worst first), its limits and
class changed (PATCH, audited as tui; a bad value's 422 shown in the form), rotated (the old
secret stops, the new one works) and revoked, each asked first; plus a snapshot on fixed data."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from controlplane.tui.confirm import ConfirmScreen
from controlplane.tui.dashboard_app import DashboardApp
from controlplane.tui.tenants import KeyFormScreen, KeysTable, SecretScreen, TenantsScreen
from tests.admin.test_admin_api import MODEL, TOKEN
from tests.tui.support import T0, FakeClient, loaded, screen_text, wait_until
from tests.tui.test_tui_oncall import make_app

CONFIG_KEY = {"name": "from-file", "key": "sk-from-file-0123456789"}


@pytest.fixture(scope="module")
def served(make_module_daemon):
    return make_module_daemon(
        admin=True,
        engine={"max_num_seqs": 4, "max_model_len": 256},
        api_keys=[CONFIG_KEY],
    )


def complete(url: str, secret: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=60,
    )


def api_key(url: str, name: str) -> dict[str, Any]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        return next(k for k in c.get("/admin/keys").json()["keys"] if k["name"] == name)


async def fill(pilot: Any, form: KeyFormScreen, values: dict[str, str]) -> None:
    for field, text in values.items():
        form.query_one(f"#kf-{field}").value = text
    await pilot.pause()


async def secret_shown(pilot: Any) -> str:
    app = pilot.app
    screen = await wait_until(
        pilot, lambda: isinstance(app.screen, SecretScreen) and app.screen, 15, "the secret"
    )
    assert screen.secret.startswith("cp-") and screen.secret in screen_text(app)
    await pilot.press("escape")  # does not close it: the operator must dismiss it
    await pilot.pause(0.1)
    assert app.screen is screen
    await pilot.press("enter")  # the focused button: "I have copied it"
    await wait_until(pilot, lambda: isinstance(app.screen, TenantsScreen), 5, "dismissed")
    return screen.secret


def test_create_watch_change_rotate_and_revoke_a_key(served):
    url = served.url

    async def main() -> None:
        app = make_app(url)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("K")
            screen = await wait_until(
                pilot, lambda: isinstance(app.screen, TenantsScreen) and app.screen, 5
            )
            table = screen.query_one(KeysTable)
            await wait_until(pilot, lambda: "from-file" in screen_text(app), 10, "the keys")

            # Create: the form, then the secret once.
            await pilot.press("n")
            form = await wait_until(
                pilot, lambda: isinstance(app.screen, KeyFormScreen) and app.screen, 5
            )
            await fill(pilot, form, {"name": "team-a", "owner": "alice",
                                     "requests_per_minute": "2", "budget_usd": "50"})  # fmt: skip
            await pilot.press("ctrl+s")
            secret = await secret_shown(pilot)
            made = api_key(url, "team-a")
            assert made["owner"] == "alice" and made["limits"]["requests_per_minute"] == 2
            assert made["budget"]["budget_usd"] == 50

            # Its traffic, then a 429: it comes first (worst), with the refusal in red.
            assert complete(url, secret).status_code == 200
            assert complete(url, secret).status_code == 200
            assert complete(url, secret).status_code == 429
            assert complete(url, CONFIG_KEY["key"]).status_code == 200
            await wait_until(
                pilot,
                lambda: (
                    table.sorted_rows()
                    and table.sorted_rows()[0]["name"] == "team-a"
                    and table.sorted_rows()[0]["usage"]["throttled_total"] == 1
                ),
                10,
                "team-a first",
            )
            text = screen_text(app)
            assert "1 (1/min)" in text and "alice" in text and "$50" in text
            table.move_cursor(row=0)

            # Change: a bad value's 422 shows in the form, which stays open; then a good one.
            await pilot.press("e")
            form = await wait_until(
                pilot, lambda: isinstance(app.screen, KeyFormScreen) and app.screen, 5
            )
            assert form.query_one("#kf-requests_per_minute").value == "2"
            await fill(pilot, form, {"requests_per_minute": "0"})
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: "422" in screen_text(app), 10, "the API's error")
            assert "requests_per_minute" in screen_text(app) and app.screen is form
            await fill(pilot, form, {"requests_per_minute": "100", "priority_class": "3"})
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: isinstance(app.screen, TenantsScreen), 10, "saved")
            changed = api_key(url, "team-a")
            assert changed["limits"]["requests_per_minute"] == 100
            assert changed["priority_class"] == 3
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                history = c.get("/admin/config/history").json()["changes"]
            entry = next(e for e in history if e["field"] == "api_keys.team-a.priority_class")
            assert entry["source"] == "tui" and entry["new_value"] == 3

            # Rotate, asked first: the old secret stops, the new one works.
            row = next(i for i, k in enumerate(table.sorted_rows()) if k["name"] == "team-a")
            table.move_cursor(row=row)
            await pilot.press("R")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5)
            await pilot.press("y")
            rotated = await secret_shown(pilot)
            assert rotated != secret
            assert complete(url, secret).status_code == 401
            assert complete(url, rotated).status_code == 200

            # Revoke: No leaves it be; Yes revokes it.
            row = next(i for i, k in enumerate(table.sorted_rows()) if k["name"] == "team-a")
            table.move_cursor(row=row)
            await pilot.press("x")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5)
            await pilot.press("n")
            await pilot.pause(0.2)
            assert api_key(url, "team-a")["state"] == "active"
            await pilot.press("x")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5)
            await pilot.press("y")
            await wait_until(pilot, lambda: api_key(url, "team-a")["state"] == "revoked", 10)
            assert complete(url, rotated).status_code == 401
            await wait_until(pilot, lambda: "revoked" in screen_text(app), 10, "shown revoked")

            # A config file key is read-only here; o sorts by name; escape goes back.
            row = next(i for i, k in enumerate(table.sorted_rows()) if k["name"] == "from-file")
            table.move_cursor(row=row)
            await pilot.press("x")
            await pilot.pause(0.1)
            assert isinstance(app.screen, TenantsScreen)  # nothing asked: not managed here
            await pilot.press("o")
            assert table.sort == "name"
            names = [k["name"] for k in table.sorted_rows()]
            assert names == sorted(names)
            await pilot.press("escape")
            await wait_until(pilot, lambda: app.screen is app.dashboard, 5, "back")

            # `:keys` reaches it too.
            await pilot.press("colon", *"keys", "enter")
            await wait_until(pilot, lambda: isinstance(app.screen, TenantsScreen), 5, ":keys")

    asyncio.run(main())


# -- the snapshot, on fixed data -------------------------------------------------------------
def _key(name: str, owner: str | None, usage: dict[str, Any], **extra: Any) -> dict[str, Any]:
    base = {"requests_per_minute": 0, "tokens_per_minute": 0, "share": None, "in_flight": 0,
            "throttled_last_minute": 0, "throttled_total": 0, "throttled": {}}  # fmt: skip
    return {"name": name, "owner": owner, "source": "table", "state": "active",
            "priority_class": 0, "usage": {**base, **usage}, **extra}  # fmt: skip


class KeysFake(FakeClient):
    async def keys(self, sort: str | None = None) -> dict[str, Any]:
        budget = {"budget_usd": 50.0, "budget_period": "month", "budget_action": "reject"}
        return {
            "keys": [
                _key(
                    "batch-jobs",
                    "data",
                    {
                        "requests_per_minute": 40,
                        "tokens_per_minute": 91000,
                        "share": 0.82,
                        "in_flight": 12,
                    },
                    priority_class=5,
                ),
                _key(
                    "chat-app",
                    "web",
                    {
                        "requests_per_minute": 61,
                        "tokens_per_minute": 17500,
                        "share": 0.16,
                        "in_flight": 3,
                        "throttled_last_minute": 4,
                        "throttled_total": 9,
                        "throttled": {"requests_per_minute": 9},
                    },
                    budget={**budget, "spend_usd": 41.5, "use": 0.83, "state": "soft_threshold"},
                ),
                _key(
                    "intern",
                    None,
                    {"requests_per_minute": 2, "tokens_per_minute": 2200, "share": 0.02},
                    budget={**budget, "budget_usd": 5.0, "spend_usd": 0.25},
                ),
                _key("old-app", "web", {}, state="revoked"),
                {
                    "name": "from-file",
                    "source": "config",
                    "state": "active",
                    "suspended": True,
                    "priority_class": 0,
                    "usage": {
                        **_key("x", None, {})["usage"],
                        "throttled_total": 2,
                        "throttled": {"suspended": 2},
                    },
                },
            ],
            "sort": "worst",
            "key_refresh_s": 5.0,
        }


async def tenants_loaded(pilot: Any) -> None:
    await loaded(pilot)
    await pilot.press("K")
    app = pilot.app
    await wait_until(
        pilot, lambda: isinstance(app.screen, TenantsScreen) and app.screen.fetches >= 1, 10
    )
    await pilot.pause(0.1)


def test_snapshot_tenants_screen(snap_compare):
    app = DashboardApp("http://127.0.0.1:8000", "token", client=KeysFake(), clock=lambda: T0)
    assert snap_compare(app, terminal_size=(120, 30), run_before=tenants_loaded)
