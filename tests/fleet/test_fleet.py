"""The fleet table: registration, heartbeats, unreachable-by-age, `GET /admin/fleet` and
`controlplane fleet ls`, on SQLite and PostgreSQL, with real daemon processes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, create_engine, insert

from controlplane.config import FleetSettings, build_config
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.settings import EngineSettings
from controlplane.fleet.heartbeat import FleetMember, default_advertise_url
from controlplane.fleet.registry import (
    ROLLUPS,
    Heartbeat,
    config_drift,
    heartbeat,
    member,
    members,
    register,
    totals,
)
from controlplane.http.auth import AdminAuth
from controlplane.runtime.live_config import LiveConfig
from controlplane.runtime.runtime import Runtime
from harness import DaemonProcess, write_config

T0 = datetime(2026, 11, 25, 3, 0, tzinfo=UTC)
TOKEN = "fleet-token-0123456789abcdef"


def row(state: str, beat_at: datetime) -> dict:
    return dict(
        id="a",
        advertise_url="http://h:1",
        hostname="h",
        pid=1,
        version="0.1.0",
        model="m",
        quantization="none",
        state=state,
        started_at=T0,
        heartbeat_at=beat_at,
        num_running=1,
        num_waiting=0,
        kv_usage=0.5,
        output_tokens_per_s=10.0,
        ttft_p50_s=0.1,
    )


def test_a_live_state_with_an_old_heartbeat_reads_unreachable() -> None:
    now = T0 + timedelta(seconds=100)
    fresh = member(row("serving", now - timedelta(seconds=14)), now=now, unreachable_after_s=15)
    assert fresh.state == "serving" and fresh.unreachable_since is None
    assert fresh.heartbeat_age_s == pytest.approx(14)
    old = member(row("draining", now - timedelta(seconds=20)), now=now, unreachable_after_s=15)
    assert old.state == "unreachable"
    assert old.unreachable_since == now - timedelta(seconds=5)  # heartbeat + 15 s
    # A stopped daemon said so: it stays stopped, however old its last word.
    gone = member(row("stopped", now - timedelta(days=2)), now=now, unreachable_after_s=15)
    assert gone.state == "stopped" and gone.unreachable_since is None


def beat(state: str, kv: float) -> Heartbeat:
    return Heartbeat(state, model="m", num_running=2, num_waiting=0, kv_usage=kv)


def test_register_heartbeat_and_worst_first(db_engine: Engine) -> None:
    def reg(iid: str, b: Heartbeat) -> None:
        register(db_engine, iid, advertise_url=f"http://{iid}:8000", hostname=iid, pid=7,
                 version="0.1.0", beat=b, now=T0)  # fmt: skip

    reg("serving-low", beat("serving", 0.1))
    reg("serving-high", beat("serving", 0.9))
    reg("draining", beat("draining", 0.2))
    reg("stopped", beat("stopped", 0.0))
    reg("silent", beat("serving", 0.3))
    later = T0 + timedelta(seconds=30)
    for iid, b in (
        ("serving-low", beat("serving", 0.1)),
        ("serving-high", beat("serving", 0.9)),
        ("draining", beat("draining", 0.2)),
    ):
        assert heartbeat(db_engine, iid, b, now=later)
    assert not heartbeat(db_engine, "never-registered", beat("serving", 0), now=later)
    got = members(db_engine, now=later + timedelta(seconds=1), unreachable_after_s=15)
    assert [(m.id, m.state) for m in got] == [
        ("silent", "unreachable"),
        ("draining", "draining"),
        ("serving-high", "serving"),
        ("serving-low", "serving"),
        ("stopped", "stopped"),
    ]
    # Registering again (a restart keeps its instance id) replaces the row, not a second one.
    reg("silent", beat("loading", 0.0))
    again = members(db_engine, now=T0, unreachable_after_s=15)
    assert [m.id for m in again if m.id == "silent"] == ["silent"]
    assert len(again) == 5  # "stopped" stopped just now: still shown by default
    # Stopped for more than an hour: only with include_stopped.
    hour = T0 + timedelta(seconds=3601)
    assert "stopped" not in {m.id for m in members(db_engine, now=hour, unreachable_after_s=15)}
    everyone = members(db_engine, now=hour, unreachable_after_s=15, include_stopped=True)
    assert [m.id for m in everyone][-1] == "stopped"
    with pytest.raises(ValueError, match="state"):
        heartbeat(db_engine, "silent", Heartbeat("sleeping"), now=T0)


def test_config_drift_names_the_odd_ones_out() -> None:
    def at(iid: str, state: str, **config: object) -> object:
        r = {**row(state, T0), "id": iid, "config": json.dumps(config)}
        return member(r, now=T0, unreachable_after_s=15)

    found = [
        at("a", "serving", **{"engine.max_num_seqs": 32, "engine.preemption_mode": "swap"}),
        at("b", "serving", **{"engine.max_num_seqs": 32, "engine.preemption_mode": "recompute"}),
        at("c", "draining", **{"engine.max_num_seqs": 16, "engine.preemption_mode": "swap"}),
        at("d", "stopped", **{"engine.max_num_seqs": 1}),  # gone: not part of the fleet's view
    ]
    assert config_drift(found) == {
        "engine.max_num_seqs": {"majority": 32, "instances": {"c": 16}},
        "engine.preemption_mode": {"majority": "swap", "instances": {"b": "recompute"}},
    }
    assert config_drift(found[:1]) == {}
    # A tie goes to the lowest id's value: every reader names the same odd one out.
    assert config_drift(found[1:3])["engine.max_num_seqs"] == {
        "majority": 32,
        "instances": {"c": 16},
    }


def test_totals_sum_live_heartbeats_and_per_instance_rollup_rates(db_engine: Engine) -> None:
    now = T0 + timedelta(minutes=30)
    found = [
        member({**row("serving", now), "id": i, "output_tokens_per_s": tok}, now=now, unreachable_after_s=15)
        for i, tok in (("a", 10.0), ("b", 30.0))
    ] + [member({**row("stopped", now), "id": "z"}, now=now, unreachable_after_s=15)]  # fmt: skip

    def rollup(iid: str, hour: datetime, requests: int, gpu: float, lst: float, covered: float):
        zero = dict.fromkeys(("prompt_tokens", "cached_prompt_tokens", "completion_tokens"), 0)
        return dict(
            hour_bucket=hour.strftime("%Y-%m-%dT%H"), day_bucket=hour.strftime("%Y-%m-%d"),
            instance_id=iid, model="m", api_key_name="k", requests_succeeded=requests,
            requests_failed=0, list_cost_usd=lst, gpu_cost_usd=gpu, covered_s=covered,
            updated_at=now, **zero,
        )  # fmt: skip

    before = T0 - timedelta(hours=1)
    with db_engine.begin() as conn:
        conn.execute(
            insert(ROLLUPS),
            [
                # a: 3,600 s covered over two hours, 720 requests, $2 GPU, $4 list.
                rollup("a", before, 360, 1.0, 2.0, 1800.0),
                rollup("a", T0, 360, 1.0, 2.0, 1800.0),
                # b: 900 s covered, 90 requests, $0.5 GPU, $1 list.
                rollup("b", T0, 90, 0.5, 1.0, 900.0),
                # Too old, and a stopped instance: neither counts.
                rollup("a", T0 - timedelta(hours=2), 9999, 99.0, 99.0, 3600.0),
                rollup("z", T0, 9999, 99.0, 99.0, 3600.0),
            ],
        )
    t = totals(db_engine, found, now=now)
    assert (t.instances, t.serving, t.unreachable) == (2, 2, 0)
    assert t.output_tokens_per_s == 40.0
    assert t.requests_per_s == pytest.approx(720 / 3600 + 90 / 900)
    assert t.gpu_cost_per_hour_usd == pytest.approx(2.0 + 0.5 * 4)
    assert t.list_cost_per_hour_usd == pytest.approx(4.0 + 1.0 * 4)
    assert totals(db_engine, found[2:], now=now).requests_per_s is None  # nothing live


def fleet_config(tmp: Path, name: str, model: Path, store_url: str, **engine: int) -> Path:
    return write_config(
        tmp / f"{name}.toml",
        tmp / name,
        model,
        server={"instance_id": name},
        store={"url": store_url, "flush_interval_s": 0.1},
        fleet={"heartbeat_s": 0.3, "unreachable_after_s": 1.5},
        engine={"max_num_seqs": 4, "max_model_len": 256, "num_kv_blocks": 64, **engine},
        admin_tokens=[{"name": "ops", "token": TOKEN}],
    )


def start_all(configs: dict[str, Path], store_url: str) -> dict[str, DaemonProcess]:
    """Start the daemons side by side (each spends seconds importing torch) on an empty
    database: they all migrate it at start, one at a time (the migration lock)."""
    with ThreadPoolExecutor(len(configs)) as pool:
        started = {n: pool.submit(DaemonProcess.start, c) for n, c in configs.items()}
        return {n: f.result() for n, f in started.items()}


def admin_get(url: str, path: str) -> dict:
    r = httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def fleet_view(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in admin_get(url, "/admin/fleet")["instances"]}


def wait_states(url: str, want: dict[str, str], timeout: float = 20) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        view = fleet_view(url)
        if {k: view.get(k, {}).get("state") for k in want} == want:
            return view
        assert time.monotonic() < deadline, f"fleet never reached {want}: {view}"
        time.sleep(0.1)


def fleet_cli(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", "fleet", *args, "--config", str(config)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "CONTROLPLANE_ADMIN_TOKEN": TOKEN},
    )  # fmt: skip


def fleet_ls(config: Path) -> list[dict]:
    done = fleet_cli(config, "ls", "--all", "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["instances"]


def setting(url: str, key: str) -> object:
    return admin_get(url, "/admin/config")["fields"][key]["value"]


def audit(url: str, change_id: str) -> list[dict]:
    rows = admin_get(url, "/admin/config/history")["changes"]
    return [r for r in rows if r["change_id"] == change_id]


def test_three_daemons_on_postgresql_apply_drain_kill_and_stop(
    tiny_model_dir, tmp_path, pg_url
) -> None:
    names = ("a", "b", "c")
    # c's smaller step budget makes a larger max_num_seqs invalid there (and only there).
    extra = {"c": {"max_num_batched_tokens": 64}}
    configs = {
        n: fleet_config(tmp_path, n, tiny_model_dir, pg_url, **extra.get(n, {})) for n in names
    }
    daemons = start_all(configs, pg_url)
    urls = {n: d.url for n, d in daemons.items()}
    try:
        view = wait_states(urls["a"], dict.fromkeys(names, "serving"))
        # An admin GET like the others: no token, no fleet.
        assert httpx.get(urls["a"] + "/admin/fleet", timeout=30).status_code == 401
        assert view["b"]["advertise_url"] == urls["b"]
        assert view["c"]["model"] and view["c"]["kv_usage"] is not None
        body = admin_get(urls["a"], "/admin/fleet")
        assert body["config_drift"]["engine.max_num_batched_tokens"] == {
            "majority": EngineSettings().max_num_batched_tokens,  # a's and b's: the default
            "instances": {"c": 64},
        }
        assert body["totals"]["instances"] == 3 and body["totals"]["serving"] == 3

        # Invalid for c: validated everywhere first, so none changes; the CLI names c and the field.
        (tmp_path / "bad.toml").write_text("[engine]\nmax_num_seqs = 100\n")
        done = fleet_cli(configs["a"], "apply", str(tmp_path / "bad.toml"), "--format", "json")
        assert done.returncode == 1, done.stderr
        result = {o["instance"]: o for o in json.loads(done.stdout)["instances"]}
        assert result["c"]["outcome"] == "invalid"
        assert result["c"]["param"] == "engine.max_num_batched_tokens"
        assert {result[n]["outcome"] for n in ("a", "b")} == {"not_applied"}
        assert {setting(u, "engine.max_num_seqs") for u in urls.values()} == {4}

        # Valid for all, through one instance's API: one change id in every audit log.
        r = httpx.patch(
            urls["b"] + "/admin/config",
            params={"scope": "fleet"},
            json={"engine": {"max_num_seqs": 8}},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        change_id = r.json()["change_id"]
        assert {o["outcome"] for o in r.json()["instances"]} == {"applied"}
        for url in urls.values():
            assert setting(url, "engine.max_num_seqs") == 8
            (row,) = audit(url, change_id)
            assert (row["field"], row["new_value"], row["source"], row["actor"]) == (
                "engine.max_num_seqs", 8, "fleet", "ops",
            )  # fmt: skip

        # Drain b through the fleet command: its readiness goes down, the fleet shows it.
        done = fleet_cli(configs["a"], "drain", "b")
        assert done.returncode == 0 and "draining" in done.stdout, done.stderr
        assert httpx.get(urls["b"] + "/health/ready", timeout=30).status_code == 503
        wait_states(urls["a"], {"b": "draining"})
        done = fleet_cli(configs["a"], "resume", "b")
        assert done.returncode == 0, done.stderr
        assert httpx.get(urls["b"] + "/health/ready", timeout=30).status_code == 200
        assert fleet_cli(configs["a"], "drain", "zz").returncode == 1  # no such instance

        # SIGKILL b: it cannot say so; after unreachable_after_s it reads unreachable.
        daemons["b"].stop(signal.SIGKILL)
        view = wait_states(urls["c"], {"a": "serving", "b": "unreachable"})
        since = datetime.fromisoformat(view["b"]["unreachable_since"])
        beat_at = datetime.fromisoformat(view["b"]["heartbeat_at"])
        assert since == beat_at + timedelta(seconds=1.5)
        # A fleet change now applies on a and c and reports b, not silently skipped (exit 2).
        (tmp_path / "ok.json").write_text('{"engine.max_num_seqs": 6}')
        done = fleet_cli(configs["a"], "apply", str(tmp_path / "ok.json"))
        assert done.returncode == 2, done.stderr
        assert "b unreachable" in done.stderr and "applied on 2 instance(s)" in done.stderr
        assert {setting(urls[n], "engine.max_num_seqs") for n in ("a", "c")} == {6}

        # SIGTERM c: a graceful stop says stopped.
        assert daemons["c"].stop() == 0
        wait_states(urls["a"], {"a": "serving", "b": "unreachable", "c": "stopped"})
        # The CLI reads the same table, without any daemon's help.
        listed = fleet_ls(configs["a"])
        assert listed[0]["id"] == "b"  # worst first
        assert {m["id"]: m["state"] for m in listed} == {
            "a": "serving",
            "b": "unreachable",
            "c": "stopped",
        }
    finally:
        for d in daemons.values():
            if d.proc.poll() is None:
                d.stop()


def test_two_daemons_on_one_sqlite_file(tiny_model_dir, tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    configs = {n: fleet_config(tmp_path, n, tiny_model_dir, url) for n in ("node-x", "node-y")}
    daemons = start_all(configs, url)
    try:
        wait_states(daemons["node-y"].url, {"node-x": "serving", "node-y": "serving"})
        assert daemons["node-x"].stop() == 0
        wait_states(daemons["node-y"].url, {"node-x": "stopped", "node-y": "serving"})
        shown = subprocess.run(
            [sys.executable, "-m", "controlplane", "fleet", "ls", "--config", str(configs["node-y"])],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        lines = {line.split()[1]: line for line in shown.splitlines() if "node-" in line}
        assert "serving" in lines["node-y"] and "stopped" in lines["node-x"]
        assert shown.index("node-y") < shown.index("node-x")  # worst first: stopped last
    finally:
        for d in daemons.values():
            if d.proc.poll() is None:
                d.stop()


def test_fleet_ls_imports_no_torch(tmp_path) -> None:
    code = f"""
