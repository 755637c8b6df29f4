"""`controlplane report cost|utilization` on SQLite and PostgreSQL: table / csv / json output,
the totals row, the empty-database sentence, bad flags, and no torch."""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from datetime import timedelta

import pytest
from sqlalchemy import Engine

from controlplane.accounting.cli import add_report_parser
from controlplane.accounting.reports import cost_report, utilization_report
from controlplane.accounting.rollup import run_rollup
from controlplane.config import Price, StoreSettings
from controlplane.store import Recorder, sync_prices, upgrade
from tests.accounting.test_rollup import DAY, GPU, NOW, add_sample, at, seed
from tests.store.test_store import record

WINDOW = ("--since", "2026-03-01", "--until", "2026-03-02")


@pytest.fixture
def seeded(db_engine: Engine, db_url: str) -> str:
    seed(db_engine)
    run_rollup(db_engine, "inst-a", now=NOW, **GPU)
    run_rollup(db_engine, "inst-b", now=NOW, **GPU)
    return db_url


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="controlplane")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _number(value: str) -> float | None:
    return None if value == "" else float(value)


def test_cost_csv_json_table(seeded: str, db_engine: Engine, capsys) -> None:
    expected = cost_report(
        db_engine, since=DAY, until=DAY.replace(day=2), group_by=["model", "api_key"]
    )
    assert len(expected.rows) == 6

    assert cli("report", "cost", "--url", seeded, *WINDOW, "--group-by", "api_key,model", "--format", "csv") == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == expected.columns == ["model", "api_key", *expected.columns[2:]]
    assert len(rows) == 6  # no totals row in csv: scripts can sum the columns
    for got, want in zip(rows, expected.rows, strict=True):
        assert (got["model"], got["api_key"]) == (want["model"], want["api_key"])
        assert got["provisional"] == "false"  # everything is rolled up
        for column in expected.columns[2:]:
            if column == "provisional":
                continue
            if want[column] is None:
                assert got[column] == "", column
            else:
                assert _number(got[column]) == pytest.approx(want[column], rel=1e-12), column
    alice = next(r for r in rows if (r["model"], r["api_key"]) == ("m", "alice"))
    # both instances' 12:00 alice rows: 3 successes, 4000 prompt tokens, 3.0 USD of GPU time
    assert (int(alice["requests_succeeded"]), int(alice["prompt_tokens"])) == (3, 4000)
    assert float(alice["gpu_cost_usd"]) == pytest.approx(3.0, rel=1e-12)
    assert float(alice["list_cost_usd"]) == pytest.approx(0.0113, rel=1e-12)

    assert cli("report", "cost", "--url", seeded, *WINDOW, "--group-by", "model,api_key", "--format", "json") == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"columns", "rows", "totals", "since", "until", "source", "scope", "instance_id"}  # fmt: skip
    assert (doc["source"], doc["scope"], doc["instance_id"]) == ("rollups", "fleet", None)
    assert doc["columns"] == expected.columns and doc["rows"] == expected.rows
    assert doc["totals"] == expected.totals
    assert (doc["since"], doc["until"]) == (
        "2026-03-01T00:00:00+00:00",
        "2026-03-02T00:00:00+00:00",
    )
    # inst-a 8 USD (11:00 2, 12:00 4, 13:00 2) + inst-b 4 USD; list: 0.0093 + 0.0022 + 0.004
    # + 0.0006 (inst-a) + 0.002 (inst-b) = 0.0181 USD
    assert doc["totals"]["gpu_cost_usd"] == pytest.approx(12.0, rel=1e-12)
    assert doc["totals"]["list_cost_usd"] == pytest.approx(0.0181, rel=1e-12)
    assert doc["totals"]["prompt_tokens"] == 7300

    assert cli("report", "cost", "--url", seeded, *WINDOW, "--group-by", "day,model,api_key") == 0  # fmt: skip
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert "cost report, 2026-03-01 00:00 UTC to 2026-03-02 00:00 UTC" in lines[0]
    total = next(line for line in lines if "total" in line)
    # GPU $ 12.0000 and all 7,300 prompt tokens in the totals row (below the six group rows)
    assert "12.0000" in total and "7,300" in total and "0.0181" in total
    assert lines.index(total) > max(i for i, line in enumerate(lines) if "(idle)" in line)
    # The prefix cache's share and savings: 400 of 7,300 prompt tokens cached (5.5%), saving
    # 0.0003 USD at list price (200 at P1: 200 x 0.5 / 1e6, 200 at P2: 200 x 1.0 / 1e6).
    header = next(line for line in lines if "cache saved $" in line)
    assert "cached" in header
    assert "5.5%" in total and "0.0003" in total
    assert doc["totals"]["cache_savings_usd"] == pytest.approx(0.0003, rel=1e-12)
    assert "(no key)" in table and "2026-03-01" in table and "alice" in table


