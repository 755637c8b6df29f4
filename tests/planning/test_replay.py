"""`controlplane replay` (controlplane/planning): traffic recorded by a daemon (loadgen, a
shared prefix, n = 2) on SQLite and PostgreSQL, replayed in-process against the config it was
served with, does the same work: every request, every prompt and completion token, the same
prefix-cache hits. (How close its latencies come is a measurement, not a test:
benchmarks/replay_fidelity.py.) Hostile windows give clear errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from controlplane.planning.window import PlanningError
from harness import DaemonProcess, write_config
from harness.recording import record_traffic


def _replay(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", "replay", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _config(path: Path, model: Path, db_url: str, **engine: object) -> Path:
    return write_config(
        path,
        path.parent / "data",
        model,
        engine={"compile": "off", "max_num_seqs": 8, **engine},
        store={"url": db_url, "flush_interval_s": 0.1},
        autopilot={"ttft_p99_ms": 500.0, "itl_p99_ms": 100.0},
    )


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path, db_url: str):
    config = _config(tmp_path / "cp.toml", tiny_model_dir, db_url)
    since, until = record_traffic(config, requests=16, rate=8.0)  # and 3 more: 19 rows
    return config, db_url, since, until


def _window(since: datetime, until: datetime) -> list[str]:
    return ["--since", since.isoformat(), "--until", until.isoformat()]


def test_a_replay_does_the_recorded_work(served, tmp_path: Path) -> None:
    config, url, since, until = served
    # Two configs side by side: the served one, and one with two slots; arrivals 20x faster
    # than recorded (19 requests in about a tenth of a second), so that two slots must queue.
    small = tmp_path / "small.toml"
    small.write_text(config.read_text().replace("max_num_seqs = 8", "max_num_seqs = 2"))
    window = _window(since, until)
    report = tmp_path / "replay.html"
    r = _replay("--db", url, "--config", str(config), "--config", str(small), *window,
                "--speed", "20", "--json", "--report", str(report))  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    recorded, replayed, narrow = out["figures"]
    assert [f["label"] for f in out["figures"]] == ["recorded", "cp.toml", "small.toml"]
    assert out["window"]["requests"] == recorded["requests"] == 19
    for run in (replayed, narrow):
        assert run["requests"] == 19 and run["failed"] == 0, run["errors"]
        # The same work: every prompt token and every completion token (n = 2 included).
        assert run["prompt_tokens"] == recorded["prompt_tokens"]
        assert run["completion_tokens"] == recorded["completion_tokens"]
        assert 0 < run["peak_kv_usage"] <= 1 and run["cost_per_mtok_usd"] > 0
    # The shared prefix hits again (loadgen's random prompts share none).
    assert recorded["prefix_hit_rate"] > 0
    assert replayed["prefix_hit_rate"] == pytest.approx(recorded["prefix_hit_rate"], abs=0.02)
    # Against the autopilot's targets of the first config.
    assert out["slo"] == {"ttft_p99_ms": 500.0, "itl_p99_ms": 100.0}
    assert all(0 <= f["slo_attainment"] <= 1 for f in out["figures"])
    # Two slots queue what eight served at once.
    assert narrow["queue_p99_ms"] > replayed["queue_p99_ms"]
    assert out["speed"] == 20
    # The report: the table and a plot of each latency, one series a column.
    page = report.read_text()
    assert page.count("<svg") == 2 and "small.toml" in page and "TTFT p99 ms" in page
    # The table a person reads: one column each, every line named, and why requests failed
    # (one slot cannot sample the n = 2 request's two choices at once).
    single = tmp_path / "single.toml"
    single.write_text(config.read_text().replace("max_num_seqs = 8", "max_num_seqs = 1"))
    r = _replay("--db", url, "--config", str(single), *window, "--speed", "max")
    assert r.returncode == 0, r.stderr
    assert "replayed at max speed" in r.stdout and "TTFT p99 ms" in r.stdout
    assert "single.toml: 1 failed:" in r.stdout and "max_num_seqs" in r.stdout, r.stdout
    if not url.startswith("sqlite"):
        return  # the HTTP path below does not depend on the records' database
    # Against the daemon itself, over HTTP (the client times it): the same work again.
    d = DaemonProcess.start(config)
    try:
        r = _replay("--db", url, "--config", str(config), *window, "--url", d.url, "--json")
    finally:
        assert d.stop() == 0
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    remote = out["figures"][1]
    assert remote["label"] == d.url and remote["failed"] == 0, remote["errors"]
    assert remote["completion_tokens"] == recorded["completion_tokens"]
    assert remote["ttft_p50_ms"] > 0 and remote["queue_p50_ms"] is None
    assert any("no admin token" in note for note in out["notes"])


def _insert(url: str, rows: list[dict]) -> None:
    from controlplane.store import make_engine
    from controlplane.store.models import RequestRow

    db = make_engine(url)
    with db.begin() as conn:
        conn.execute(sa.insert(RequestRow.__table__), rows)
    db.dispose()


def _row(i: int, at: datetime, model: str = "tiny", **kw: object) -> dict:
    return {
        "id": f"r{i}",
        "instance_id": "i",
        "model": model,
        "endpoint": "completions",
        "status": "success",
        "arrival_time": at,
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "hour_bucket": at.strftime("%Y-%m-%dT%H"),
        "day_bucket": at.strftime("%Y-%m-%d"),
        **kw,
    }


def test_hostile_windows_are_clear_errors(
    tiny_model_dir: Path, tmp_path: Path, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from controlplane.cli import main

    config = _config(tmp_path / "cp.toml", tiny_model_dir, db_url)
    now = datetime.now(UTC)
    since, until = now - timedelta(hours=1), now

    def fails(*args: str) -> str:
        """The CLI in this process (each case refuses before any engine is built)."""
        capsys.readouterr()
        code = main(["replay", "--db", db_url, "--config", str(config), *args])
        err = capsys.readouterr().err
        assert code == 2, err
        return err

    if db_url.startswith("sqlite"):  # no file there yet
        assert "cannot read the records at sqlite:///" in fails(*_window(since, until))
    else:  # an empty schema
        assert "cannot read the records at postgresql" in fails(*_window(since, until))
    from controlplane.store import upgrade

    upgrade(db_url)
    assert "no request rows arrived between" in fails(*_window(since, until))
    _insert(
        db_url,
        [_row(i, now - timedelta(minutes=30, seconds=-i)) for i in range(6)]
        + [
            _row(10 + i, now - timedelta(minutes=20), model="other", status="error")
            for i in range(2)
        ]
        + [
            _row(20, now - timedelta(minutes=10), model="bare", completion_tokens=0, status="error")
        ],
    )
    err = fails(*_window(since, until))
    assert "3 models (bare (1 rows), other (2 rows), tiny (6 rows))" in err and "--model" in err
    assert "holds 6 rows of tiny, more than --max-rows (5)" in fails(
        *_window(since, until), "--model", "tiny", "--max-rows", "5"
    )
    assert "no replayable request" in fails(*_window(since, until), "--model", "bare")
    assert "no rows of model 'gone'" in fails(*_window(since, until), "--model", "gone")
    assert "served by other; cp.toml serves" in fails(*_window(since, until), "--model", "other")
    assert "--until" in fails("--since", "1h", "--until", "2h")
    assert "--since: expected a duration like 24h" in fails("--since", "yesterday-ish")


def _many_rows(url: str, n: int, model: str = "m") -> None:
    """`n` request rows, one a millisecond, written by SQLite itself (a recursive CTE)."""
    from controlplane.store import make_engine, upgrade

    upgrade(url)
    db = make_engine(url)
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "WITH RECURSIVE k(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM k WHERE i + 1 < :n) "
                "INSERT INTO requests (id, instance_id, model, endpoint, status, arrival_time, "
                "prompt_tokens, completion_tokens, hour_bucket, day_bucket) "
                "SELECT 'r' || i, 'i', :model, 'completions', 'success', "
                # SQLAlchemy's own SQLite text: microseconds, six digits
                "strftime('%Y-%m-%d %H:%M:%S', '2026-11-01', '+' || (i / 1000) || ' seconds') "
                "|| '.' || printf('%06d', (i % 1000) * 1000), "
                "10, 5, '2026-11-01T00', '2026-11-01' FROM k"
            ),
            {"n": n, "model": model},
        )
    db.dispose()


def test_a_million_rows_are_refused_before_reading_and_a_large_read_shows_progress(
    tmp_path: Path,
) -> None:
    from controlplane.planning.window import MAX_ROWS, read_window
    from controlplane.store import make_engine

    url = f"sqlite:///{tmp_path / 'big.db'}"
    _many_rows(url, MAX_ROWS + 1)
    db = make_engine(url)
    since, until = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 11, 2, tzinfo=UTC)
    try:
        with pytest.raises(
            PlanningError, match=r"holds 1,000,001 rows of m, more than --max-rows \(1,000,000\)"
        ):
            read_window(db, since, until)
        # A narrower window (25 s: 25,000 rows) is read in batches, with a counter each.
        seen: list[tuple[int, int]] = []
        window = read_window(
            db, since, since + timedelta(seconds=25), progress=lambda *p: seen.append(p)
        )
    finally:
        db.dispose()
    assert len(window.rows) == 25_000 and window.span_s == pytest.approx(24.999, abs=1e-3)
    assert [done for done, _ in seen] == [10_000, 20_000, 25_000] and {t for _, t in seen} == {
        25_000
    }
