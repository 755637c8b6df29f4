"""Refused requests counted in SQL (migration 0014, `refusals`) and the requests report by API
key: its throttled counts (in all and by reason) and each table key's budget use.

Through a real daemon on SQLite and PostgreSQL (tiny model, loopback, a table key limited to one
request a minute, prices of $1 a token): N refusals read N in `controlplane report requests
--group-by api_key` after a flush, a second flush adds to the same row, a refusal still pending
at a stop is written by the stop and the restarted daemon (the same instance id) adds to it;
the report's budget use equals /admin/keys' spend. And the recorder alone: counts kept through
a write that fails (the table missing until the migration runs) are written once, neither
lost nor doubled; a key refused every request has a report row of its own."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from controlplane.accounting.reports import REQUEST_METRICS, requests_report
from controlplane.config import StoreSettings
from controlplane.store import Recorder, make_engine, upgrade
from harness import InProcessDaemon
from tests.accounting.test_reports_cli import cli
from tests.tenants.test_budgets_daemon import PRICES, complete, cost, listed, make_key

RPM = "requests_per_minute"


def refuse(d: InProcessDaemon, secret: str, n: int) -> None:
    """n requests of the key, each refused by its one request a minute."""
    for _ in range(n):
        r = complete(d, secret)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text


def report_row(capsys, url: str, key: str) -> dict[str, Any]:
    """The key's row of `controlplane report requests --group-by api_key --format json`."""
    argv = ("report", "requests", "--url", url, "--since", "3h", "--group-by", "api_key")
    capsys.readouterr()  # what the daemons printed
    assert cli(*argv, "--format", "json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["columns"][-6:] == [
        "throttled",
        "throttled_by_reason",
        "budget_usd",
        "budget_period",
        "budget_spend_usd",
        "budget_use",
    ]
    return next(r for r in doc["rows"] if r["api_key"] == key)