import sys
from controlplane.cli import main
assert main(["fleet", "ls", "--url", "sqlite:///{tmp_path / "none.db"}"]) == 0
assert "torch" not in sys.modules, "torch was imported"
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no instances" in done.stdout
    assert not (tmp_path / "none.db").exists()  # a look never creates a database


def test_fleet_config_defaults_and_errors_name_the_field() -> None:
    assert build_config({}).fleet == FleetSettings(heartbeat_s=5.0, unreachable_after_s=15.0)
    # unreachable_after_s left out: three heartbeats, whatever the heartbeat.
    assert build_config({"fleet": {"heartbeat_s": 10}}).fleet.unreachable_after_s == 30
    bad = (
        ({"fleet": {"heartbeat_s": 0}}, "fleet.heartbeat_s"),
        ({"fleet": {"heartbeat_s": 5, "unreachable_after_s": 5}}, "fleet.unreachable_after_s"),
        ({"server": {"advertise_url": "ftp://x"}}, "server.advertise_url"),
    )
    for raw, name in bad:
        with pytest.raises(InvalidSettingError) as err:
            build_config(raw)
        assert name in str(err.value)
    with pytest.raises(InvalidSettingError, match=r"more than fleet\.heartbeat_s"):
        build_config({"fleet": {"heartbeat_s": 2, "unreachable_after_s": 1}})


