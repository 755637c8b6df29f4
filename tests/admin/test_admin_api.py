"""The admin API against a real daemon on loopback (tiny model, real SQLite, real HTTP)."""

from __future__ import annotations

import json
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.config import load_config
from harness import (
    ADMIN_TOKEN,
    DaemonProcess,
    admin_sections,
    wait_rows,
    write_config,
)

TOKEN = ADMIN_TOKEN
MODEL = "model"


def admin_cfg(tmp_path: Path, model: Path, **sections) -> Path:
    """A config file (tmp_path/cp.toml) with the tests' admin token and short intervals."""
    return write_config(
        tmp_path / "cp.toml", tmp_path / "data", model, **admin_sections(**sections)
    )


@pytest.fixture(scope="module")
def admin(make_module_daemon):
    d = make_module_daemon(admin=True, engine={"max_num_seqs": 8, "max_model_len": 1024})
    return d, d.config_path


def loadgen(url: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "controlplane",
            "loadgen",
            "--url",
            url,
            "--token-id-range",
            "3-1000",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_every_admin_route_rejects_missing_and_wrong_tokens(admin):
    d, _ = admin
    routes = [
        (r.path, m)
        for r in d.daemon.app.routes
        if r.path.startswith("/admin")
        for m in r.methods
        if m not in ("OPTIONS", "HEAD")
    ]
    assert len(routes) >= 9  # a new route shows up here automatically
    for path, method in routes:
        url = d.url + re.sub(r"\{[^}]+\}", "x", path)
        for headers in (
            {},
            {"Authorization": "Bearer wrong-token-wrong-token"},
            {"Authorization": TOKEN},
        ):
            r = httpx.request(method, url, headers=headers, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert "valid admin token" in r.text and "wrong" not in r.text.lower().replace(
                "wrong-token", ""
            )
    # Open endpoints stay open.
    assert httpx.get(d.url + "/health").status_code == 200
    assert httpx.get(d.url + "/metrics").status_code == 200


def test_generated_token_file_is_private(tiny_model_dir, tmp_path):
    path = write_config(tmp_path / "cp.toml", tmp_path / "data", tiny_model_dir)
    proc = DaemonProcess.start(path)
    try:
        line = next(line for line in proc.lines if "admin token in" in line)
        token_file = Path(line.split("admin token in ")[1].strip())
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        r = httpx.get(proc.url + "/admin/config", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200
    finally:
        assert proc.stop() == 0


def test_config_sources_and_live_flags(make_daemon):
    env = {"CONTROLPLANE_SERVER__MAX_QUEUE_LEN": "77"}
    d = make_daemon(admin=True, env=env, engine={"max_num_seqs": 6})
    fields = d.client(TOKEN).get("/admin/config").json()["fields"]
    # With what each field accepts (the ranges the validation itself declares).
    assert fields["engine.max_num_seqs"] == {
        **{"value": 6, "source": "file", "live": True},
        **{"type": "int", "min": 1, "max": 4096},
    }
    assert fields["server.max_queue_len"] == {
        **{"value": 77, "source": "env", "live": True},
        **{"type": "int", "min": 0},
    }
    assert fields["engine.prefill_chunk_size"]["source"] == "default"
    assert fields["engine.block_size"]["live"] is False and fields["engine.dtype"]["live"] is False
    assert fields["admin_tokens"]["value"] == ["ops"]  # names only, never the token
    assert TOKEN not in json.dumps(fields)


def test_patch_invalid_and_restart_only_change_nothing(admin):
    d, _ = admin
    c = d.client(TOKEN)
    before = c.get("/admin/config").json()["fields"]
    r = c.patch("/admin/config", json={"engine": {"max_num_seqs": 4, "max_num_batched_tokens": 2}})
    assert r.status_code == 422
    err = r.json()["error"]
    assert (
        err["param"] == "engine.max_num_batched_tokens" and ">= max_num_seqs (4)" in err["message"]
    )
    r = c.patch("/admin/config", json={"engine": {"prefill_chunk_size": 0}})
    assert r.status_code == 422 and "[1," in r.json()["error"]["message"]
    r = c.patch("/admin/config", json={"engine": {"block_size": 32}})
    assert r.status_code == 409 and "restart" in r.json()["error"]["message"]
    r = c.patch("/admin/config", json={"engine": {"max_num_seqs": 3, "dtype": "float16"}})
    assert r.status_code == 409  # all or nothing: the valid half is not applied either
    r = c.patch("/admin/config", json={"nope": 1})
    assert r.status_code == 422 and r.json()["error"]["param"] == "nope"
    assert c.get("/admin/config").json()["fields"] == before
    assert d.daemon.aengine.engine.settings.max_num_seqs == before["engine.max_num_seqs"]["value"]


def test_patch_wrong_shapes_are_422_naming_the_field(admin):
    """Issue 52, item 4: an empty or partial price entry, numbers sent as strings, a key given
    twice and an invalid value of a restart-only key: 422 naming the field, nothing changed."""
    d, _ = admin
    c = d.client(TOKEN)
    before = c.get("/admin/config").json()["fields"]
    price = {
        "model": "*",
        "effective_from": "2026-02-01T00:00:00+00:00",
        "prompt_per_mtok": 1,
        "cached_prompt_per_mtok": 0.5,
        "completion_per_mtok": 2.0,
    }
    partial = {k: v for k, v in price.items() if k != "cached_prompt_per_mtok"}
    cases = [
        ({"prices": [{}]}, "prices[0].model", "is required"),
        ({"prices": [partial]}, "prices[0].cached_prompt_per_mtok", "is required"),
        ({"prices": [{**price, "prompt_per_mtok": "1"}]}, "prices[0].prompt_per_mtok", "number"),
        ({"prices": "free"}, "prices", "must be an array"),
        ({"engine": {"max_num_seqs": "8"}}, "engine.max_num_seqs", 'integer, got "8"'),
        ({"engine": {"max_num_seqs": True}}, "engine.max_num_seqs", "integer, got true"),
        ({"engine.max_num_seqs": 8.0}, "engine.max_num_seqs", "integer, got 8.0"),
        ({"server": {"max_choices_share": "0.5"}}, "server.max_choices_share", "a number"),
        ({"autopilot": {"enabled": 1}}, "autopilot.enabled", "true or false, got 1"),
        ({"server": {"suspended_keys": "a,b"}}, "server.suspended_keys", "array of strings"),
        # Restart-only keys: validated first (422); only a valid value is "restart needed".
        ({"engine": {"block_size": "16"}}, "engine.block_size", "integer"),
        ({"engine": {"block_size": 0}}, "engine.block_size", "must be"),
        ({"engine": {"dtype": "float7"}}, "engine.dtype", "float7"),
        (
            {"engine.max_num_seqs": 8, "engine": {"max_num_seqs": 9}},
            "engine.max_num_seqs",
            "given twice",
        ),
    ]
    for body, param, needle in cases:
        r = c.patch("/admin/config", json=body)
        assert r.status_code == 422, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and needle in err["message"], (body, err)
        assert err["message"].startswith(param + ": "), err
    for raw, param in [
        (b'{"engine": {"max_num_seqs": 8, "max_num_seqs": 9}}', "engine.max_num_seqs"),
        (b'{"prices": [{"model": "*", "model": "x"}]}', "prices[0].model"),
        (b'{"engine": {"max_num_seqs": 8}, "engine": {"max_num_seqs": 9}}', "engine"),
    ]:
        r = c.patch("/admin/config", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (raw, r.text)
        assert r.json()["error"]["param"] == param
        assert "given twice in one JSON object" in r.json()["error"]["message"]
    r = c.patch("/admin/autopilot", json={"enabled": "true"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "autopilot.enabled", r.text
    # The valid shapes still pass: a whole price entry (dry run), a restart-only key at a valid
    # value (409), numbers given as integers for float fields.
    r = c.patch("/admin/config", params={"dry_run": "true"}, json={"prices": [price]})
    assert r.status_code == 200, r.text
    assert r.json()["changed"][0]["new"][0]["cached_prompt_per_mtok"] == 0.5
    r = c.patch("/admin/config", json={"engine": {"block_size": 32}})
    assert r.status_code == 409 and "restart needed" in r.json()["error"]["message"]
    r = c.patch("/admin/config", params={"dry_run": "true"}, json={"jobs": {"gpu_hourly_usd": 2}})
    assert r.status_code == 200, r.text
    assert c.get("/admin/config").json()["fields"] == before


def test_dry_run_validates_without_applying_and_change_ids_group_audit_rows(admin):
    d, _ = admin
    c = d.client(TOKEN)
    before = c.get("/admin/config").json()["fields"]
    now = before["engine.max_num_seqs"]["value"]
    r = c.patch("/admin/config?dry_run=true", json={"engine": {"max_num_seqs": now + 1}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["dry_run"] is True and body["change_id"] is None
    assert body["changed"] == [{"field": "engine.max_num_seqs", "old": now, "new": now + 1}]
    r = c.patch("/admin/config?dry_run=true", json={"engine": {"max_num_batched_tokens": 1}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "engine.max_num_batched_tokens"
    assert c.get("/admin/config").json()["fields"] == before  # nothing applied, nothing audited
    history = c.get("/admin/config/history").json()["changes"]
    # A change id given by the caller (a fleet change) lands on every row of the change.
    two = {"engine": {"max_num_seqs": now + 1, "prefill_chunk_size": 96}}
    r = c.patch("/admin/config", json=two, headers={"X-Controlplane-Change-Id": "fleet-42"})
    assert r.status_code == 200 and r.json()["change_id"] == "fleet-42"
    rows = c.get("/admin/config/history").json()["changes"]
    new = rows[: len(rows) - len(history)]
    assert sorted(x["field"] for x in new) == ["engine.max_num_seqs", "engine.prefill_chunk_size"]
    assert {x["change_id"] for x in new} == {"fleet-42"}
    # Without one, each change gets its own.
    chunk = before["engine.prefill_chunk_size"]["value"]
    r = c.patch(
        "/admin/config", json={"engine": {"max_num_seqs": now, "prefill_chunk_size": chunk}}
    )
    assert r.json()["change_id"] not in ("fleet-42", None)
    assert c.get("/admin/config/history").json()["changes"][0]["change_id"] == r.json()["change_id"]
    r = c.patch(
        "/admin/config",
        json={"engine.max_num_seqs": now},
        headers={"X-Controlplane-Change-Id": "a b"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Controlplane-Change-Id"
    r = c.patch("/admin/config?scope=planet", json={"engine.max_num_seqs": now})
    assert r.status_code == 400 and r.json()["error"]["param"] == "scope"


def _stats(c: httpx.Client) -> dict:
    return c.get("/admin/stats").json()


def test_patch_max_num_seqs_under_loadgen_caps_batch_within_a_step(admin):
    d, _ = admin
    c = d.client(TOKEN)
    gen = loadgen(
        d.url, "--requests", "40", "--prompt-len", "8-32", "--output-len", "150-250", "--stream"
    )
    try:
        deadline = time.monotonic() + 60
        while _stats(c)["num_running"] < 6:
            assert time.monotonic() < deadline, "load never filled the batch"
            time.sleep(0.05)
        r = c.patch(
            "/admin/config",
            json={"engine": {"max_num_seqs": 2}},
            headers={"X-Controlplane-Source": "tui"},
        )
        assert r.status_code == 200
        assert r.json()["fields"]["engine.max_num_seqs"] == {
            "value": 2,
            "source": "tui",
            "live": True,
        }
        engine = d.daemon.aengine.engine
        step_at_patch = engine.stats().step
        # Every step after the one in flight at PATCH time obeys the cap.
        deadline = time.monotonic() + 10
        while engine.stats().step < step_at_patch + 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        later = [s for s in d.daemon.aengine.recent_steps(step_at_patch + 1)]
        assert later and all(s.num_running <= 2 for s in later)
        st = _stats(c)
        assert (
            st["num_running"] <= 2
            and st["max_num_seqs"] == 2
            and st["num_waiting"] + st["queue_length"] > 0
        )
        history = c.get("/admin/config/history", params={"field": "engine.max_num_seqs"}).json()[
            "changes"
        ]
        assert history[0]["source"] == "tui" and history[0]["actor"] == "ops"
        assert (history[0]["old_value"], history[0]["new_value"]) == (8, 2)
    finally:
        c.patch("/admin/config", json={"engine": {"max_num_seqs": 8}})
        gen.wait(120)
    assert gen.returncode == 0, gen.stdout.read()


def test_patch_preemption_mode_while_preempting(make_daemon):
    d = make_daemon(admin=True, engine={"block_size": 4, "num_kv_blocks": 96, "max_num_seqs": 8})
    c = d.client(TOKEN)
    gen = loadgen(d.url, "--requests", "24", "--prompt-len", "20-40", "--output-len", "120-160")
    try:
        deadline = time.monotonic() + 60
        while _stats(c)["num_preemptions"] == 0:
            assert time.monotonic() < deadline, "the small KV cache never forced a preemption"
            time.sleep(0.05)
        assert (
            c.patch("/admin/config", json={"engine": {"preemption_mode": "swap"}}).status_code
            == 200
        )
        swapped = False
        deadline = time.monotonic() + 60
        while not swapped and time.monotonic() < deadline and gen.poll() is None:
            swapped = any(s.num_swapped > 0 for s in d.daemon.aengine.recent_steps())
            time.sleep(0.02)
        assert swapped, "after switching to swap, preempted sequences were never swapped out"
    finally:
        gen.wait(180)
        d.stop()
    assert gen.returncode == 0


def test_config_file_edit_and_sighup_apply_and_audit(tiny_model_dir, tmp_path):
    path = admin_cfg(tmp_path, tiny_model_dir, engine={"max_num_seqs": 8})
    proc = DaemonProcess.start(path)
    c = proc.client(TOKEN, timeout=30)

    def field(name: str) -> dict:
        return c.get("/admin/config").json()["fields"][name]

    def wait_value(name: str, value) -> None:
        deadline = time.monotonic() + 15
        while field(name)["value"] != value:
            assert time.monotonic() < deadline, f"{name} never became {value}: {field(name)}"
            time.sleep(0.1)

    try:
        # 1. Edit on disk: picked up by the watcher.
        path.write_text(path.read_text().replace("max_num_seqs = 8", "max_num_seqs = 5"))
        wait_value("engine.max_num_seqs", 5)
        assert field("engine.max_num_seqs")["source"] == "file"
        # 2. An invalid file: old values kept, and a log line names the key.
        good = path.read_text()
        path.write_text(good.replace("max_num_seqs = 5", "max_num_seqs = -3"))
        proc.wait_for("engine.max_num_seqs: must be in [1, 4096], got -3", 15)
        assert field("engine.max_num_seqs")["value"] == 5
        # 3. SIGHUP (with the watcher too slow to notice first: same mtime trick not needed).
        path.write_text(
            good.replace("max_num_seqs = 5", "max_num_seqs = 7").replace(
                "[engine]", "[engine]\nprefill_chunk_size = 64"
            )
        )
        proc.proc.send_signal(signal.SIGHUP)
        wait_value("engine.max_num_seqs", 7)
        assert field("engine.prefill_chunk_size")["value"] == 64
        # 4. A restart-only difference is reported, not applied.
        path.write_text(path.read_text().replace("[engine]", "[engine]\nblock_size = 32"))
        proc.proc.send_signal(signal.SIGHUP)
        proc.wait_for("need a restart (not applied): engine.block_size", 15)
        assert field("engine.block_size")["value"] == 16
        history = c.get("/admin/config/history").json()["changes"]
        file_changes = [
            (h["field"], h["old_value"], h["new_value"]) for h in history if h["source"] == "file"
        ]
        assert ("engine.max_num_seqs", 8, 5) in file_changes and (
            "engine.max_num_seqs",
            5,
            7,
        ) in file_changes
        assert ("engine.prefill_chunk_size", 128, 64) in file_changes
        assert all(h["actor"] is None for h in history if h["source"] == "file")
    finally:
        assert proc.stop() == 0


def test_drain_and_resume(admin):
    d, _ = admin
    c = d.client(TOKEN)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    try:
        assert c.post("/admin/drain").json()["state"] == "draining"
        h = httpx.get(d.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
        r = httpx.post(d.url + "/v1/completions", json=body)
        assert (
            r.status_code == 503
            and r.headers["retry-after"]
            and "draining" in r.json()["error"]["message"]
        )
    finally:
        assert c.post("/admin/resume").json()["state"] == "ready"
    assert httpx.get(d.url + "/health").status_code == 200
    assert httpx.post(d.url + "/v1/completions", json=body, timeout=30).status_code == 200


def test_events_stream_snapshots_and_config_change(admin):
    d, _ = admin
    c = d.client(TOKEN)
    got: dict[str, list] = {"stats": [], "config": []}
    subscribed = threading.Event()

    def listen() -> None:
        with httpx.stream(
            "GET",
            d.url + "/admin/events",
            params={"interval": 0.2},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        ) as r:
            event = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event:
                    got[event].append(json.loads(line.split(":", 1)[1]))
                    subscribed.set()  # the first snapshot proves the stream is registered
                    if got["config"] and len(got["stats"]) >= 3:
                        return

    t = threading.Thread(target=listen)
    t.start()
    # A second client that never reads must not slow anything down.
    slow = httpx.Client(timeout=30)
    slow_stream = slow.stream(
        "GET", d.url + "/admin/events", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    slow_stream.__enter__()
    assert subscribed.wait(20)
    old = c.get("/admin/config").json()["fields"]["server.max_queue_len"]["value"]
    assert c.patch("/admin/config", json={"server": {"max_queue_len": 99}}).status_code == 200
    t.join(20)
    slow_stream.__exit__(None, None, None)
    assert len(got["stats"]) >= 3 and {"num_running", "kv_usage_perc", "state"} <= set(
        got["stats"][0]
    )
    change = got["config"][0]
    assert change["source"] == "api" and change["actor"] == "ops"
    assert change["changes"] == [
        {"field": "server.max_queue_len", "old": old, "new": 99, "reason": None}
    ]
    c.patch("/admin/config", json={"server": {"max_queue_len": old}})


def test_requests_live_finished_and_abort(admin):
    d, path = admin
    c = d.client(TOKEN)
    url = load_config(path, env={}).store_url
    done = httpx.post(
        d.url + "/v1/completions",
        json={"model": MODEL, "prompt": "done", "max_tokens": 3},
        timeout=30,
    ).json()
    result: dict = {}

    def long_request() -> None:
        result["r"] = httpx.post(
            d.url + "/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": "long", "max_tokens": 900, "ignore_eos": True},
        ).json()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 20
    while not (live := c.get("/admin/requests").json()["live"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    entry = live[0]
    assert entry["state"] in ("running", "waiting") and entry["endpoint"] == "completions"
    assert entry["prompt_tokens"] > 0 and entry["age_s"] >= 0
    assert c.post(f"/admin/requests/{entry['id']}/abort").status_code == 200
    t.join(30)
    assert result["r"]["choices"][0]["finish_reason"] == "abort"
    assert c.post("/admin/requests/nope/abort").status_code == 404
    (row,) = wait_rows(
        url, lambda r: r and r[0]["status"] == "aborted", where=f"id = '{entry['id']}'"
    )
    assert row["error"] == "aborted by admin (ops)"
    wait_rows(url, lambda r: len(r) == 1, where=f"id = '{done['id']}' AND status = 'success'")
    finished = c.get("/admin/requests", params={"status": "success", "limit": 1000}).json()[
        "finished"
    ]
    assert done["id"] in [f["id"] for f in finished] and all(
        f["status"] == "success" for f in finished
    )
    page = c.get("/admin/requests", params={"limit": 1}).json()
    assert len(page["finished"]) == 1 and page["next_cursor"]
    nxt = c.get("/admin/requests", params={"limit": 1, "cursor": page["next_cursor"]}).json()
    assert nxt["finished"][0]["id"] != page["finished"][0]["id"]
    bad = c.get("/admin/requests", params={"cursor": "garbage!"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "cursor"
    bad = c.get("/admin/requests", params={"status": "sleeping"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "status"


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + (
                "{"
                + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                + "}"
                if len(s.labels) > 1
                else ""
            )
            out[key] = s.value
    return out


def test_metrics_parse_and_move_under_load(admin, tmp_path):
    d, _ = admin
    before = _metrics(d.url)
    summary = tmp_path / "load.json"
    gen = loadgen(
        d.url,
        "--requests",
        "12",
        "--prompt-len",
        "8-16",
        "--output-len",
        "20-30",
        "--stream",
        "--json",
        str(summary),
    )
    assert gen.wait(120) == 0
    d.daemon.runtime.pump_metrics()
    after = _metrics(d.url)
    load = json.loads(summary.read_text())
    key = "controlplane:generation_tokens_total"
    # Every generated token is counted once, the first token of each request included.
    assert after[key] - before.get(key, 0) == load["total_completion_tokens"]
    assert load["requests_ok"] == 12
    st = httpx.get(d.url + "/admin/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert st["requests_finished_in_window"] >= 12 and st["ttft_p50_ms"] > 0
    mapped = httpx.get(
        d.url + "/admin/stats",
        params={"block_map": 16},
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).json()["kv_block_map"]
    assert len(mapped) == 16 and all(0.0 <= f <= 1.0 for f in mapped)
    bad = httpx.get(
        d.url + "/admin/stats",
        params={"block_map": 2},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "block_map"
    assert st["itl_p99_ms"] >= st["itl_p50_ms"] > 0
    for name in (
        "controlplane:prompt_tokens_total",
        "controlplane:generation_tokens_total",
        "controlplane:e2e_request_latency_seconds_count",
        "controlplane:time_to_first_token_seconds_count",
        "controlplane:inter_token_latency_seconds_count",
        "controlplane:iteration_tokens_total_count",
    ):
        assert after[name] > before.get(name, 0), name
    assert (
        after["controlplane:e2e_request_latency_seconds_count"]
        - before.get("controlplane:e2e_request_latency_seconds_count", 0)
        >= 12
    )
    assert (
        "controlplane:num_requests_running" in after and "controlplane:kv_cache_usage_perc" in after
    )
    assert any(k.startswith("controlplane:config_info") for k in after)