def refusal_rows(url: str) -> list[dict[str, Any]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM refusals"))]
    finally:
        engine.dispose()


def test_throttled_counts_add_across_flushes_and_a_restart(make_daemon, db_url, capsys):
    # Only flush() and the stop write (flush_interval_s 30): each step's count is what that
    # write added, and the last refusal is still in memory when the daemon stops.
    d = make_daemon(
        admin=True,
        engine={"max_num_seqs": 2, "max_model_len": 256},
        store={"url": db_url, "flush_interval_s": 30},
        prices=PRICES,
    )
    instance = d.daemon.instance_id
    secret = make_key(d, "capped", budget_usd=1000, budget_period="day", requests_per_minute=1)
    ok = [complete(d, secret)]
    assert ok[0].status_code == 200, ok[0].text
    refuse(d, secret, 3)
    assert d.daemon.recorder.flush(10)
    row = report_row(capsys, db_url, "capped")
    assert (row["requests_succeeded"], row["throttled"]) == (1, 3)
    assert row["throttled_by_reason"] == {RPM: 3}

    refuse(d, secret, 2)
    assert d.daemon.recorder.flush(10)
    row = report_row(capsys, db_url, "capped")
    assert row["throttled"] == 5 and row["throttled_by_reason"] == {RPM: 5}
    # Budget use: the spend /admin/keys shows (its own requests counted as they ended), the
    # report's from the rows.
    shown = listed(d, "capped")["budget"]
    assert shown["spend_usd"] == cost(ok[0]) > 0
    assert row["budget_spend_usd"] == shown["spend_usd"]
    assert row["budget_use"] == pytest.approx(shown["use"])
    assert (row["budget_usd"], row["budget_period"]) == (1000, "day")

    refuse(d, secret, 1)  # pending: written by the stop
    d.stop()
    d2 = make_daemon.from_file(d.config_path)
    assert d2.daemon.instance_id == instance  # the same daemon, restarted
    assert report_row(capsys, db_url, "capped")["throttled"] == 6
    ok.append(complete(d2, secret))  # a fresh limiter: one more admitted
    assert ok[-1].status_code == 200, ok[-1].text
    refuse(d2, secret, 2)
    assert d2.daemon.recorder.flush(10)
    row = report_row(capsys, db_url, "capped")
    assert (row["requests_succeeded"], row["throttled"]) == (2, 8)
    # Added to its rows, never a row per refusal: one per hour (two if the test crossed one).
    rows = refusal_rows(db_url)
    assert {(r["instance_id"], r["api_key_name"], r["reason"]) for r in rows} == {
        (instance, "capped", RPM)
    }
    assert sum(r["requests"] for r in rows) == 8 and len(rows) <= 2
    shown = listed(d2, "capped")["budget"]
    assert shown["spend_usd"] == sum(cost(r) for r in ok)
    assert row["budget_spend_usd"] == shown["spend_usd"]


T0 = datetime(2026, 3, 1, 12, 10, tzinfo=UTC)


def test_counts_survive_a_failed_write_and_a_refused_key_has_its_row(db_url):
    # Migrated to 0013: no refusals table yet, so the write fails as an outage would.
    upgrade(db_url, "0013")
    engine = make_engine(db_url)
    rec = Recorder(engine, StoreSettings(flush_interval_s=0.05, retry_interval_s=0.05))
    try:
        for _ in range(4):
            rec.refused("inst-a", "shut-out", "insufficient_quota", at=T0)
        rec.refused("inst-a", None, "queue_full", at=T0)  # an open API's
        rec.refused("inst-b", "shut-out", "suspended", at=T0 + timedelta(hours=1))
        assert not rec.flush(0.5)  # kept, retried
        assert rec.refusals_written == 0 and rec.failed_writes >= 1
        upgrade(db_url)
        assert rec.flush(10)
        assert (rec.refusals_written, rec.refusals_lost) == (6, 0)
    finally:
        rec.close()
    with engine.connect() as conn:
        got = conn.execute(
            sa.text("SELECT instance_id, api_key_name, reason, requests FROM refusals")
        ).all()
    assert sorted(map(tuple, got)) == [
        ("inst-a", "", "queue_full", 1),
        ("inst-a", "shut-out", "insufficient_quota", 4),
        ("inst-b", "shut-out", "suspended", 1),
    ]

    # Every request of "shut-out" refused: no request row, yet a row in the report by key.
    report = requests_report(engine, since=T0, until=T0 + timedelta(hours=2), group_by="api_key")
    by_key = {r["api_key"]: r for r in report.rows}
    assert list(by_key) == ["", "shut-out"] and not report.empty
    row = by_key["shut-out"]
    assert (row["requests_succeeded"], row["requests_failed"], row["list_cost_usd"]) == (0, 0, 0)
    assert row["throttled"] == 5
    assert row["throttled_by_reason"] == {"insufficient_quota": 4, "suspended": 1}
    assert row["budget_usd"] is None  # not a table key with a budget
    assert report.totals["throttled"] == 6
    # By hour: the hour buckets are the precision; the first hour alone holds five.
    first = requests_report(engine, since=T0, until=T0 + timedelta(minutes=5), group_by="api_key")
    assert {r["api_key"]: r["throttled"] for r in first.rows} == {"": 1, "shut-out": 4}
    hourly = requests_report(
        engine, since=T0, until=T0 + timedelta(hours=2), group_by="hour,api_key"
    )
    assert [(r["hour"], r["api_key"], r["throttled"]) for r in hourly.rows] == [
        ("2026-03-01T12", "", 1),
        ("2026-03-01T12", "shut-out", 4),
        ("2026-03-01T13", "shut-out", 1),
    ]
    assert "budget_usd" not in hourly.columns  # a current period: by api_key alone
    # Grouped by what refusals are not kept by: the columns as before.
    by_user = requests_report(engine, since=T0, until=T0 + timedelta(hours=2), group_by="user")
    assert by_user.columns == ["user", *REQUEST_METRICS] and by_user.empty
    engine.dispose()


def test_report_cli_shows_throttled_in_table_and_csv(db_url, capsys):
    upgrade(db_url)
    engine = make_engine(db_url)
    rec = Recorder(engine, StoreSettings(flush_interval_s=0.05))
    for reason in (RPM, RPM, "max_concurrent"):
        rec.refused("inst-a", "k", reason, at=T0)
    rec.close()
    engine.dispose()
    window = ("--since", "2026-03-01T12:00", "--until", "2026-03-01T13:00")
    argv = ("report", "requests", "--url", db_url, *window, "--group-by", "api_key")
    assert cli(*argv, "--format", "csv") == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split(",")
    assert header[-6:-4] == ["throttled", "throttled_by_reason"]
    cells = dict(zip(header, lines[1].split(","), strict=True))
    assert cells["throttled"] == "3"
    assert cells["throttled_by_reason"] == "max_concurrent=1;requests_per_minute=2"
    assert cli(*argv) == 0
    table = capsys.readouterr().out
    assert "throttled by reason" in table
    assert "max_concurrent 1, requests_per_minute 2" in table
