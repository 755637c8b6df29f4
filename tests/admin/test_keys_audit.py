"""Acting on a tenant and trusting state across restarts, against real in-process daemons
(tiny model, real SQLite, real HTTP): suspending an API key, aborting a key's requests, the
persistent audit of drain / resume / abort, the live values a restart drops, and saving live
values into the config file."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from controlplane.client.admin import AdminClient
from controlplane.config import load_config
from harness import InProcessDaemon, wait_rows
from tests.admin.test_admin_api import MODEL, TOKEN, admin_cfg, loadgen

KEYS = [{"name": "good", "key": "sk-good-0123456789"}, {"name": "bad-tenant", "key": "sk-bad-987"}]
SOURCE = {"X-Controlplane-Source": "tui"}


def _complete(d: InProcessDaemon, key: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **extra}
    return httpx.post(
        d.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def _history(c: httpx.Client, field: str | None = None) -> list[dict[str, Any]]:
    params = {"limit": 1000, **({"field": field} if field else {})}
    return c.get("/admin/config/history", params=params).json()["changes"]


def _client_call(d: InProcessDaemon, method: str, *args: Any) -> dict[str, Any]:
    """One AdminClient call (the dashboard's client: source tui)."""

    async def call() -> dict[str, Any]:
        client = AdminClient(d.url, TOKEN)
        try:
            return await getattr(client, method)(*args)
        finally:
            await client.aclose()

    return asyncio.run(call())


def _wait_live(c: httpx.Client, ok, timeout: float = 20) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        live = c.get("/admin/requests", params={"limit": 1}).json()["live"]
        if ok(live):
            return live
        assert time.monotonic() < deadline, f"live requests never matched: {live}"
        time.sleep(0.05)


def test_suspended_key_gets_403_other_key_served_and_audited(make_daemon):
    d = make_daemon(
        admin=True,
        api_keys=KEYS,
        engine={"max_num_seqs": 8, "max_model_len": 1024},
        server={"config_settle_s": 0.1},
    )
    path = d.config_path
    c = d.client(TOKEN)
    good, bad = KEYS[0]["key"], KEYS[1]["key"]
    assert _complete(d, bad).status_code == 200
    # A request of the key already running when it is suspended goes on to its end.
    running: dict[str, httpx.Response] = {}
    t = threading.Thread(
        target=lambda: running.update(
            r=_complete(d, bad, max_tokens=600, ignore_eos=True, prompt="long")
        )
    )
    t.start()
    _wait_live(c, lambda live: any(r["api_key_name"] == "bad-tenant" for r in live))

    answer = c.post("/admin/keys/bad-tenant/suspend")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "api_key_name": "bad-tenant",
        "suspended": True,
        "changed": True,
        "suspended_keys": ["bad-tenant"],
    }
    refused = _complete(d, bad)
    assert refused.status_code == 403
    err = refused.json()["error"]
    assert err["message"] == "api key 'bad-tenant' is suspended by the operator"
    assert err["type"] == "permission_error" and err["code"] == "api_key_suspended"
    assert _complete(d, good).status_code == 200  # the other key is served
    t.join(60)
    assert running["r"].status_code == 200
    assert running["r"].json()["choices"][0]["finish_reason"] == "length"
    fields = c.get("/admin/config").json()["fields"]
    suspended = fields["server.suspended_keys"]
    assert (suspended["value"], suspended["source"], suspended["live"]) == (
        ["bad-tenant"],
        "api",
        True,
    )

    # Validation: an unknown name is a 422 naming the field and the name; 404 on the route.
    bad_patch = c.patch("/admin/config", json={"server": {"suspended_keys": ["nobody"]}})
    assert bad_patch.status_code == 422
    assert bad_patch.json()["error"]["param"] == "server.suspended_keys"
    assert "'nobody' is not a configured API key" in bad_patch.json()["error"]["message"]
    missing = c.post("/admin/keys/nobody/suspend")
    assert missing.status_code == 404 and "'nobody'" in missing.json()["error"]["message"]

    # A config file reload of another key keeps the suspension (a live field).
    path.write_text(path.read_text().replace("max_num_seqs = 8", "max_num_seqs = 6"))
    deadline = time.monotonic() + 15
    while c.get("/admin/config").json()["fields"]["engine.max_num_seqs"]["value"] != 6:
        assert time.monotonic() < deadline, "the file edit was never applied"
        time.sleep(0.1)
    assert _complete(d, bad).status_code == 403

    # The dashboard's client unsuspends (source tui): served again.
    body = _client_call(d, "unsuspend_key", "bad-tenant")
    assert body["suspended"] is False and body["suspended_keys"] == []
    assert _complete(d, bad).status_code == 200
    audit = [
        (h["source"], h["actor"], h["old_value"], h["new_value"])
        for h in _history(c, "server.suspended_keys")
    ]
    assert audit == [("tui", "ops", ["bad-tenant"], []), ("api", "ops", [], ["bad-tenant"])]


