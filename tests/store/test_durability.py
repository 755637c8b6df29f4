"""Crash-time durability: a daemon killed outright loses no request it admitted.

The recorder writes rows in batches (every `store.flush_interval_s`); the request journal
(controlplane.store.journal) keeps every submitted record on local disk until its row is
committed, and the next start replays it. Real daemons, real SIGKILL, real SQLite/PostgreSQL.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from controlplane.config import Price, StoreSettings, load_config
from controlplane.store import Recorder, RequestRecord, RequestRow, mark_interrupted, sync_prices
from controlplane.store.journal import Journal, encode, read_journal
from controlplane.store.recovery import replay_journal
from harness import DaemonProcess, rows, write_config

MODEL = "model"  # the tiny demo model's directory name, served as the model id
FINAL = {"success", "error", "aborted", "interrupted"}
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def _journal_lines(data_dir: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in (data_dir / "journal").rglob("*.jsonl"))


def test_sigkill_under_load_every_admitted_request_keeps_one_final_row(tiny_model_dir, tmp_path):
    # A 2 s flush window (default 0.5 s) so that the kill surely lands inside one: requests
    # admitted or finished since the last batch have no row (or a stale "running" one) in SQL.
    data = tmp_path / "data"
    cfg_path = write_config(
        tmp_path / "cp.toml",
        data,
        tiny_model_dir,
        engine={"max_num_seqs": 8},
        server={"max_queue_len": 256},
        store={"flush_interval_s": 2.0},
    )
    url = load_config(cfg_path, env={}).store_url
    d = DaemonProcess.start(cfg_path)
    lock = threading.Lock()
    admitted: set[str] = set()  # ids the clients saw: the request was admitted
    finished: dict[str, int] = {}  # id -> completion tokens of a complete response
    stop = threading.Event()

    def streaming() -> None:
        # Chat streams send their first chunk (with the id) as soon as the request is admitted.
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "journal"}],
            "max_tokens": 100,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        while not stop.is_set():
            try:
                with httpx.stream(
                    "POST", d.url + "/v1/chat/completions", json=body, timeout=60
                ) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        with lock:
                            admitted.add(chunk["id"])
                            if chunk.get("usage"):  # the last chunk: the stream is complete
                                finished[chunk["id"]] = chunk["usage"]["completion_tokens"]
            except httpx.HTTPError:
                return

    def short() -> None:
        body = {"model": MODEL, "prompt": "short", "max_tokens": 4, "ignore_eos": True}
        while not stop.is_set():
            try:
                r = httpx.post(d.url + "/v1/completions", json=body, timeout=60)
            except httpx.HTTPError:
                return
            out = r.json()
            with lock:
                admitted.add(out["id"])
                finished[out["id"]] = out["usage"]["completion_tokens"]

    clients = [threading.Thread(target=f) for f in (streaming, streaming, streaming, short, short)]
    for t in clients:
        t.start()
    time.sleep(5.0)  # more than two flush windows: some rows are written, some not yet
    with lock:
        seen = len(admitted)
    deadline = time.monotonic() + 30
    # Kill right after an admission (inside a flush window) while a stream is mid-way (so the
    # kill cuts a running request): on a fast machine the tiny model ends a 100-token stream
    # in tens of milliseconds, and a new admission alone does not guarantee one is running.
    while time.monotonic() < deadline:
        with lock:
            if len(admitted) > seen and admitted - finished.keys():
                break
        time.sleep(0.001)
    d.kill()
    stop.set()
    with lock:
        ids, done = set(admitted), dict(finished)
    for t in clients:
        t.join(60)

    before = {r["id"]: r for r in rows(url)}
    not_final = {i for i in ids if i not in before or before[i]["status"] not in FINAL}
    # The crash window was real: some admitted requests had no row, or no final one.
    assert not_final, "the kill missed every flush window; the test proves nothing"
    assert done and len(ids) > len(done), (len(ids), len(done))

    d2 = DaemonProcess.start(cfg_path)
    try:
        after = {r["id"]: r for r in rows(url)}
        missing = sorted(ids - after.keys())
        assert not missing, f"{len(missing)} of {len(ids)} admitted requests have no row"
        statuses = {i: after[i]["status"] for i in ids}
        assert set(statuses.values()) <= FINAL, statuses
        for rid, tokens in done.items():  # finished before the kill: the true final row
            assert after[rid]["status"] == "success", after[rid]
            assert after[rid]["completion_tokens"] == tokens
        cut = {rid: after[rid] for rid in ids - done.keys()}  # streams cut by the kill
        # Interrupted; or, if the engine finished one just before the kill, its true final row.
        assert all(
            r["status"] == "interrupted"
            or (r["status"], r["completion_tokens"]) == ("success", 100)
            for r in cut.values()
        ), cut
        assert any(r["status"] == "interrupted" for r in cut.values())
        assert any("replayed the request journal" in line for line in d2.lines)
    finally:
        assert d2.stop() == 0
    assert _journal_lines(data) == 0  # replayed, then a clean stop leaves nothing


def _record(rid: str, status: str = "success", **kw: object) -> RequestRecord:
    base: dict[str, object] = dict(
        instance_id="inst-a",
        model="m",
        endpoint="completions",
        arrival_time=T0,
        prompt_tokens=1000,
        completion_tokens=500,
    )
    if status != "running":
        base.update(finish_reason="length", finish_time=T0 + timedelta(seconds=2))
    return RequestRecord(id=rid, status=status, **{**base, **kw})  # type: ignore[arg-type]


def _rows(engine: Engine) -> dict[str, RequestRow]:
    with Session(engine) as s:
        return {r.id: r for r in s.scalars(select(RequestRow))}


def test_replay_writes_what_was_not_committed(db_engine: Engine, tmp_path) -> None:
    # `engine` is a migrated database of each kind (conftest): SQLite and PostgreSQL.
    sync_prices(db_engine, [Price(model="*", prompt_per_mtok=1.0, completion_per_mtok=2.0)])
    rec = Recorder(db_engine, StoreSettings(flush_interval_s=0.01))
    rec.submit(_record("committed-final"))
    rec.submit(_record("committed-running", "running"))
    assert rec.close()
    j = Journal(tmp_path / "journal")
    j.append(_record("committed-final", "running"))  # its final row is already in SQL
    j.append(_record("committed-running", "running"))
    j.append(_record("only-running", "running"))  # admitted, no row at all
    j.append(_record("finished", "running"))
    j.append(_record("finished", "success", completion_tokens=7))  # finished, row never written
    j.close()
    with open(next(j.files()), "ab") as f:  # a torn last line, as after a power loss
        f.write(encode(_record("torn"))[:40])

    assert replay_journal(db_engine, tmp_path / "journal") == 4
    assert mark_interrupted(db_engine, "inst-a") == 2
    got = {rid: (r.status, r.completion_tokens) for rid, r in _rows(db_engine).items()}
    assert got == {
        "committed-final": ("success", 500),
        "committed-running": ("interrupted", 500),
        "only-running": ("interrupted", 500),
        "finished": ("success", 7),
    }
    # Priced at ingest like any final row: (1000 x 1.0 + 7 x 2.0) / 1e6.
    assert _rows(db_engine)["finished"].cost_usd == pytest.approx(1014 / 1e6)
    assert read_journal(tmp_path / "journal")[0] == []  # the journal is gone once replayed
    assert replay_journal(db_engine, tmp_path / "journal") == 0


def test_journal_keeps_only_what_is_not_committed(tmp_path) -> None:
    j = Journal(tmp_path, segment_records=3)
    recs = [_record(f"r{i}", "running") for i in range(7)]
    for r in recs:
        j.append(r)
    assert len(list(j.files())) == 3 and j.pending == 7
    j.committed(recs[:3])  # the first file holds nothing else: deleted
    assert len(list(j.files())) == 2
    j.committed(recs[4:])  # the second still holds r3; the third (being written) is emptied
    assert len(list(j.files())) == 2 and j.pending == 1
    assert [r.id for r in read_journal(tmp_path)[1]] == ["r3", "r4", "r5"]
    j.committed(recs[3:4])
    assert j.pending == 0
    assert read_journal(tmp_path)[1] == []  # the file being written is truncated, not kept
    assert j.close() and list(tmp_path.glob("*.jsonl")) == []


def test_recorder_journal_is_empty_after_commits_and_kept_when_the_database_is_down(
    db_engine: Engine, tmp_path
) -> None:
    rec = Recorder(db_engine, StoreSettings(flush_interval_s=0.01), journal_dir=tmp_path / "ok")
    for i in range(5):
        rec.submit(_record(f"a{i}", "running"))
        rec.submit(_record(f"a{i}"))
    assert rec.flush(10)
    assert read_journal(tmp_path / "ok")[1] == []  # committed: nothing left to replay
    assert rec.close() and list((tmp_path / "ok").glob("*.jsonl")) == []

    with socket.socket() as s:  # a port nothing listens on: the database is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = Recorder(
        f"postgresql://postgres@127.0.0.1:{port}/nothing",
        StoreSettings(flush_interval_s=0.01, retry_interval_s=0.05),
        journal_dir=tmp_path / "down",
    )
    for i in range(3):
        down.submit(_record(f"b{i}"))
    assert not down.close(timeout=0.5)
    assert replay_journal(db_engine, tmp_path / "down") == 3  # the next start writes them
    assert {f"b{i}" for i in range(3)} <= _rows(db_engine).keys()
