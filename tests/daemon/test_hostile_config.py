"""Hostile configuration values (issue 15): non-finite numbers and out-of-range values are
refused wherever a setting enters (config file, CONTROLPLANE_* environment, PATCH /admin/config,
a reload on SIGHUP), naming the field; and a change whose audit row cannot be written is not
applied. Real daemons over loopback HTTP, real SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import make_url

from controlplane.config import build_config, load_config
from controlplane.engine.errors import InvalidSettingError
from harness import DaemonProcess, write_config
from tests.conftest import PG_ADMIN_URL

TOKEN = "hostile-token-0123456789"
FINITE = "must be a finite number"


def config(tmp_path: Path, model: Path | None, **sections) -> Path:
    server = {"config_watch_interval_s": 3600.0, **sections.pop("server", {})}
    return write_config(
        tmp_path / "cp.toml",
        tmp_path / "data",
        model,
        server=server,
        store={"flush_interval_s": 0.1, **sections.pop("store", {})},
        admin_tokens=[{"name": "ops", "token": TOKEN}],
        **sections,
    )


def serve(config_path: Path | None, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`controlplane serve` as an operator runs it; only `env` among CONTROLPLANE_* variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
    argv = [sys.executable, "-m", "controlplane", "serve", "--port", "0"]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    return subprocess.run(
        argv, env={**base, **env}, capture_output=True, text=True, timeout=60, check=False
    )


# -- config file and environment ----------------------------------------------------------------

# (section, key, TOML literal, the value as reported)
FILE_CASES = [
    ("server", "drain_timeout_s", "nan", "nan"),
    ("server", "events_interval_s", "inf", "inf"),
    ("store", "flush_interval_s", "nan", "nan"),
    ("jobs", "gpu_hourly_usd", "nan", "nan"),
    ("jobs", "peak_flops", "+inf", "inf"),
    ("jobs", "sample_retention_days", "inf", "inf"),
    ("engine", "gpu_memory_utilization", "nan", "nan"),
]


@pytest.mark.parametrize(("section", "key", "literal", "shown"), FILE_CASES)
def test_config_file_rejects_non_finite(tmp_path, section, key, literal, shown):
    path = tmp_path / "cp.toml"
    path.write_text(f"[{section}]\n{key} = {literal}\n")
    with pytest.raises(InvalidSettingError) as exc:
        load_config(path, env={})
    assert str(exc.value) == f"{section}.{key}: {FINITE}, got {shown}"


def test_prices_reject_non_finite_and_out_of_range(tmp_path):
    path = tmp_path / "cp.toml"
    path.write_text("[[prices]]\nmodel = '*'\ncompletion_per_mtok = nan\n")
    with pytest.raises(InvalidSettingError, match=rf"^prices\[0\]\.completion_per_mtok: {FINITE}"):
        load_config(path, env={})
    for raw, message in [
        ({"prices": [{"prompt_per_mtok": -1.0}]}, r"^prices\[0\]\.prompt_per_mtok: must be in"),
        ({"prices": [{"prompt_per_mtok": 1e12}]}, r"^prices\[0\]\.prompt_per_mtok: must be in"),
        # A JSON or TOML integer too large for a float: refused, not an OverflowError.
        ({"server": {"drain_timeout_s": 10**400}}, rf"^server\.drain_timeout_s: {FINITE}"),
        ({"jobs": {"gpu_hourly_usd": 1e9}}, r"^jobs\.gpu_hourly_usd: must be in \[0, 10000\]"),
        # Beyond datetime's range, the pruning job would fail on every run.
        ({"jobs": {"request_retention_days": 1e7}}, r"^jobs\.request_retention_days: must be in"),
        ({"server": {"config_watch_interval_s": 0.0}}, r"^server\.config_watch_interval_s: "),
        ({"store": {"retry_interval_s": 0.0}}, r"^store\.retry_interval_s: must be in"),
    ]:
        with pytest.raises(InvalidSettingError, match=message):
            build_config(raw, env={})


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("CONTROLPLANE_SERVER__DRAIN_TIMEOUT_S", "nan", f"server.drain_timeout_s: {FINITE}, got nan"),
        ("CONTROLPLANE_JOBS__GPU_HOURLY_USD", "inf", f"jobs.gpu_hourly_usd: {FINITE}, got inf"),
        ("CONTROLPLANE_JOBS__ROLLUP_INTERVAL_S", "1e999", f"jobs.rollup_interval_s: {FINITE}, got inf"),
        ("CONTROLPLANE_ENGINE__GPU_MEMORY_UTILIZATION", "-Infinity", f"engine.gpu_memory_utilization: {FINITE}, got -inf"),
    ],
)  # fmt: skip
def test_env_non_finite_stops_the_start(tmp_path, name, value, expected):
    cfg = write_config(tmp_path / "cp.toml", tmp_path / "data", None)
    done = serve(cfg, {name: value})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == f"controlplane: error: {expected}"
    assert "listening" not in done.stdout


def test_config_file_non_finite_stops_the_start(tmp_path):
    cfg = write_config(tmp_path / "cp.toml", tmp_path / "data", None, server={"drain_timeout_s": float("nan")})  # fmt: skip
    assert "drain_timeout_s = nan" in cfg.read_text()
    done = serve(cfg, {})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == f"controlplane: error: server.drain_timeout_s: {FINITE}, got nan"


def test_start_refuses_a_config_path_that_is_not_a_regular_file(tmp_path):
    """The start reads the file as the watcher and a save do (config_read): a FIFO nobody
    writes to is refused at once, naming what it is, never an open that blocks for good."""
    fifo = tmp_path / "cp.toml"
    os.mkfifo(fifo)
    done = serve(fifo, {})  # 60 s timeout: the old plain read blocked here for good
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == f"controlplane: error: config: {fifo}: a FIFO, not a regular file"
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * (4 * 1024 * 1024) + "\n")
    done = serve(big, {})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{big}: larger than 4194304 bytes" in done.stderr


# -- PATCH /admin/config and reloads through a running daemon -----------------------------------

# Python's json (and so the admin API) parses NaN, Infinity and -Infinity, and 1e999 as inf.
PATCH_CASES = [
    ('{"server": {"drain_timeout_s": NaN}}', "server.drain_timeout_s"),
    ('{"server.drain_timeout_s": 1e999}', "server.drain_timeout_s"),
    ('{"jobs": {"gpu_hourly_usd": NaN}}', "jobs.gpu_hourly_usd"),
    ('{"jobs": {"gpu_hourly_usd": Infinity}}', "jobs.gpu_hourly_usd"),
    ('{"jobs": {"peak_flops": -Infinity}}', "jobs.peak_flops"),
    ('{"jobs": {"rollup_interval_s": NaN}}', "jobs.rollup_interval_s"),
    ('{"jobs": {"utilization_interval_s": 1' + "0" * 400 + "}}", "jobs.utilization_interval_s"),
    # Whole price entries: every field of one is required (issue 52).
    (
        '{"prices": [{"model": "*", "effective_from": "2027-01-01", "prompt_per_mtok": NaN, '
        '"cached_prompt_per_mtok": 0, "completion_per_mtok": 0}]}',
        "prices[0].prompt_per_mtok",
    ),
    (
        '{"prices": [{"model": "*", "effective_from": "2027-01-01", "prompt_per_mtok": 0, '
        '"cached_prompt_per_mtok": 0, "completion_per_mtok": 1e999}]}',
        "prices[0].completion_per_mtok",
    ),
]


def test_patch_and_reload_refuse_non_finite_values(tiny_model_dir, tmp_path):
    path = config(tmp_path, tiny_model_dir)
    d = DaemonProcess.start(path)
    c = d.client(TOKEN, timeout=30)
    try:
        before = c.get("/admin/config").json()["fields"]
        for body, field in PATCH_CASES:
            r = c.patch("/admin/config", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 422, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == field and FINITE in err["message"], (body, err)
        assert c.get("/admin/config").json()["fields"] == before
        assert c.get("/admin/config/history").json()["changes"] == []

        # Reloads: a non-finite value in the file is refused with the field named.
        good = path.read_text()
        for key, literal in (("drain_timeout_s", "nan"), ("events_interval_s", "inf")):
            path.write_text(good.replace("[server]", f"[server]\n{key} = {literal}"))
            d.proc.send_signal(signal.SIGHUP)
            d.wait_for(f"rejected, keeping the running values: server.{key}: {FINITE}", 30)
        path.write_text(good + "[jobs]\ngpu_hourly_usd = nan\n")
        d.proc.send_signal(signal.SIGHUP)
        d.wait_for(f"rejected, keeping the running values: jobs.gpu_hourly_usd: {FINITE}", 30)
        assert c.get("/admin/config").json()["fields"] == before

        # A finite value still goes through, audited.
        r = c.patch("/admin/config", json={"server": {"drain_timeout_s": 5}})
        assert r.status_code == 200, r.text
        (row,) = c.get("/admin/config/history").json()["changes"]
        assert (row["field"], row["old_value"], row["new_value"]) == (
            "server.drain_timeout_s",
            30.0,
            5.0,
        )
    finally:
        assert d.stop() == 0
    drain = next(line for line in d.lines if "draining:" in line)
    assert "up to 5s" in drain and "nan" not in drain


# -- audit atomicity ----------------------------------------------------------------------------


# A whole price entry (every field of one is required).
PRICE = {
    "model": "*",
    "effective_from": "2027-01-01",
    "prompt_per_mtok": 0.5,
    "cached_prompt_per_mtok": 0.25,
    "completion_per_mtok": 2.0,
}


def _patch_fails_with_nothing_changed(c: httpx.Client, count_prices) -> None:
    before = c.get("/admin/config").json()["fields"]
    prices_before = count_prices()
    for body in (
        {"engine": {"max_num_seqs": 4}},
        {"server": {"drain_timeout_s": 7}, "jobs": {"gpu_hourly_usd": 3.5}},
        {"prices": [{**PRICE, "prompt_per_mtok": 1.0}]},
    ):
        r = c.patch("/admin/config", json=body)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["param"] == "audit" and "could not write the audit log" in err["message"]
        assert "nothing changed" in err["message"]
    assert c.get("/admin/config").json()["fields"] == before
    assert c.get("/admin/stats").json()["max_num_seqs"] == before["engine.max_num_seqs"]["value"]
    assert count_prices() == prices_before  # price rows go with their audit row, or not at all


def _patch_applies_and_audits_once(c: httpx.Client) -> None:
    """The first audited change: no row of the refused ones is in the log."""
    r = c.patch("/admin/config", json={"engine": {"max_num_seqs": 4}})
    assert r.status_code == 200, r.text
    assert c.get("/admin/stats").json()["max_num_seqs"] == 4
    changes = c.get("/admin/config/history").json()["changes"]
    assert [(h["field"], h["old_value"], h["new_value"]) for h in changes] == [
        ("engine.max_num_seqs", 32, 4)
    ]


def test_audit_failure_on_sqlite_applies_nothing(tiny_model_dir, tmp_path):
    path = config(tmp_path, tiny_model_dir)
    db = tmp_path / "data" / "controlplane.db"
    d = DaemonProcess.start(path)
    c = d.client(TOKEN, timeout=30)

    def sql(statement: str) -> int:
        with sqlite3.connect(db, timeout=30) as conn:
            row = conn.execute(statement).fetchone()
        return row[0] if row else 0

    try:
        # A real failure of the audit table: it is gone (renamed behind the daemon's back).
        sql("ALTER TABLE config_changes RENAME TO config_changes_away")
        _patch_fails_with_nothing_changed(c, lambda: sql("SELECT count(*) FROM prices"))
        d.wait_for("rejected: audit: could not write the audit log", 10)
        sql("ALTER TABLE config_changes_away RENAME TO config_changes")
        _patch_applies_and_audits_once(c)
    finally:
        assert d.stop() == 0


def test_audit_failure_with_postgres_unreachable_applies_nothing(tiny_model_dir, tmp_path, pg_url):
    name = make_url(pg_url).database
    path = config(tmp_path, tiny_model_dir, store={"url": pg_url})
    d = DaemonProcess.start(path)
    c = d.client(TOKEN, timeout=30)
    admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=10)

    def count_prices() -> int:
        with psycopg.connect(make_url(pg_url).set(drivername="postgresql").render_as_string(False)) as conn:  # fmt: skip
            return conn.execute("SELECT count(*) FROM prices").fetchone()[0]

    prices = count_prices()
    try:
        # The daemon's database stops accepting connections and its sessions are cut.
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
        _patch_fails_with_nothing_changed(c, lambda: prices)
    finally:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        admin.close()
    try:
        assert count_prices() == prices
        deadline = time.monotonic() + 30
        while True:  # the pool reconnects at the next checkout
            r = c.get("/admin/config/history")
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.json()["changes"] == []
        _patch_applies_and_audits_once(c)
    finally:
        assert d.stop() == 0
