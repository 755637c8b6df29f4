"""Prefix caching and speculative decoding as operators see them: Prometheus, /admin/stats, the
audited cache reset and the TUI form, against a real daemon on loopback (tiny model)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.tui.confirm import ConfirmScreen
from controlplane.tui.dashboard_app import DashboardApp
from controlplane.tui.history import fmt_pct
from controlplane.tui.tune import TuneScreen
from harness import DaemonProcess, InProcessDaemon, wait_rows
from tests.admin.test_admin_api import TOKEN, admin_cfg
from tests.tui.test_tui import screen_text, wait_until

BS = 16  # the engine's default block size
SHARED = [(7 * i) % 900 + 10 for i in range(5 * BS)]  # five full blocks


@pytest.fixture(scope="module")
def daemon(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(admin=True, engine={"max_num_seqs": 8, "max_model_len": 1024})


def complete(c: httpx.Client, prompt: list, max_tokens: int = 4) -> dict:
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = c.post("/v1/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def metric(c: httpx.Client, name: str, **labels: str) -> float:
    text = c.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} not exposed")


def test_prefix_cache_hits_show_in_metrics_stats_and_usage(daemon):
    with daemon.client(TOKEN) as c:
        first = complete(c, [*SHARED, 1, 2, 3])
        second = complete(c, [*SHARED, 4, 5])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BS

        queries = metric(c, "controlplane:prefix_cache_queries_total")
        hits = metric(c, "controlplane:prefix_cache_hits_total")
        assert hits >= 5 * BS and hits <= queries
        assert metric(c, "controlplane:kv_cache_cached_blocks") >= 5
        assert metric(c, "controlplane:kv_cache_evictable_blocks") >= 5

        stats = c.get("/admin/stats", params={"block_map": 8}).json()
        assert 0 < stats["prefix_cache_hit_rate"] <= 1
        assert stats["kv_blocks_cached"] >= 5 and stats["kv_blocks_evictable"] >= 5
        assert stats["enable_prefix_caching"] is True
        # The map shows the cached, unused blocks apart from the (no) blocks in use.
        assert set(stats["kv_block_map"]) == {0.0}
        assert sum(stats["kv_block_map_cached"]) > 0

        # The SSE stream's snapshots are the same payload: the same figures, nothing running.
        event = first_stats_event(c)
        for key in ("prefix_cache_hit_rate", "kv_blocks_cached", "kv_blocks_evictable"):
            assert event[key] == stats[key], key
        assert {"speculation", "spec_acceptance_rate", "spec_mean_accepted_len"} <= set(event)
        assert event["speculative_num_tokens"] == 3


def first_stats_event(c: httpx.Client) -> dict:
    with c.stream("GET", "/admin/events", params={"interval": 0.2}) as r:
        event = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event == "stats":
                return json.loads(line.split(":", 1)[1])
    raise AssertionError("no stats event")


def test_cache_reset_is_authenticated_audited_and_empties_the_cache(daemon):
    with daemon.client(TOKEN) as c:
        complete(c, [*SHARED, 9, 9])
        before = c.get("/admin/stats").json()["kv_blocks_evictable"]
        assert before > 0
        anonymous = httpx.post(daemon.url + "/admin/cache/reset", timeout=30)
        assert anonymous.status_code == 401
        assert c.get("/admin/stats").json()["kv_blocks_evictable"] == before  # nothing dropped

        r = c.post("/admin/cache/reset")
        assert r.status_code == 200, r.text
        assert r.json() == {"dropped_blocks": before}
        stats = c.get("/admin/stats").json()
        assert stats["kv_blocks_evictable"] == 0 and stats["kv_blocks_cached"] == 0
        entry = c.get("/admin/config/history", params={"limit": 5}).json()["changes"][0]
        assert entry["field"] == "engine.prefix_cache_reset"
        assert (entry["old_value"], entry["new_value"]) == (before, 0)
        assert (entry["source"], entry["actor"]) == ("api", "ops")
        # Cold again: the same prompt computes everything.
        again = complete(c, [*SHARED, 9, 9])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_speculation_counters_and_state_follow_live_changes(daemon):
    repetitive = [11, 12, 13, 14, 15, 16] * 8
    with daemon.client(TOKEN) as c:
        r = c.patch(
            "/admin/config",
            json={"engine": {"speculative_method": "ngram", "speculative_ngram_min": 1}},
        )
        assert r.status_code == 200, r.text
        try:
            done = complete(c, repetitive, max_tokens=24)
            stats = c.get("/admin/stats").json()
            assert stats["speculative_method"] == "ngram"
            assert stats["speculation"] == "active"
            proposed = metric(c, "controlplane:spec_decode_num_draft_tokens_total")
            accepted = metric(c, "controlplane:spec_decode_num_accepted_tokens_total")
            assert proposed > 0 and 0 <= accepted <= proposed
            assert stats["spec_acceptance_rate"] == pytest.approx(accepted / proposed)
            assert 1 <= stats["spec_mean_accepted_len"] <= 1 + 3  # k = 3
            first = metric(
                c, "controlplane:spec_decode_num_accepted_tokens_per_pos_total", position="0"
            )
            assert first <= metric(c, "controlplane:spec_decode_num_drafts_total")
            assert metric(c, "controlplane:spec_decode_state", state="active") == 1
            # The request's row counts its drafts (the only speculating request so far).
            (row,) = wait_rows(
                daemon.cfg.store_url,
                lambda rs: rs and rs[0]["status"] == "success",
                where=f"id = '{done['id']}'",
            )
            assert (row["draft_tokens"], row["accepted_draft_tokens"]) == (proposed, accepted)

            # Above the batch limit speculation pauses: two prompts run at once, the limit is 1.
            r = c.patch("/admin/config", json={"engine": {"speculative_max_batch_size": 1}})
            assert r.status_code == 200, r.text
            pair = threading.Thread(
                target=complete, args=(c, [repetitive, repetitive[::-1]], 200), daemon=True
            )
            pair.start()
            deadline = time.monotonic() + 30
            while c.get("/admin/stats").json()["speculation"] != "paused":
                assert time.monotonic() < deadline, "speculation never paused"
                time.sleep(0.02)
            assert metric(c, "controlplane:spec_decode_state", state="paused") == 1
            pair.join(60)
        finally:
            c.patch(
                "/admin/config",
                json={"engine": {"speculative_method": "off", "speculative_max_batch_size": 8}},
            )


def kv_line(c: httpx.Client) -> tuple[str, str]:
    """The KV panel's cache line for the daemon's current stats."""
    stats = c.get("/admin/stats").json()
    assert stats["prefix_cache_hit_rate"] is not None and stats["kv_blocks_cached"] > 0
    return (
        f"hit {fmt_pct(stats['prefix_cache_hit_rate'])}  █ cached {stats['kv_blocks_cached']}",
        f"({stats['kv_blocks_evictable']} idle, reusable)",
    )


def shows_kv_line(app: DashboardApp, c: httpx.Client) -> bool:
    # The detail panels sit below the tables at 120 columns: scrolled to, as an operator would.
    app.query_one("#main").scroll_to_widget(app.query_one("#kv"), animate=False, top=True)
    text = screen_text(app)
    return all(part in text for part in kv_line(c))


def test_tui_tunes_speculation_shows_refusals_and_resets_the_cache(daemon):
    c = daemon.client(TOKEN)
    complete(c, [*SHARED, 8, 8])  # something cached to reset

    async def main() -> None:
        app = DashboardApp(daemon.url, TOKEN)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_until(pilot, lambda: app.dashboard.fields, 5, "config loaded")
            # The KV panel shows the daemon's hit rate (last minute) and its cached blocks.
            await wait_until(pilot, lambda: shows_kv_line(app, c), 10, "hit rate shown")
            # Waited for, like every other line: a capture of the compositor between two
            # refreshes can hold the header alone (seen once in CI, under load).
            await wait_until(pilot, lambda: "speculation off" in screen_text(app), 5, "spec off")
            await pilot.press("t")
            form = await wait_until(
                pilot, lambda: isinstance(app.screen, TuneScreen) and app.screen
            )
            form.query_one("#in-speculative_method").value = "ngram"
            form.query_one("#in-speculative_num_tokens").value = "5"
            form.query_one("#in-enable_prefix_caching").value = "off"
            assert form.changes() == {
                "engine.speculative_num_tokens": 5,
                "engine.speculative_method": "ngram",
                "engine.enable_prefix_caching": False,
            }
            await pilot.press("ctrl+s")
            status = form.query_one("#tune-status")
            await wait_until(pilot, lambda: "applied" in str(status.render()), 10, "applied")
            fields = c.get("/admin/config").json()["fields"]
            assert fields["engine.speculative_method"]["value"] == "ngram"
            assert fields["engine.speculative_num_tokens"]["value"] == 5
            assert fields["engine.enable_prefix_caching"]["value"] is False

            # draft without a draft model: refused, the reason inline, nothing changed.
            form.query_one("#in-speculative_method").value = "draft"
            await pilot.press("ctrl+s")
            err = form.query_one("#err-speculative_method")
            await wait_until(
                pilot, lambda: "speculative_draft_model" in str(err.render()), 10, "inline error"
            )
            fields = c.get("/admin/config").json()["fields"]
            assert fields["engine.speculative_method"]["value"] == "ngram"
            await pilot.press("escape")
            # The speculation line follows the new settings once a step speculates.
            await asyncio.to_thread(complete, c, [11, 12, 13, 14, 15, 16] * 8, 24)
            spec = re.compile(r"spec ngram k=5 active \d+% len \d\.\d\d")
            await wait_until(pilot, lambda: spec.search(screen_text(app)), 10, "spec line")
            await wait_until(pilot, lambda: "prefix caching off" in screen_text(app), 10)

            # The cache reset key asks first, then resets (audited as the TUI's).
            before = c.get("/admin/stats").json()["kv_blocks_evictable"]
            assert before > 0
            await pilot.press("c")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5, "confirm")
            await pilot.press("y")
            await wait_until(
                pilot,
                lambda: c.get("/admin/stats").json()["kv_blocks_evictable"] == 0,
                10,
                "cache reset",
            )

    try:
        asyncio.run(main())
        entry = c.get("/admin/config/history", params={"limit": 1}).json()["changes"][0]
        assert entry["field"] == "engine.prefix_cache_reset"
        assert entry["source"] == "tui"
    finally:
        c.patch(
            "/admin/config",
            json={"engine": {"speculative_method": "off", "enable_prefix_caching": True}},
        )
        c.close()


def test_cache_reset_on_a_dead_engine_is_503_and_not_audited(make_daemon):
    # dead_exit_s: it answers `dead` all along the test rather than exiting 5 s after.
    d = make_daemon(admin=True, engine={"max_model_len": 256}, server={"dead_exit_s": 300})
    engine = d.daemon.aengine.engine

    def failing_step():
        raise RuntimeError("simulated device fault")

    engine.step = failing_step  # a real failure inside the engine thread: the loop dies
    with d.client(TOKEN) as c:
        body = {"model": "model", "prompt": "x", "max_tokens": 4}
        assert c.post("/v1/completions", json=body).status_code == 503
        assert c.get("/admin/stats").json()["state"] == "dead"

        r = c.post("/admin/cache/reset")
        assert r.status_code == 503, r.text
        assert "engine" in r.json()["error"]["message"]
        changes = c.get("/admin/config/history").json()["changes"]
        assert all(e["field"] != "engine.prefix_cache_reset" for e in changes)


def test_cache_reset_while_loading_is_503(tmp_path):
    # No model configured: the daemon loads SmolLM2 or the demo model (seconds), answering
    # meanwhile; the admin token is checked first, then the missing engine named.
    path = admin_cfg(tmp_path, None, store={"record_requests": False})
    d = DaemonProcess.start(path, wait_ready=False)
    try:
        assert httpx.post(d.url + "/admin/cache/reset", timeout=10).status_code == 401
        r = httpx.post(
            d.url + "/admin/cache/reset", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        )
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "loading"
        assert "not loaded" in r.json()["error"]["message"]
    finally:
        d.stop(signal.SIGKILL)  # not waiting for the load: nothing here needs a clean exit