def test_abort_key_aborts_exactly_that_keys_live_requests(make_daemon):
    d = make_daemon(admin=True, api_keys=KEYS, engine={"max_num_seqs": 16, "max_model_len": 1024})
    path = d.config_path
    c = d.client(TOKEN)
    common = ["--rate", "0", "--requests", "4", "--prompt-len", "8-16", "--output-len", "900-900"]
    procs = [
        loadgen(d.url, *common, "--api-key", KEYS[0]["key"], "--model", MODEL),
        loadgen(d.url, *common, "--api-key", KEYS[1]["key"], "--model", MODEL),
    ]
    try:

        def both(live: list[dict[str, Any]]) -> bool:
            names = [r["api_key_name"] for r in live]
            return names.count("good") == 4 and names.count("bad-tenant") == 4

        live = _wait_live(c, both, timeout=30)
        bad_ids = {r["id"] for r in live if r["api_key_name"] == "bad-tenant"}
        good_ids = {r["id"] for r in live if r["api_key_name"] == "good"}
        r = c.post("/admin/keys/bad-tenant/abort")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["api_key_name"] == "bad-tenant" and body["aborted"] == 4
        assert set(body["ids"]) == bad_ids
        # The other key's requests keep running.
        after = c.get("/admin/requests", params={"limit": 1}).json()["live"]
        assert {r["id"] for r in after} == good_ids
        assert c.post("/admin/keys/nobody/abort").status_code == 404
        again = c.post("/admin/keys/bad-tenant/abort", headers=SOURCE).json()
        assert again == {"api_key_name": "bad-tenant", "aborted": 0, "ids": []}
        for p in procs:
            p.wait(60)
        url = load_config(path, env={}).store_url
        rows = wait_rows(url, lambda rs: len(rs) == 8)
        by_id = {row["id"]: row for row in rows}
        assert all(by_id[i]["status"] == "aborted" for i in bad_ids)
        assert all(by_id[i]["error"] == "aborted by admin (ops)" for i in bad_ids)
        assert all(by_id[i]["status"] == "success" for i in good_ids)
        audit = [(h["source"], h["new_value"]) for h in _history(c, "abort")]
        assert audit == [
            ("tui", "key bad-tenant: 0 requests"),
            ("api", "key bad-tenant: 4 requests"),
        ]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        d.stop()


def test_drain_resume_abort_are_audited_with_their_source(make_daemon):
    # No config file: embedded defaults as far as the daemon knows (nothing to save to).
    d = make_daemon(admin=True, with_file=False, engine={"max_model_len": 1024})
    c = d.client(TOKEN)
    assert c.post("/admin/drain", headers=SOURCE).json()["state"] == "draining"
    assert c.post("/admin/drain").json()["state"] == "draining"  # no change: no row
    assert c.post("/admin/resume").json()["state"] == "ready"
    assert _client_call(d, "drain")["state"] == "draining"  # the dashboard's client
    assert _client_call(d, "resume")["state"] == "ready"
    states = [
        (h["source"], h["actor"], h["old_value"], h["new_value"]) for h in _history(c, "state")
    ]
    assert states == [
        ("tui", "ops", "draining", "ready"),
        ("tui", "ops", "ready", "draining"),
        ("api", "ops", "draining", "ready"),
        ("tui", "ops", "ready", "draining"),
    ]

    result: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: result.update(
            r=_complete(d, "none", max_tokens=900, ignore_eos=True, prompt="long")
        )
    )
    t.start()
    (entry,) = _wait_live(c, lambda live: len(live) == 1)
    assert _client_call(d, "abort", entry["id"]) == {"aborted": entry["id"]}
    t.join(30)
    assert result["r"].json()["choices"][0]["finish_reason"] == "abort"
    (row,) = _history(c, "abort")
    assert (row["source"], row["actor"], row["old_value"], row["new_value"]) == (
        "tui",
        "ops",
        None,
        f"request {entry['id']}",
    )

    r = c.post("/admin/config/save")
    assert r.status_code == 409
    assert "embedded defaults" in r.json()["error"]["message"]
    assert _history(c, "config_file") == []