# USD per million tokens: prompt 1.00, cached prompt 0.25, completion 2.00.
CACHE_PRICE = (Price("*", DAY - timedelta(days=1), 1.00, 0.25, 2.00),)
# (id, API key, prompt, cached, completion), all at 12:00 on DAY (tests.store.test_store.record).
CACHE_REQUESTS = (
    ("a1", "alice", 1000, 400, 100),
    ("a2", "alice", 2000, 1600, 300),
    ("b1", "bob", 1000, 0, 200),
)


def test_cached_share_and_savings_exact(db_engine: Engine, db_url: str, capsys) -> None:
    sync_prices(db_engine, CACHE_PRICE)
    rec = Recorder(db_engine, StoreSettings(flush_interval_s=0.02))
    try:
        for id, key, prompt, cached, completion in CACHE_REQUESTS:
            rec.submit(
                record(
                    id,
                    api_key_name=key,
                    prompt_tokens=prompt,
                    cached_prompt_tokens=cached,
                    completion_tokens=completion,
                )
            )
        assert rec.flush(10)
    finally:
        rec.close(timeout=5)
    # By hand: savings = cached x (1.00 - 0.25) / 1e6. alice: (400 + 1600) x 0.75 = 1500 micro-
    # USD, bob 0. Cached share: alice 2000 / 3000, bob 0 / 1000, all 2000 / 4000. List cost
    # (micro-USD): a1 600 + 100 + 200 = 900, a2 400 + 400 + 600 = 1400, b1 1000 + 400 = 1400;
    # list + savings is the cost at the full prompt price: alice 2300 + 1500 = 3800.
    want = {
        "alice": (2000 / 3000, 0.0015, 0.0023),
        "bob": (0.0, 0.0, 0.0014),
        "total": (0.5, 0.0015, 0.0037),
    }

    def figures(report) -> dict[str, tuple[float, float, float]]:
        rows = {r["api_key"]: r for r in report.rows} | {"total": report.totals}
        return {
            k: (r["cached_share"], r["cache_savings_usd"], r["list_cost_usd"])
            for k, r in rows.items()
            if k in want
        }

    for rolled_up in (False, True):  # from the request rows (provisional), then the rollup
        if rolled_up:
            run_rollup(db_engine, "inst-a", now=NOW, **GPU)
        report = cost_report(db_engine, since=DAY, until=DAY.replace(day=2), group_by="api_key")
        assert report.totals["provisional"] is not rolled_up
        got = figures(report)
        assert got.keys() == want.keys()
        for key, (share, savings, list_cost) in want.items():
            assert got[key][0] == pytest.approx(share, rel=1e-12), key
            assert got[key][1] == pytest.approx(savings, rel=1e-12, abs=1e-15), key
            assert got[key][2] == pytest.approx(list_cost, rel=1e-12), key

    assert cli("report", "cost", "--url", db_url, *WINDOW, "--group-by", "api_key", "--format", "json") == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["totals"]["cached_share"] == pytest.approx(0.5, rel=1e-12)
    assert doc["totals"]["cache_savings_usd"] == pytest.approx(0.0015, rel=1e-12)
    assert cli("report", "cost", "--url", db_url, *WINDOW, "--group-by", "api_key", "--format", "csv") == 0  # fmt: skip
    by_key = {r["api_key"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert float(by_key["alice"]["cached_share"]) == pytest.approx(2000 / 3000, rel=1e-12)
    assert float(by_key["alice"]["cache_savings_usd"]) == pytest.approx(0.0015, rel=1e-12)
    assert float(by_key["bob"]["cache_savings_usd"]) == 0.0
    assert cli("report", "cost", "--url", db_url, *WINDOW, "--group-by", "api_key") == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "API key" in line)
    assert "cached" in header and "cache saved $" in header
    alice = next(line for line in lines if "alice" in line)
    bob = next(line for line in lines if "bob" in line)
    total = next(line for line in lines if "total" in line)
    assert "66.7%" in alice and "0.0015" in alice
    assert "0.0%" in bob and "0.0000" in bob
    assert "50.0%" in total and "0.0015" in total


def test_utilization_shows_hit_and_acceptance_rates(db_engine: Engine, db_url: str, capsys) -> None:
    # Time-weighted over the samples that carry a rate: hit (0.5 x 900 + 0.25 x 900) / 1800 =
    # 0.375, acceptance 0.75 (one sample); the 1800 s sample without either does not count
    # (as 0 it would halve the hit rate).
    add_sample(
        db_engine, at(12, 15), 900, 0.5, prefix_cache_hit_rate=0.5, spec_acceptance_rate=0.75
    )
    add_sample(db_engine, at(12, 30), 900, 0.5, prefix_cache_hit_rate=0.25)
    add_sample(db_engine, at(13, 0), 1800, 0.5)
    assert cli("report", "utilization", "--url", db_url, *WINDOW, "--group-by", "day", "--format", "json") == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["totals"]["mean_prefix_cache_hit_rate"] == pytest.approx(0.375, rel=1e-12)
    assert doc["totals"]["mean_spec_acceptance_rate"] == pytest.approx(0.75, rel=1e-12)
    assert cli("report", "utilization", "--url", db_url, *WINDOW, "--group-by", "day") == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "samples" in line)
    assert "prefix hit" in header and "spec accept" in header
    total = next(line for line in lines if "total" in line)
    assert "37.5%" in total and "75.0%" in total


