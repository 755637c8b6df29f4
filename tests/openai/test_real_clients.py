"""What real OpenAI clients send (the issue's "Real clients" section): unknown fields ignored
and counted, `user` recorded and reported on, lists of prompts, non-streaming clients that
leave, X-Request-Id.

A real daemon on loopback, once over SQLite and once over PostgreSQL, real HTTP (the official
openai client, httpx, raw sockets), real request rows; the requests report on real databases.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import socket
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, inspect, text

from controlplane.accounting.cli import add_report_parser
from controlplane.accounting.reports import requests_report
from controlplane.config import Price, StoreSettings
from controlplane.store import (
    Recorder,
    RequestRecord,
    check,
    current,
    downgrade,
    make_engine,
    sync_prices,
    upgrade,
)
from controlplane.telemetry.metrics import (
    MAX_IGNORED_FIELD_CHARS,
    MAX_IGNORED_FIELD_LABELS,
    Metrics,
)
from harness import InProcessDaemon, rows, wait_rows
from tests.conftest import reset_pg

MODEL = "model"  # the tiny demo model's directory name
TOKEN = "real-clients-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
MAX_NUM_SEQS, MAX_QUEUE_LEN = 4, 4  # at most 8 prompts per request


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clients")
    store: dict[str, Any] = {"flush_interval_s": 0.05}
    if request.param == "postgresql":
        store["url"] = reset_pg(request.getfixturevalue("pg_database"))
    # Not make_module_daemon: each database's daemon stops before the next one starts.
    with InProcessDaemon.configured(
        tmp,
        tiny_model_dir,
        engine={"max_model_len": 512, "max_num_seqs": MAX_NUM_SEQS},
        server={"max_queue_len": MAX_QUEUE_LEN},
        store=store,
        admin_tokens=[{"name": "clients", "token": TOKEN}],
    ) as d:
        yield d


def _post(d: InProcessDaemon, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=60, **kw)


def _final_rows(url: str, where: str, n: int) -> list[dict[str, Any]]:
    found = wait_rows(
        url, lambda r: len(r) == n and all(x["status"] != "running" for x in r), where=where
    )
    return sorted(found, key=lambda r: r["id"])


def _count_rows(d: InProcessDaemon, url: str) -> int:
    """Request rows in the store, once every record submitted so far is written."""
    assert d.daemon.recorder.flush(10)
    return len(rows(url))


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _metric(d: InProcessDaemon, name: str, **labels: str) -> float | None:
    text = httpx.get(d.url + "/metrics", timeout=30).text
    want = {"model_name": MODEL, **labels}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line.split("}", 1)[0]))
        if got == want:
            return float(line.rsplit(" ", 1)[1])
    return None


# -- 1. unknown fields are ignored and counted; known, unsupported ones are still a 400 --------

IGNORED = "controlplane:ignored_request_fields_total"


def test_unknown_fields_are_ignored_counted_and_logged_once(served, client, caplog) -> None:
    d = served
    field = f"some_future_field_{d.daemon.instance_id}"  # new to this daemon's metrics
    caplog.set_level(logging.DEBUG, logger="controlplane.api")
    # As the openai client sends fields it knows and we do not (extra_body is how a user adds
    # any field; LangChain and LiteLLM pass their own this way too).
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_body={field: {"nested": [1, 2]}, "reasoning_effort": "low"},
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    done = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={field: True}
    )
    assert done.usage.completion_tokens >= 1
    assert _metric(d, IGNORED, field=field) == 2
    assert _metric(d, IGNORED, field="reasoning_effort") >= 1
    logged = [r for r in caplog.records if r.levelno == logging.DEBUG and field in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]  # once per field name


def test_long_field_names_share_the_other_label(served) -> None:
    d = served
    before = _metric(d, IGNORED, field="other") or 0
    long_name = "x" * (MAX_IGNORED_FIELD_CHARS + 1)
    r = _post(d, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1, long_name: 1})
    assert r.status_code == 200, r.text
    assert _metric(d, IGNORED, field="other") == before + 1
    assert long_name not in httpx.get(d.url + "/metrics", timeout=30).text


def test_ignored_field_labels_are_bounded() -> None:
    m = Metrics(MODEL)
    names = [f"f{i}" for i in range(MAX_IGNORED_FIELD_LABELS + 50)]
    # The first 100 names get labels of their own, the rest (and long names) share "other";
    # each label is reported new once.
    assert m.ignored_request_fields(names) == [*names[:MAX_IGNORED_FIELD_LABELS], "other"]
    long_name = "y" * (MAX_IGNORED_FIELD_CHARS + 1)
    assert m.ignored_request_fields(["f0", "f0", long_name, "brand_new"]) == []
    text = m.render()[0].decode()
    series = [ln for ln in text.splitlines() if ln.startswith(IGNORED + "{")]
    assert len(series) == MAX_IGNORED_FIELD_LABELS + 1
    assert f'{IGNORED}{{field="other",model_name="{MODEL}"}} 52.0' in series
    assert f'{IGNORED}{{field="f0",model_name="{MODEL}"}} 3.0' in series


@pytest.mark.parametrize(
    ("path", "extra", "param", "words"),
    [
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function"}]},
            "tools[0].function",
            "must be a function object",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.schema",
            "is required",
        ),
        ("/v1/chat/completions", {"n": 17}, "n", "at most 16 (server.max_n)"),
        ("/v1/completions", {"best_of": 3, "stream": True}, "best_of", "stream"),
        ("/v1/completions", {"logit_bias": {"5": 1}}, "logit_bias", "not supported"),
    ],
)
def test_known_fields_misused_are_400_naming_them(served, path, extra, param, words) -> None:
    d = served
    body = {"model": MODEL, "max_tokens": 1, **extra}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user"}]})
    r = _post(d, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


# -- 2. `user` in the row, and the requests report by user --------------------------------------


def test_user_is_recorded_and_length_capped(served, client) -> None:
    d = served
    cfg = d.cfg
    user = f"alice-{d.daemon.instance_id}"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, user=user
    )
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=2, user=user + "é")
    nobody = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    ids = (chat.id, done.id, nobody.id)
    found = _final_rows(cfg.store_url, "id IN ('{}', '{}', '{}')".format(*ids), 3)
    assert {r["id"]: r["end_user"] for r in found} == {
        chat.id: user,
        done.id: user + "é",
        nobody.id: None,
    }

    before = _count_rows(d, cfg.store_url)
    for value, words in (("u" * 257, "257 characters long; the limit is 256"), (7, "string")):
        r = _post(d, "/v1/completions", {"model": MODEL, "prompt": "x", "user": value})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "user" and words in error["message"], error
    assert _post(
        d, "/v1/completions", {"model": MODEL, "prompt": "x", "user": "u" * 256}
    ).is_success
    assert _count_rows(d, cfg.store_url) == before + 1  # the refused ones have no row


def _report_cli(capsys, *argv: str) -> int:
    parser = argparse.ArgumentParser(prog="controlplane")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_requests_report_groups_by_user_over_the_daemons_rows(served, client, capsys) -> None:
    d = served
    cfg = d.cfg
    users = {f"bob-{d.daemon.instance_id}": 2, f"carol-{d.daemon.instance_id}": 1}
    ids = []
    for user, n in users.items():
        for _ in range(n):
            out = client.completions.create(
                model=MODEL,
                prompt="count me",
                max_tokens=3,
                user=user,
                extra_body={"ignore_eos": True},
            )
            ids.append(out.id)
    found = _final_rows(cfg.store_url, "id IN ({})".format(",".join(f"'{i}'" for i in ids)), 3)
    assert all(r["status"] == "success" for r in found)
    argv = ("report", "requests", "--url", cfg.store_url, "--since", "2h", "--format", "json")
    assert _report_cli(capsys, *argv, "--group-by", "user") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["columns"][0] == "user"
    by_user = {r["user"]: r for r in report["rows"]}
    for user, n in users.items():
        mine = [r for r in found if r["end_user"] == user]
        row = by_user[user]
        assert row["requests_succeeded"] == n and row["requests_failed"] == 0
        assert row["completion_tokens"] == 3 * n
        assert row["prompt_tokens"] == sum(r["prompt_tokens"] for r in mine)
        assert row["list_cost_usd"] == pytest.approx(sum(float(r["cost_usd"]) for r in mine))
    # The hourly cost rollups are not kept per user: the cost report says where to look.
    with pytest.raises(SystemExit) as exit_info:
        _report_cli(capsys, "report", "cost", "--url", cfg.store_url, "--group-by", "user")
    assert exit_info.value.code == 2
    assert "report requests --group-by user" in capsys.readouterr().err


# -- 3. lists of prompts -------------------------------------------------------------------------


def test_a_list_of_prompts_gives_one_choice_and_one_row_each(served, client) -> None:
    cfg = served.cfg
    prompts = ["The capital of France", "one two three", "a b"]
    single = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0]
        for p in prompts
    ]
    batch = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0, user="batcher"
    )
    assert [c.index for c in batch.choices] == [0, 1, 2]
    # Each prompt is its own engine request: the same greedy text as alone.
    assert [c.text for c in batch.choices] == [c.text for c in single]
    found = _final_rows(cfg.store_url, f"id LIKE '{batch.id}-%'", 3)
    assert [r["id"] for r in found] == [f"{batch.id}-{i}" for i in range(3)]
    assert {r["x_request_id"] for r in found} == {batch.id}
    assert {r["end_user"] for r in found} == {"batcher"}
    usage = batch.usage
    assert usage.prompt_tokens == sum(r["prompt_tokens"] for r in found)
    assert usage.completion_tokens == sum(r["completion_tokens"] for r in found)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    # Token-id prompts too, as the openai client and LangChain send pre-tokenized batches.
    ids = client.completions.create(
        model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in ids.choices] == [0, 1]
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 4


def test_a_list_of_prompts_streams_chunks_with_their_index(served, client) -> None:
    cfg = served.cfg
    stream = client.completions.create(
        model=MODEL,
        prompt=["first", "second one"],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length"}
    found = _final_rows(cfg.store_url, f"id LIKE '{chunk.id}-%'", 2)
    assert usage is not None and usage.completion_tokens == 8
    assert usage.prompt_tokens == sum(r["prompt_tokens"] for r in found)
    alone = [
        client.completions.create(
            model=MODEL, prompt=p, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in ("first", "second one")
    ]
    assert [texts[0], texts[1]] == alone


def test_one_bad_prompt_rejects_the_whole_list_before_anything_is_queued(served) -> None:
    d = served
    cfg = d.cfg
    engine = d.daemon.aengine.engine
    before = _count_rows(d, cfg.store_url)
    cases = [
        ({"prompt": ["ok", ""]}, "prompt[1]", "non-empty"),
        ({"prompt": [[1, 2], [1] * 600]}, "prompt[1]", "limit is 511"),
        ({"prompt": ["ok", "fine"], "max_tokens": 600}, "max_tokens", "(prompt[0])"),
        ({"prompt": ["ok", 3]}, "prompt[1]", "non-empty string"),
        ({"prompt": ["p"] * (MAX_NUM_SEQS + MAX_QUEUE_LEN + 1)}, "prompt", "limit is 8"),
    ]
    for extra, param, words in cases:
        r = _post(d, "/v1/completions", {"model": MODEL, **extra})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
        assert not engine.has_unfinished_requests()
    # At the limit, admitted.
    r = _post(d, "/v1/completions", {"model": MODEL, "prompt": ["p"] * 8, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    assert _count_rows(d, cfg.store_url) == before + 8


# -- 4. a non-streaming client that leaves aborts its requests ----------------------------------


def _raw_post(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: leaver-1\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def test_non_streaming_batch_client_leaving_aborts_every_prompt(served) -> None:
    d = served
    cfg = d.cfg
    engine = d.daemon.aengine.engine
    body = {"model": MODEL, "prompt": ["go", "away"], "max_tokens": 400, "ignore_eos": True}
    sock = _raw_post(d.url, "/v1/completions", body)
    try:
        _wait(lambda: engine.stats().num_running == 2, 30, "the requests never started")
        live = httpx.get(d.url + "/admin/requests", headers=ADMIN, timeout=30).json()["live"]
        assert {r["x_request_id"] for r in live} == {"leaver-1"} and len(live) == 2
    finally:
        sock.close()  # gone long before 400 tokens

    def idle() -> bool:
        stats = httpx.get(d.url + "/admin/stats", headers=ADMIN, timeout=30).json()
        return stats["requests_in_flight"] == 0 and stats["kv_blocks_used"] == 0

    _wait(idle, 30, "the requests were not aborted")
    found = _final_rows(cfg.store_url, "x_request_id = 'leaver-1'", 2)
    for row in found:
        assert (row["status"], row["finish_reason"]) == ("aborted", "abort"), row
        assert row["completion_tokens"] < 400


# -- 5. X-Request-Id --------------------------------------------------------------------------


def test_x_request_id_is_echoed_stored_and_listed_duplicates_included(served, client) -> None:
    d = served
    cfg = d.cfg
    rid = f"client-id {d.daemon.instance_id}/1"  # printable ASCII, spaces and slashes too
    got = []
    for _ in range(2):  # the same id twice: both requests are served and recorded
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            user="dana",
            extra_headers={"X-Request-Id": rid},
        )
        assert raw.headers["x-request-id"] == rid
        got.append(raw.parse().id)
    assert got[0] != got[1]  # the row ids stay unique
    found = _final_rows(cfg.store_url, f"x_request_id = '{rid}'", 2)
    assert sorted(r["id"] for r in found) == sorted(got)
    listed = httpx.get(
        d.url + "/admin/requests", params={"x_request_id": rid}, headers=ADMIN, timeout=30
    ).json()["finished"]
    assert sorted(r["id"] for r in listed) == sorted(got)
    assert {(r["x_request_id"], r["end_user"]) for r in listed} == {(rid, "dana")}
    r = httpx.get(
        d.url + "/admin/requests", params={"x_request_id": "a\x01"}, headers=ADMIN, timeout=30
    )
    assert r.status_code == 422 and r.json()["error"]["param"] == "x_request_id"


def test_x_request_id_is_generated_when_absent_and_on_every_v1_response(served) -> None:
    d = served
    cfg = d.cfg
    r = _post(d, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    body = r.json()
    assert r.headers["x-request-id"] == body["id"]  # generated: the response's id
    (row,) = _final_rows(cfg.store_url, f"id = '{body['id']}'", 1)
    assert row["x_request_id"] == body["id"]
    with httpx.stream(
        "POST",
        d.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True},
        headers={"X-Request-Id": "streamed"},
        timeout=60,
    ) as s:
        assert s.headers["x-request-id"] == "streamed"
        assert any(line == "data: [DONE]" for line in s.iter_lines())
    # Errors carry it too: our own 400 / 404, Litestar's unknown route.
    errors = [
        httpx.post(d.url + "/v1/completions", content=b"{nope", timeout=30),
        _post(d, "/v1/completions", {"model": "gpt-17", "prompt": "x"}),
        httpx.get(d.url + "/v1/nothing", timeout=30),
        _post(d, "/v1/completions", {"model": MODEL, "prompt": "x"}, headers={"X-Request-Id": "e"}),
    ]
    assert [e.status_code for e in errors] == [400, 404, 404, 200]
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", errors[0].headers["x-request-id"])
    assert re.fullmatch(r"req-[0-9a-f]{32}", errors[2].headers["x-request-id"])
    assert errors[3].headers["x-request-id"] == "e"
    assert "x-request-id" not in httpx.get(d.url + "/health", timeout=30).headers


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (b"x" * 129, "129 characters long; the limit is 128"),
        ("caf\u00e9".encode("latin-1"), "printable ASCII"),
        (b"tab\there", "printable ASCII"),
    ],
)
def test_invalid_x_request_id_is_400_naming_the_header(served, value, words) -> None:
    d = served
    cfg = d.cfg
    before = _count_rows(d, cfg.store_url)
    r = _post(
        d,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers=[("X-Request-Id", value)],
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "X-Request-Id" and words in error["message"], error
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", r.headers["x-request-id"])  # a generated one
    assert _count_rows(d, cfg.store_url) == before


# -- the requests report on the store alone ------------------------------------------------------

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
PRICE = Price("*", T0 - timedelta(days=1), 1.0, 0.5, 3.0)  # USD per million tokens


@pytest.fixture
def recorder(db_engine: Engine) -> Iterator[Recorder]:
    sync_prices(db_engine, [PRICE])
    rec = Recorder(db_engine, StoreSettings(batch_size=50, flush_interval_s=0.02))
    yield rec
    rec.close(timeout=5)


def _rec(rid: str, user: str | None, *, status: str = "success", hour: int = 0, **kw: Any):
    at = T0 + timedelta(hours=hour)
    base: dict[str, Any] = dict(
        instance_id="inst-a",
        model="m",
        endpoint="completions",
        arrival_time=at,
        prompt_tokens=100,
        cached_prompt_tokens=0,
        completion_tokens=10,
        end_user=user,
    )
    if status != "running":
        base.update(finish_reason="stop", finish_time=at + timedelta(seconds=1), ttft_s=0.5)
        base.update(e2e_latency_s=1.0)
    return RequestRecord(id=rid, status=status, **{**base, **kw})


def test_requests_report_by_user_day_and_key(db_engine: Engine, recorder: Recorder) -> None:
    for r in (
        _rec("a1", "alice"),
        _rec("a2", "alice", hour=1, ttft_s=1.5, e2e_latency_s=3.0, api_key_name="k1"),
        _rec("a3", "alice", status="error", completion_tokens=0, ttft_s=None),
        _rec("b1", "bob", completion_tokens=20, cached_prompt_tokens=40),
        _rec("n1", None),
        _rec("r1", "alice", status="running"),  # not final: not reported
        _rec("late", "alice", hour=30),  # outside the window
    ):
        recorder.submit(r)
    assert recorder.flush(10)
    report = requests_report(
        db_engine, since=T0, until=T0 + timedelta(hours=2), group_by="user"
    ).to_dict()
    assert report["kind"] == "requests" and report["columns"][0] == "user"
    by_user = {r["user"]: r for r in report["rows"]}
    assert list(by_user) == ["", "alice", "bob"]  # sorted; no user is ""
    alice = by_user["alice"]
    assert (alice["requests_succeeded"], alice["requests_failed"]) == (2, 1)
    assert (alice["prompt_tokens"], alice["completion_tokens"]) == (300, 20)
    # Priced at ingest: (100 x 1.0 + 10 x 3.0) / 1e6 per successful row, 100 x 1.0 for a3.
    assert alice["list_cost_usd"] == pytest.approx((130 + 130 + 100) / 1e6)
    assert alice["mean_ttft_s"] == pytest.approx(1.0)  # a3 has none: (0.5 + 1.5) / 2
    assert alice["mean_e2e_latency_s"] == pytest.approx((1.0 + 3.0 + 1.0) / 3)
    assert by_user["bob"]["completion_tokens"] == 20
    assert (by_user["bob"]["cached_share"], alice["cached_share"]) == (0.4, 0.0)
    totals = report["totals"]
    assert totals["requests_succeeded"] + totals["requests_failed"] == 5
    # bob: 60 prompt tokens at 1.0, 40 cached at 0.5, 20 completion at 3.0.
    assert totals["list_cost_usd"] == pytest.approx((130 * 3 + 100 + 140) / 1e6)
    assert totals["cached_share"] == pytest.approx(40 / 500)  # from the sums, not the rows

    both = requests_report(
        db_engine, since=T0, until=T0 + timedelta(hours=2), group_by="hour,api_key,user"
    )
    keys = [(r["hour"], r["api_key"], r["user"]) for r in both.rows]
    assert keys == [
        ("2026-03-01T12", "", ""),
        ("2026-03-01T12", "", "alice"),
        ("2026-03-01T12", "", "bob"),
        ("2026-03-01T13", "k1", "alice"),
    ]
    empty = requests_report(db_engine, since=T0 - timedelta(days=9), until=T0, group_by="user")
    assert empty.empty and empty.rows == []


# -- migration 0004 ------------------------------------------------------------------------------

# A request row as every schema since 0001 can hold it.
OLD_ROW = (
    "INSERT INTO requests (id, instance_id, model, endpoint, status, arrival_time, "
    "hour_bucket, day_bucket) VALUES ('old', 'i', 'm', 'completions', 'success', "
    "'2026-03-01 12:00:00', '2026-03-01T12', '2026-03-01')"
)


def test_migration_0004_keeps_old_rows_and_downgrades(db_url: str) -> None:
    upgrade(db_url, "0003")
    eng = make_engine(db_url)
    try:
        with eng.begin() as conn:
            conn.execute(text(OLD_ROW))
        upgrade(db_url, "0004")
        assert current(db_url) == "0004"
        with eng.connect() as conn:
            got = conn.execute(text("SELECT end_user, x_request_id FROM requests")).one()
        assert tuple(got) == (None, None)  # rows from before have neither
        names = {ix["name"] for ix in inspect(eng).get_indexes("requests")}
        assert "ix_requests_x_request_id" in names
        downgrade(db_url, "0003")
        insp = inspect(eng)
        columns = {c["name"] for c in insp.get_columns("requests")}
        assert not {"end_user", "x_request_id"} & columns
        left = {ix["name"] for ix in insp.get_indexes("requests")}
        assert "ix_requests_x_request_id" not in left
        assert {"ix_requests_status", "ix_requests_arrival_time", "ix_requests_hour_bucket"} <= left
        with eng.connect() as conn:
            assert conn.execute(text("SELECT id FROM requests")).scalars().all() == ["old"]
    finally:
        eng.dispose()


# -- migration 0005 ------------------------------------------------------------------------------


def test_migration_0005_old_rows_read_zero_and_it_downgrades(db_url: str) -> None:
    upgrade(db_url, "0004")
    eng = make_engine(db_url)
    try:
        with eng.begin() as conn:
            conn.execute(text(OLD_ROW))
        upgrade(db_url)
        check(db_url)  # the models and the migrated schema (head) agree
        with eng.connect() as conn:
            got = conn.execute(text("SELECT draft_tokens, accepted_draft_tokens FROM requests"))
            assert tuple(got.one()) == (0, 0)  # no speculation before: 0, not NULL
        downgrade(db_url, "0004")
        insp = inspect(eng)
        assert not {"draft_tokens", "accepted_draft_tokens"} & {
            c["name"] for c in insp.get_columns("requests")
        }
        assert "cache_savings_usd" not in {c["name"] for c in insp.get_columns("cost_rollups")}
        assert not {"prefix_cache_hit_rate", "spec_acceptance_rate"} & {
            c["name"] for c in insp.get_columns("utilization_samples")
        }
        with eng.connect() as conn:
            assert conn.execute(text("SELECT id FROM requests")).scalars().all() == ["old"]
    finally:
        eng.dispose()
