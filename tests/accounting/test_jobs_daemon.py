"""Scheduled jobs inside a real daemon: samples and rollups land, intervals are live, the admin
endpoints report the same numbers as the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import sqlalchemy as sa

TOKEN = "jobs-token-0123456789abcdef"
MODEL = "model"


def count(url: str, table: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()
    finally:
        engine.dispose()


def wait_for(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.fixture
def jobs_daemon(make_daemon):
    return make_daemon(
        admin_tokens=[{"name": "ops", "token": TOKEN}],
        store={"flush_interval_s": 0.1},
        jobs={"utilization_interval_s": 0.5, "rollup_interval_s": 1.0, "gpu_hourly_usd": 3.6},
        prices=[
            {
                "model": "*",
                "effective_from": "2020-01-01T00:00:00Z",
                "prompt_per_mtok": 1.0,
                "cached_prompt_per_mtok": 0.5,
                "completion_per_mtok": 2.0,
            }
        ],
    )


def test_jobs_write_samples_and_rollups_and_admin_matches_cli(jobs_daemon):
    d = jobs_daemon
    cfg = d.cfg
    c = d.client(TOKEN, timeout=30)
    for n in (5, 7, 9):
        r = httpx.post(
            d.url + "/v1/completions",
            timeout=30,
            json={"model": MODEL, "prompt": "cost", "max_tokens": n, "ignore_eos": True},
        )
        assert r.status_code == 200
    wait_for(lambda: count(cfg.store_url, "utilization_samples") >= 3)

    # The rollup sees the three finished requests (rows land within a flush interval).
    def rolled_completion_tokens() -> int:
        report = c.get("/admin/costs", params={"group_by": "model"}).json()
        return report["totals"].get("completion_tokens") or 0

    wait_for(lambda: rolled_completion_tokens() == 5 + 7 + 9)
    api = c.get("/admin/costs", params={"group_by": "model", "since": "1h"}).json()
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "controlplane",
            "report",
            "cost",
            "--url",
            cfg.store_url,
            "--group-by",
            "model",
            "--since",
            "1h",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    from_cli = json.loads(cli.stdout)
    assert from_cli["totals"]["completion_tokens"] == api["totals"]["completion_tokens"] == 21
    assert from_cli["totals"]["list_cost_usd"] == pytest.approx(api["totals"]["list_cost_usd"])
    util = c.get("/admin/utilization", params={"since": "1h"}).json()
    assert util["rows"] and not util["empty"]


def test_job_intervals_are_live(jobs_daemon):
    d = jobs_daemon
    cfg = d.cfg
    c = d.client(TOKEN, timeout=30)
    from controlplane.jobs.periodic import AUTOPILOT_JOB, ROLLUP_JOB, SAMPLE_JOB

    assert d.daemon.jobs.intervals() == {SAMPLE_JOB: 0.5, ROLLUP_JOB: 1.0, AUTOPILOT_JOB: 10.0}
    r = c.patch(
        "/admin/config",
        json={
            "jobs": {"utilization_interval_s": 30, "rollup_interval_s": 45},
            "autopilot": {"interval_s": 20},
        },
    )
    assert r.status_code == 200
    assert d.daemon.jobs.intervals() == {SAMPLE_JOB: 30.0, ROLLUP_JOB: 45.0, AUTOPILOT_JOB: 20.0}
    # No sample lands at the old 0.5 s pace any more.
    before = count(cfg.store_url, "utilization_samples")
    time.sleep(2.0)
    assert count(cfg.store_url, "utilization_samples") - before <= 1
    r = c.patch("/admin/config", json={"jobs": {"utilization_interval_s": 0.1}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "jobs.utilization_interval_s"
    history = c.get("/admin/config/history", params={"field": "jobs.rollup_interval_s"}).json()[
        "changes"
    ]
    assert (history[0]["old_value"], history[0]["new_value"]) == (1.0, 45.0)


def test_no_gpu_telemetry_is_one_log_line_and_null_fields(jobs_daemon, caplog):
    d = jobs_daemon
    cfg = d.cfg
    wait_for(lambda: count(cfg.store_url, "utilization_samples") >= 2)
    assert count(cfg.store_url, "gpu_samples") == 0
    assert d.daemon.jobs.gpus.available is False