@pytest.mark.parametrize("kind", ["cost", "utilization"])
def test_database_before_0005_is_not_migrated(kind: str, db_url: str, capsys) -> None:
    # The report reads columns 0005 adds: a database one migration short gets the sentence
    # (exit 0), not a database error.
    upgrade(db_url, "0004")
    assert cli("report", kind, "--url", db_url, *WINDOW) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"no {kind} data between ") and "controlplane db upgrade" in out


def test_utilization_formats(seeded: str, db_engine: Engine, capsys) -> None:
    expected = utilization_report(
        db_engine, since=DAY, until=DAY.replace(day=2), group_by=["hour", "instance"]
    )
    assert cli("report", "utilization", "--url", seeded, *WINDOW, "--group-by", "hour,instance", "--format", "json") == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows"] == expected.rows and doc["totals"] == expected.totals
    assert doc["totals"]["samples"] == 8 and doc["totals"]["covered_s"] == 10800.0
    # busy: inst-a 450 + 1800 + 900, inst-b 1800 seconds of 10800
    assert doc["totals"]["mean_busy_fraction"] == pytest.approx(4950 / 10800, rel=1e-12)

    assert cli("report", "utilization", "--url", seeded, *WINDOW, "--format", "csv", "--group-by", "day") == 0  # fmt: skip
    (row,) = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert row["day"] == "2026-03-01" and int(row["samples"]) == 8
    assert float(row["mean_busy_fraction"]) == pytest.approx(4950 / 10800, rel=1e-12)
    assert row["mean_gpu_power_w"] == ""  # no GPU readings

    assert cli("report", "utilization", "--url", seeded, *WINDOW) == 0  # default: by hour
    lines = capsys.readouterr().out.splitlines()
    assert sum("2026-03-01T1" in line for line in lines) == 3  # 11:00, 12:00, 13:00
    total = next(line for line in lines if "total" in line)
    assert "45.8%" in total and "3.00 h" in total  # busy 4950 / 10800; 10800 s covered


def test_empty_database_and_window(db_engine: Engine, db_url: str, capsys) -> None:
    assert cli("report", "cost", "--url", db_url) == 0
    out = capsys.readouterr().out
    assert out.startswith("no cost data between ")
    assert "is the daemon running with store.record_requests = true and have rollups run?" in out
    assert cli("report", "utilization", "--url", db_url, *WINDOW) == 0
    out = capsys.readouterr().out
    assert out.startswith("no utilization data between 2026-03-01 00:00 UTC and 2026-03-02")
    # For scripts: the empty document on stdout, the sentence on stderr.
    assert cli("report", "cost", "--url", db_url, *WINDOW, "--format", "json") == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["rows"] == [] and doc["totals"]["gpu_cost_usd"] is None
    assert "no cost data" in captured.err
    assert cli("report", "cost", "--url", db_url, *WINDOW, "--format", "csv") == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [",".join(doc["columns"])]
    assert "no cost data" in captured.err


def test_missing_database_is_not_created(tmp_path, capsys) -> None:
    path = tmp_path / "nothing" / "here.db"
    assert cli("report", "cost", "--url", f"sqlite:///{path}") == 0
    out = capsys.readouterr().out
    assert out.startswith("no cost data between ") and "controlplane db upgrade" in out
    assert not path.exists() and not path.parent.exists()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("cost", "--group-by", "instance"), "--group-by"),
        (("utilization", "--group-by", "model"), "--group-by"),
        (("cost", "--group-by", "day,hour"), "--group-by"),
        (("cost", "--since", "yesterday"), "--since"),
        (("cost", "--until", "soon"), "--until"),
        (("cost", "--since", "2026-03-02", "--until", "2026-03-01"), "--since"),
        (("cost", "--format", "xml"), "--format"),
        (("cost", "--url", "sqlite://", "--config", "x.toml"), "--config"),
        (("cost", "--bogus"), "--bogus"),
    ],
)
def test_bad_flags_exit_2(argv: tuple[str, ...], flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli("report", *argv, *(() if "--url" in argv else ("--url", "sqlite://")))
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_no_torch(tmp_path) -> None:
    code = f"""
import argparse, sys
from controlplane.accounting.cli import add_report_parser
p = argparse.ArgumentParser()
add_report_parser(p.add_subparsers(dest="command", required=True))
args = p.parse_args(["report", "cost", "--url", "sqlite:///{tmp_path / "x.db"}"])
assert args.func(args) == 0
assert "torch" not in sys.modules, "torch was imported"
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no cost data" in done.stdout