def test_restart_names_the_live_values_it_dropped(tiny_model_dir, tmp_path, caplog):
    path = admin_cfg(
        tmp_path,
        tiny_model_dir,
        engine={"max_num_seqs": 24, "max_model_len": 1024},
        server={"max_queue_len": 256},
    )
    with InProcessDaemon.from_file(path) as d:
        assert d.client(TOKEN).get("/admin/config").json()["dropped_at_restart"] == []
        patch = {"engine": {"max_num_seqs": 12}, "server": {"max_queue_len": 16}}
        assert d.client(TOKEN).patch("/admin/config", json=patch).status_code == 200

    with caplog.at_level(logging.WARNING, logger="controlplane.daemon"):
        d = InProcessDaemon.from_file(path).start()
    with d:
        c = d.client(TOKEN)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restart:")]
        assert lines == [
            "restart: dropped live values engine.max_num_seqs 12 (file: 24), "
            "server.max_queue_len 16 (file: 256); `controlplane config save` writes live "
            "values to the file"
        ]
        assert c.get("/admin/config").json()["dropped_at_restart"] == [
            {"field": "engine.max_num_seqs", "live": 12, "file": 24},
            {"field": "server.max_queue_len", "live": 16, "file": 256},
        ]
        (row,) = _history(c, "restart")
        assert row["source"] == "restart" and row["actor"] is None
        assert row["new_value"] == (
            "dropped engine.max_num_seqs 12 (file: 24), server.max_queue_len 16 (file: 256)"
        )
        assert c.get("/admin/config").json()["fields"]["engine.max_num_seqs"]["value"] == 24

    # The run in between changed nothing live: the next restart drops nothing.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="controlplane.daemon"):
        d = InProcessDaemon.from_file(path).start()
    with d:
        assert d.client(TOKEN).get("/admin/config").json()["dropped_at_restart"] == []
        assert not [r for r in caplog.records if r.getMessage().startswith("restart:")]
        assert len(_history(d.client(TOKEN), "restart")) == 1


