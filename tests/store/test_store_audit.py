"""The configuration audit log (config_changes) and the admin API's request listing, on SQLite
and PostgreSQL (see test_store.py for the databases)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from sqlalchemy import Engine, insert, inspect

from controlplane.config import Price
from controlplane.store import (
    ConfigChange,
    RequestRow,
    check,
    current,
    downgrade,
    head,
    history,
    list_requests,
    make_engine,
    time_buckets,
    upgrade,
    write_changes,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
REQUESTS = RequestRow.__table__


# -- migrations ---------------------------------------------------------------------------------


def test_migration_0002_upgrade_downgrade_upgrade(db_url: str) -> None:
    upgrade(db_url)
    assert current(db_url) == head()
    check(db_url)
    eng = make_engine(db_url)
    try:
        assert "config_changes" in inspect(eng).get_table_names()
        indexes = {
            ix["name"]: ix["column_names"] for ix in inspect(eng).get_indexes("config_changes")
        }
        assert indexes == {
            "ix_config_changes_time": ["time"],
            "ix_config_changes_field": ["field"],
            "ix_config_changes_change_id": ["change_id"],  # migration 0007
        }
        downgrade(db_url, "0001")
        assert current(db_url) == "0001"
        inspect(eng).clear_cache()
        tables = set(inspect(eng).get_table_names())
        assert "config_changes" not in tables
        assert {"requests", "prices"} <= tables
    finally:
        eng.dispose()
    upgrade(db_url)
    assert current(db_url) == head()
    check(db_url)


# -- audit log ----------------------------------------------------------------------------------

VALUES = [
    ("engine.max_num_seqs", 64, 128),
    ("server.drain_timeout_s", 30.0, 12.5),
    ("engine.kv_cache_dtype", "auto", "fp8"),
    ("engine.cuda_graph_sizes", [1, 2, 4], [1, 2, 4, 8]),
    ("server.extra", {"a": 1, "b": [True, None]}, {"a": 2, "ü": "✓"}),
    ("server.optional", None, 0),
]


def change(field: str, old: object, new: object, **kw: object) -> ConfigChange:
    base: dict[str, object] = dict(time=T0, source="api", actor="ops")
    return ConfigChange(field=field, old_value=old, new_value=new, **{**base, **kw})  # type: ignore[arg-type]


def test_audit_round_trip_newest_first(db_engine: Engine) -> None:
    assert history(db_engine) == []
    write_changes(db_engine, "inst-a", [change(f, o, n) for f, o, n in VALUES])
    rows = history(db_engine)
    assert [(r["field"], r["old_value"], r["new_value"]) for r in rows] == VALUES[::-1]
    ids = [r["id"] for r in rows]
    assert ids == sorted(ids, reverse=True)
    assert rows[0]["time"] == T0.isoformat() == "2026-03-01T12:00:00+00:00"
    assert {(r["instance_id"], r["source"], r["actor"]) for r in rows} == {("inst-a", "api", "ops")}
    assert isinstance(rows[-2]["new_value"], float) and isinstance(rows[-1]["new_value"], int)


def test_audit_encodes_datetimes_decimals_and_dataclasses(db_engine: Engine) -> None:
    cet = timezone(timedelta(hours=1))
    price = Price("m", datetime(2026, 6, 1, tzinfo=UTC), 1.5, 0.5, 2.0)
    write_changes(
        db_engine,
        "inst-a",
        [
            change("x.when", datetime(2026, 1, 1, 13, tzinfo=cet), Decimal("0.15")),
            change("prices", [], [price], source="file", actor=None),
        ],
    )
    prices, when = history(db_engine)
    assert when["old_value"] == "2026-01-01T12:00:00+00:00" and when["new_value"] == 0.15
    assert prices["actor"] is None and prices["source"] == "file"
    assert prices["new_value"] == [
        {
            "model": "m",
            "effective_from": "2026-06-01T00:00:00+00:00",
            "prompt_per_mtok": 1.5,
            "cached_prompt_per_mtok": 0.5,
            "completion_per_mtok": 2.0,
        }
    ]
    # A time in another zone is stored (and shown) as UTC.
    write_changes(
        db_engine, "inst-a", [change("y", 1, 2, time=datetime(2026, 1, 1, 1, tzinfo=cet))]
    )
    assert history(db_engine, limit=1)[0]["time"] == "2026-01-01T00:00:00+00:00"


def test_audit_filters_and_paging(db_engine: Engine) -> None:
    fields = ["engine.max_num_seqs", "server.max_queue_len", "prices"]
    for i in range(7):  # one transaction each, 2 fields per instance alternately
        write_changes(
            db_engine,
            f"inst-{'ab'[i % 2]}",
            [change(fields[i % 3], i, i + 1, time=T0 + timedelta(minutes=i))],
        )
    everything = history(db_engine)
    assert [r["old_value"] for r in everything] == [6, 5, 4, 3, 2, 1, 0]
    seen: list[int] = []
    before = None
    while page := history(db_engine, limit=3, before_id=before):
        seen += [r["old_value"] for r in page]
        before = page[-1]["id"]
    assert seen == [6, 5, 4, 3, 2, 1, 0]
    assert [r["old_value"] for r in history(db_engine, field="prices")] == [5, 2]
    assert [r["old_value"] for r in history(db_engine, instance_id="inst-b")] == [5, 3, 1]
    assert [r["old_value"] for r in history(db_engine, instance_id="inst-a", field="prices")] == [2]
    assert history(db_engine, field="nope") == []
    mid = everything[3]["id"]
    assert [r["old_value"] for r in history(db_engine, before_id=mid, limit=2)] == [2, 1]


def test_audit_write_is_all_or_nothing(db_engine: Engine) -> None:
    with pytest.raises(ValueError, match="source"):
        write_changes(db_engine, "i", [change("a", 1, 2), change("b", 1, 2, source="web")])
    with pytest.raises(TypeError, match="b: "):
        write_changes(db_engine, "i", [change("a", 1, 2), change("b", 1, object())])
    with pytest.raises(ValueError, match="time"):
        write_changes(db_engine, "i", [change("a", 1, 2, time=datetime(2026, 1, 1))])
    write_changes(db_engine, "i", [])
    assert history(db_engine) == []
    for bad in (0, 1001, True):
        with pytest.raises(ValueError, match=r"^limit: "):
            history(db_engine, limit=bad)


# -- request listing ----------------------------------------------------------------------------


def insert_requests(engine: Engine, specs: list[dict[str, object]]) -> None:
    rows = []
    for spec in specs:
        at = spec["arrival_time"]
        assert isinstance(at, datetime)
        hour, day = time_buckets(at)
        row: dict[str, object] = dict(
            instance_id="inst-a",
            model="m",
            endpoint="chat.completions",
            status="success",
            hour_bucket=hour,
            day_bucket=day,
        )
        row.update(spec)
        rows.append(row)
    with engine.begin() as conn:
        conn.execute(insert(REQUESTS), rows)


def walk(engine: Engine, limit: int, **filters: object) -> tuple[list[str], int]:
    ids: list[str] = []
    cursor, pages = None, 0
    while True:
        page, cursor = list_requests(engine, limit=limit, cursor=cursor, **filters)  # type: ignore[arg-type]
        pages += 1
        ids += [r["id"] for r in page]
        if cursor is None:
            return ids, pages
        assert len(page) == limit


@pytest.fixture
def requests_db(db_engine: Engine) -> Engine:
    """23 requests: arrival times in groups of three identical seconds (ties broken by id),
    two statuses, two keys, two instances, ids inserted out of order."""
    specs = []
    for i in reversed(range(23)):
        specs.append(
            dict(
                id=f"req-{i:03d}",
                arrival_time=T0 + timedelta(seconds=i // 3),
                status="error" if i % 4 == 0 else "success",
                api_key_name=None if i % 5 == 0 else ("alice" if i % 2 else "bob"),
                instance_id="inst-b" if i == 22 else "inst-a",
                cost_usd=i / 1000,
                prompt_tokens=i,
            )
        )
    insert_requests(db_engine, specs)
    return db_engine


def expected(pred: Callable[[int], bool] = lambda i: True) -> list[str]:
    return [f"req-{i:03d}" for i in reversed(range(23)) if pred(i)]


def test_list_requests_rows_are_json_friendly(requests_db: Engine) -> None:
    page, cursor = list_requests(requests_db, limit=2)
    assert cursor is not None
    first = page[0]
    assert first["id"] == "req-022" and first["instance_id"] == "inst-b"
    assert first["arrival_time"] == (T0 + timedelta(seconds=7)).isoformat()
    assert first["finish_time"] is None and first["prompt_tokens"] == 22
    assert isinstance(first["cost_usd"], float) and first["cost_usd"] == pytest.approx(0.022)
    assert "api_key_hash" not in first and "hour_bucket" not in first
    # The cursor is URL-safe text.
    assert (
        base64.urlsafe_b64encode(base64.urlsafe_b64decode(cursor + "==")).decode().rstrip("=")
        == cursor
    )


def test_list_requests_pages_walk_every_row_once(requests_db: Engine) -> None:
    for limit in (1, 4, 7, 23, 1000):  # 4 and 7 don't divide 23
        ids, pages = walk(requests_db, limit)
        assert ids == expected(), limit  # newest first, ties on arrival_time by id descending
        assert pages == -(-23 // limit), limit


def test_list_requests_filters(requests_db: Engine) -> None:
    assert walk(requests_db, 3, status="error")[0] == expected(lambda i: i % 4 == 0)
    assert walk(requests_db, 4, api_key_name="alice")[0] == expected(
        lambda i: i % 5 != 0 and i % 2 == 1
    )
    assert walk(requests_db, 5, instance_id="inst-b")[0] == ["req-022"]
    since, until = T0 + timedelta(seconds=2), T0 + timedelta(seconds=5)  # [since, until)
    assert walk(requests_db, 4, since=since, until=until)[0] == expected(lambda i: 2 <= i // 3 < 5)
    assert walk(requests_db, 2, since=since, status="success", api_key_name="bob")[0] == expected(
        lambda i: i >= 6 and i % 4 != 0 and i % 5 != 0 and i % 2 == 0
    )
    # Another time zone means the same instant.
    cet = timezone(timedelta(hours=1))
    assert walk(requests_db, 10, until=until.astimezone(cet))[0] == expected(lambda i: i < 15)
    assert list_requests(requests_db, status="aborted") == ([], None)


def test_list_requests_cursor_resumes_inside_a_tie(requests_db: Engine) -> None:
    # Pages of 2 split each group of three equal arrival times.
    page, cursor = list_requests(requests_db, limit=2)
    assert [r["id"] for r in page] == ["req-022", "req-021"]
    page, cursor = list_requests(requests_db, limit=2, cursor=cursor)
    assert [r["id"] for r in page] == ["req-020", "req-019"]
    assert page[0]["arrival_time"] == page[1]["arrival_time"]  # req-020..018 share a second


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(limit=0), "limit"),
        (dict(limit=1001), "limit"),
        (dict(status="done"), "status"),
        (dict(since=T0, until=T0), "since"),
        (dict(since=T0 + timedelta(1), until=T0), "since"),
        (dict(since=datetime(2026, 1, 1)), "since"),
        (dict(until=datetime(2026, 1, 1)), "until"),
        (dict(cursor="not a cursor!"), "cursor"),
        (dict(cursor=""), "cursor"),
        (dict(cursor=base64.urlsafe_b64encode(b'["x", "y"]').decode()), "cursor"),
        (dict(cursor=base64.urlsafe_b64encode(b'{"a": 1}').decode()), "cursor"),
        (dict(cursor=base64.urlsafe_b64encode(b'["2026-01-01T00:00", "y"]').decode()), "cursor"),
    ],
)
def test_list_requests_bad_parameters(kwargs: dict, param: str) -> None:
    # Parameters are checked before any query: an empty, never-migrated database will do.
    engine = make_engine("sqlite://")
    try:
        with pytest.raises(ValueError, match=f"^{param}: "):
            list_requests(engine, **kwargs)
    finally:
        engine.dispose()
