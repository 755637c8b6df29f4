"""Costs on embedded defaults (issue 15): the documented default price is in force without a
config file's [[prices]]; a graceful stop runs a last cost rollup; reports show what the rollup
has not counted yet from the request rows, marked provisional; the restart line about
interrupted rows is logged once."""

from __future__ import annotations

import argparse
import json
import math
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, insert

from controlplane.accounting.cli import add_report_parser
from controlplane.accounting.reports import cost_report
from controlplane.accounting.rollup import run_rollup
from controlplane.accounting.samples import write_sample
from controlplane.accounting.utilization import UtilizationSample
from controlplane.config import Price, build_config, load_config
from controlplane.store import RequestRow, make_engine, sync_prices, time_buckets, upgrade
from harness import DaemonProcess, rows, wait_rows, write_config

TOKEN = "costs-token-0123456789ab"
MODEL = "model"
REPO = Path(__file__).resolve().parents[2]
# The README's default: "*" from 2026-01-01, USD per million tokens.
DEFAULT = Price("*", datetime(2026, 1, 1, tzinfo=UTC), 0.10, 0.05, 0.40)


def cli(capsys: pytest.CaptureFixture, *argv: str) -> str:
    parser = argparse.ArgumentParser(prog="controlplane")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", "cost", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def row_cost(r: dict, price: Price = DEFAULT) -> float:
    cached = min(r["cached_prompt_tokens"], r["prompt_tokens"])
    return (
        (r["prompt_tokens"] - cached) * price.prompt_per_mtok
        + cached * price.cached_prompt_per_mtok
        + r["completion_tokens"] * price.completion_per_mtok
    ) / 1e6


# -- the default price --------------------------------------------------------------------------


def test_default_price_is_in_force_and_can_be_replaced_or_removed():
    assert load_config(None, env={}).prices == (DEFAULT,)
    # The shipped config file shows the same default.
    assert load_config(REPO / "config" / "controlplane.toml", env={}).prices == (DEFAULT,)
    mine = {"model": "m", "effective_from": "2026-06-01", "completion_per_mtok": 1.0}
    assert [p.model for p in build_config({"prices": [mine]}, env={}).prices] == ["m"]
    assert build_config({"prices": []}, env={}).prices == ()


# -- a short run on defaults: cost per request, provisional report, final rollup ---------------


def test_short_run_on_defaults_reports_cost_before_and_after_sigterm(
    tiny_model_dir, tmp_path, capsys
):
    # No [[prices]]; rollups every hour, so only the final rollup at SIGTERM can write one.
    path = write_config(
        tmp_path / "cp.toml",
        tmp_path / "data",
        tiny_model_dir,
        store={"flush_interval_s": 0.1},
        jobs={"rollup_interval_s": 3600.0},
        admin_tokens=[{"name": "ops", "token": TOKEN}],
    )
    url = load_config(path, env={}).store_url
    d = DaemonProcess.start(path)
    c = d.client(TOKEN, timeout=30)
    try:
        for n in (3, 5, 8):
            body = {"model": MODEL, "prompt": "cost me", "max_tokens": n, "ignore_eos": True}
            assert httpx.post(d.url + "/v1/completions", json=body, timeout=60).status_code == 200
        done = wait_rows(url, lambda found: len(found) == 3, where="status = 'success'")
        # On defaults every request is priced with the default price.
        for r in done:
            assert r["cost_usd"] is not None and r["price_id"] is not None
            assert float(r["cost_usd"]) == pytest.approx(row_cost(r), rel=1e-9)
        list_cost = math.fsum(float(r["cost_usd"]) for r in done)
        prompt = sum(r["prompt_tokens"] for r in done)
        assert list_cost > 0

        # Before any rollup: the report shows the requests, provisional, summed from the rows.
        since = (datetime.now(UTC) - timedelta(hours=24)).isoformat()
        until = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
        window = ("--since", since, "--until", until, "--url", url)
        doc = json.loads(cli(capsys, *window, "--group-by", "model", "--format", "json"))
        (row,) = doc["rows"]
        assert row["provisional"] is True and doc["totals"]["provisional"] is True
        assert row["requests_succeeded"] == 3 and row["completion_tokens"] == 16
        assert row["prompt_tokens"] == prompt
        assert row["list_cost_usd"] == pytest.approx(list_cost, rel=1e-9)
        # /admin/costs returns the same document.
        api = c.get("/admin/costs", params={"since": since, "until": until, "group_by": "model"})
        assert {k: api.json()[k] for k in doc} == doc
        table = cli(capsys, *window)
        assert "* provisional: requests the hourly rollup has not counted yet" in table
    finally:
        assert d.stop(signal.SIGTERM) == 0
    assert any("final cost rollup written" in line for line in d.lines)

    # After SIGTERM: the last rollup counted them; nothing is provisional any more.
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rolled = conn.execute(
            sa.text("SELECT sum(requests_succeeded), sum(list_cost_usd) FROM cost_rollups")
        ).one()
    engine.dispose()
    assert rolled[0] == 3 and float(rolled[1]) == pytest.approx(list_cost, rel=1e-9)
    doc = json.loads(cli(capsys, "--since", "24h", "--url", url, "--format", "json"))
    assert doc["totals"]["provisional"] is False
    assert not any(r["provisional"] for r in doc["rows"])
    assert doc["totals"]["list_cost_usd"] == pytest.approx(list_cost, rel=1e-9)
    assert doc["totals"]["requests_succeeded"] == 3
    table = cli(capsys, "--since", "24h", "--url", url)
    assert "no cost data" not in table and "provisional" not in table