def test_save_writes_live_values_into_the_file_and_a_restart_keeps_them(tiny_model_dir, tmp_path):
    path = admin_cfg(
        tmp_path,
        tiny_model_dir,
        api_keys=KEYS,
        engine={"max_num_seqs": 24, "max_model_len": 1024},
        server={"config_settle_s": 0.1},
    )
    original = path.read_text()
    path.write_text(
        "# on-call: keep this file tidy\n"
        + original.replace("max_num_seqs = 24", "max_num_seqs = 24  # sized for the T4s")
    )
    with InProcessDaemon.from_file(path) as d:
        c = d.client(TOKEN)
        patch = {"engine": {"max_num_seqs": 10}, "server": {"suspended_keys": ["bad-tenant"]}}
        assert c.patch("/admin/config", json=patch).status_code == 200
        # `controlplane config save` (the CLI, through the endpoint).
        argv = ["config", "save", "--url", d.url, "--token", TOKEN]
        cli = subprocess.run(
            [sys.executable, "-m", "controlplane", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert f"{path}: saved 2 live values" in cli.stdout
        assert "engine.max_num_seqs = 10" in cli.stdout
        text = path.read_text()
        assert text.startswith("# on-call: keep this file tidy\n")
        assert "max_num_seqs = 10  # sized for the T4s" in text
        assert load_config(path, env={}).server.suspended_keys == ("bad-tenant",)
        assert load_config(path, env={}).engine.max_num_seqs == 10
        (row,) = _history(c, "config_file")
        assert row["source"] == "api" and row["actor"] == "ops"
        assert row["new_value"] == ["engine.max_num_seqs", "server.suspended_keys"]
        assert row["reason"] == f"written to {path}"
        fields = c.get("/admin/config").json()["fields"]
        assert fields["engine.max_num_seqs"]["source"] == "file"
        # Saving again: nothing differs, nothing written, nothing audited (client: source tui).
        assert _client_call(d, "save_config") == {"path": str(path), "saved": []}
        assert len(_history(c, "config_file")) == 1
        # The watcher sees the rewrite and finds nothing to change.
        time.sleep(1.0)
        assert [h for h in _history(c) if h["source"] == "file"] == []
    with InProcessDaemon.from_file(path) as d:
        c = d.client(TOKEN)
        assert c.get("/admin/config").json()["dropped_at_restart"] == []
        assert _history(c, "restart") == []
        fields = c.get("/admin/config").json()["fields"]
        assert fields["engine.max_num_seqs"]["value"] == 10
        assert fields["engine.max_num_seqs"]["source"] == "file"
        assert _complete(d, KEYS[1]["key"]).status_code == 403


def test_a_key_name_that_needs_escaping_reaches_the_route(tiny_model_dir, tmp_path):
    # The client quotes the name as one path segment. (A "/" in a name cannot reach the
    # /admin/keys/{name}/... routes: the server decodes %2F before routing; see admin-api.md.)
    name = "team x?y"
    keys = [{"name": name, "key": "sk-0123456789"}]
    path = admin_cfg(tmp_path, tiny_model_dir, api_keys=keys, engine={"max_model_len": 1024})
    with InProcessDaemon.from_file(path) as d:
        assert _client_call(d, "suspend_key", name)["suspended_keys"] == [name]
        assert _complete(d, "sk-0123456789").status_code == 403


def test_latest_values_and_last_accounted_on_each_database(db_engine):
    # The restart check's two queries, on SQLite and PostgreSQL.
    from datetime import UTC, datetime, timedelta

    from controlplane.config import Config
    from controlplane.runtime.persist import dropped_values, last_accounted
    from controlplane.store.audit import ConfigChange, latest_values, write_changes

    t0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    rows = [
        ConfigChange(t0, "api", "ops", "engine.max_num_seqs", 32, 12),
        ConfigChange(t0 + timedelta(seconds=1), "api", "ops", "engine.max_num_seqs", 12, 8),
        ConfigChange(t0 + timedelta(seconds=2), "file", None, "server.max_queue_len", 256, 9),
        ConfigChange(t0 + timedelta(seconds=3), "api", "ops", "engine.prefill_chunk_size", 1, 2),
    ]
    write_changes(db_engine, "cp-a", rows)
    write_changes(db_engine, "cp-b", [ConfigChange(t0, "api", "ops", "server.max_n", 16, 2)])
    latest = latest_values(db_engine, instance_id="cp-a")
    assert {f: (r["source"], r["new_value"]) for f, r in latest.items()} == {
        "engine.max_num_seqs": ("api", 8),
        "server.max_queue_len": ("file", 9),
        "engine.prefill_chunk_size": ("api", 2),
    }
    later = latest_values(db_engine, instance_id="cp-a", since=t0 + timedelta(seconds=2))
    assert set(later) == {"server.max_queue_len", "engine.prefill_chunk_size"}
    # The file's value is no live value; a live value equal to the config's is not dropped.
    assert dropped_values(latest, Config()) == [
        {"field": "engine.max_num_seqs", "live": 8, "file": 32},
        {"field": "engine.prefill_chunk_size", "live": 2, "file": 128},
    ]
    assert last_accounted(db_engine, "cp-a") is None
    mark = t0 + timedelta(seconds=5)
    write_changes(db_engine, "cp-a", [ConfigChange(mark, "restart", None, "restart", None, "x")])
    assert last_accounted(db_engine, "cp-a") == mark