def test_default_advertise_url() -> None:
    assert default_advertise_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert default_advertise_url("0.0.0.0", 81) == f"http://{socket.gethostname()}:81"
    assert default_advertise_url("::1", 81) == "http://[::1]:81"


def test_a_database_outage_is_one_warning_and_the_row_comes_back(
    db_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        cfg = build_config({})
        runtime = Runtime(LiveConfig(cfg, {}, {}), "outage", AdminAuth([]))
        # Nothing listens on port 1: a real connection failure, every beat.
        runtime.store.db = create_engine("postgresql+psycopg://u@127.0.0.1:1/x?connect_timeout=2")
        member_ = FleetMember(runtime, "http://h:1")
        with caplog.at_level(logging.INFO, logger="controlplane.fleet"):
            for _ in range(3):
                await member_.beat_now()  # never raises
            assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
            runtime.store.db = db_engine  # the database is back
            await member_.beat_now()
        assert "written again" in caplog.records[-1].getMessage()
        (row,) = members(db_engine, now=datetime.now(UTC), unreachable_after_s=15)
        assert (row.id, row.state, row.advertise_url) == ("outage", "loading", "http://h:1")
        await member_.stopped()
        runtime.state = "ready"
        await member_.beat_now()  # a beat after stopped does not bring the row back to life
        (row,) = members(db_engine, now=datetime.now(UTC), unreachable_after_s=15)
        assert row.state == "stopped"

    asyncio.run(main())