# -- provisional rows, store level --------------------------------------------------------------

HOUR = datetime(2026, 3, 1, 12, tzinfo=UTC)


def add_request(
    engine: Engine,
    id: str,
    minute: int,
    *,
    instance: str,
    price,
    status: str = "success",
    key: str = "k",
    prompt: int = 100,
    cached: int = 0,
    completion: int = 10,
) -> dict:
    arrival = HOUR + timedelta(minutes=minute)
    values = dict(
        id=id,
        instance_id=instance,
        model="m",
        endpoint="completions",
        api_key_name=key,
        status=status,
        arrival_time=arrival,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        completion_tokens=completion,
        price_id=price.id,
        cost_usd=None
        if status == "running"
        else row_cost(
            dict(prompt_tokens=prompt, cached_prompt_tokens=cached, completion_tokens=completion)
        ),
        hour_bucket=time_buckets(arrival)[0],
        day_bucket=time_buckets(arrival)[1],
    )
    with engine.begin() as conn:
        conn.execute(insert(RequestRow.__table__).values(**values))
    return values


def test_provisional_rows_equal_the_request_rows_until_rolled_up(db_engine: Engine):
    sync_prices(db_engine, [DEFAULT])
    with db_engine.connect() as conn:
        price = conn.execute(sa.text("SELECT id FROM prices")).one()
    gpu = dict(gpu_hourly_usd=3.6, num_gpus=1, peak_flops=0.0)
    write_sample(
        db_engine, "a", UtilizationSample(HOUR + timedelta(minutes=20), 600.0, "m", 0.5), []
    )
    first = [add_request(db_engine, f"a{i}", i, instance="a", price=price) for i in range(2)]
    first.append(add_request(db_engine, "a-early", -30, instance="a", price=price))  # 11:30
    run_rollup(db_engine, "a", now=HOUR + timedelta(minutes=25), **gpu)

    def report(group_by: str = "api_key") -> dict:
        rep = cost_report(db_engine, since=HOUR, until=HOUR + timedelta(hours=1), group_by=group_by)
        assert not rep.empty
        return {r.get("api_key", ""): r for r in rep.rows} | {"total": rep.totals}

    rolled = report()
    assert rolled["total"]["provisional"] is False and rolled["k"]["requests_succeeded"] == 2
    gpu_cost = rolled["total"]["gpu_cost_usd"]  # 3.6 USD/h x 600 s = 0.6 USD
    assert gpu_cost == pytest.approx(0.6, rel=1e-12)

    # Requests that ended after the rollup ran, and an instance that never ran one.
    later = [
        add_request(db_engine, "a2", 30, instance="a", price=price, prompt=300, cached=100),
        add_request(db_engine, "a3", 31, instance="a", price=price, key="other", status="error"),
    ]
    add_request(db_engine, "a4", 32, instance="a", price=price, status="running")  # not final
    new = [add_request(db_engine, "b0", 40, instance="b", price=price, completion=50)]
    got = report()
    twelve_k = [*first[:2], later[0], *new]  # a0, a1, a2, b0: the 12:00 hour's key "k"
    assert got["k"]["provisional"] is True and got["other"]["provisional"] is True
    assert got["total"]["provisional"] is True
    assert got["k"]["requests_succeeded"] == len(twelve_k) == 4
    assert got["k"]["prompt_tokens"] == sum(r["prompt_tokens"] for r in twelve_k)
    assert got["k"]["cached_prompt_tokens"] == 100
    assert got["other"]["requests_failed"] == 1
    every = [*first[:2], *later, *new]  # the 12:00 hour's final rows
    assert got["total"]["list_cost_usd"] == pytest.approx(
        math.fsum(r["cost_usd"] for r in every), rel=1e-12
    )
    assert got["total"]["completion_tokens"] == sum(r["completion_tokens"] for r in every)
    assert got["total"]["gpu_cost_usd"] == pytest.approx(gpu_cost, rel=1e-12)  # as last rolled
    # The 11:00 hour, which the rollup has counted in full, is not provisional.
    hourly = cost_report(
        db_engine, since=HOUR - timedelta(hours=1), until=HOUR + timedelta(hours=1), group_by="hour"
    )
    assert [(r["hour"][11:], r["provisional"]) for r in hourly.rows] == [
        ("11", False),
        ("12", True),
    ]
    assert hourly.rows[0]["list_cost_usd"] == pytest.approx(first[2]["cost_usd"], rel=1e-12)

    # After the next rollup of both instances: the same figures, final.
    run_rollup(db_engine, "a", now=HOUR + timedelta(minutes=50), **gpu)
    run_rollup(db_engine, "b", now=HOUR + timedelta(minutes=50), **gpu)
    final = report()
    assert final["total"]["provisional"] is False
    for name in ("requests_succeeded", "requests_failed", "prompt_tokens", "completion_tokens"):
        assert final["total"][name] == got["total"][name], name
    assert final["total"]["list_cost_usd"] == pytest.approx(got["total"]["list_cost_usd"])
    assert final["total"]["gpu_cost_usd"] == pytest.approx(gpu_cost, rel=1e-12)


# -- the restart line ---------------------------------------------------------------------------


def test_interrupted_rows_line_is_logged_once(tiny_model_dir, tmp_path):
    path = write_config(
        tmp_path / "cp.toml",
        tmp_path / "data",
        tiny_model_dir,
        server={"instance_id": "cp-restarted"},
    )
    url = load_config(path, env={}).store_url
    # A row left "running" by a previous process of this instance that was killed.
    upgrade(url)
    engine = make_engine(url)
    arrival = datetime.now(UTC) - timedelta(minutes=5)
    with engine.begin() as conn:
        conn.execute(
            insert(RequestRow.__table__).values(
                id="killed-1",
                instance_id="cp-restarted",
                model=MODEL,
                endpoint="completions",
                status="running",
                arrival_time=arrival,
                hour_bucket=time_buckets(arrival)[0],
                day_bucket=time_buckets(arrival)[1],
            )
        )
    engine.dispose()
    d = DaemonProcess.start(path)
    assert d.stop() == 0
    assert [r["status"] for r in rows(url)] == ["interrupted"]
    marked = [line for line in d.lines if "left running" in line]
    assert len(marked) == 1, marked
