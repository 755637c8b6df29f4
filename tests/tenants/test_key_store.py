"""The api_keys table (migration 0013) and its KeyStore / KeyCache on real SQLite and
PostgreSQL: create, update, rotate, revoke, each with its audit rows (never a secret or hash);
hostile values refused naming the field; the failed-authentication limiter by the clock."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import inspect

from controlplane.errors import FieldError
from controlplane.store import make_engine
from controlplane.store.audit import history
from controlplane.store.migrate import upgrade
from controlplane.tenants.keys import (
    Audit,
    AuthFailures,
    KeyCache,
    KeyConflictError,
    KeyNotFoundError,
    KeyStore,
    hash_secret,
)

AUDIT = Audit("inst-1", "api", "ops")


@pytest.fixture
def db(db_url: str):
    upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def test_migration_creates_the_table(db):
    cols = {c["name"] for c in inspect(db).get_columns("api_keys")}
    assert {
        "name",
        "secret_hash",
        "prefix",
        "owner",
        "created_at",
        "expires_at",
        "revoked_at",
        "allowed_models",
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent",
        "max_tokens_per_request",
        "budget_usd",
        "budget_period",
        "budget_action",
        "priority_class",
    } <= cols


def test_key_life_and_its_audit(db):
    store, cache = KeyStore(db), KeyCache()
    cache.load(db)
    assert not cache.closed  # no row: the API stays open
    view, secret = store.create(
        {"name": "team-a", "owner": "alice", "requests_per_minute": 60}, AUDIT
    )
    assert secret.startswith("cp-") and len(secret) >= 3 + 43
    assert view["prefix"] == secret[:8] and "secret" not in view and "secret_hash" not in view
    cache.load(db)
    assert cache.closed and cache.lookup(secret.encode()).name == "team-a"
    assert cache.lookup(b"cp-wrong") is None

    new = store.update("team-a", {"tokens_per_minute": 1000, "budget_usd": 2.5}, AUDIT)
    assert new["limits"]["tokens_per_minute"] == 1000 and new["budget"]["budget_usd"] == 2.5
    _, secret2 = store.rotate("team-a", AUDIT)
    cache.load(db)
    assert cache.lookup(secret.encode()) is None and cache.lookup(secret2.encode()) is not None
    revoked, changed = store.revoke("team-a", AUDIT)
    assert changed and revoked["state"] == "revoked"
    assert store.revoke("team-a", AUDIT)[1] is False  # again: nothing to do, no audit row
    cache.load(db)
    assert cache.lookup(secret2.encode()) is None
    assert cache.closed  # revoking every key does not open the API
    with pytest.raises(KeyConflictError):
        store.rotate("team-a", AUDIT)

    rows = history(db)
    fields = [r["field"] for r in reversed(rows)]
    assert fields == [
        "api_keys.team-a",
        "api_keys.team-a.tokens_per_minute",
        "api_keys.team-a.budget_usd",
        "api_keys.team-a.prefix",
        "api_keys.team-a.revoked_at",
    ]
    assert all(r["actor"] == "ops" and r["source"] == "api" for r in rows)
    text = json.dumps(rows)
    for s in (secret, secret2):
        assert s not in text and hash_secret(s) not in text
    assert rows[0]["old_value"] is None and rows[0]["new_value"] == revoked["revoked_at"]


class _PausedRead:
    """The real database, whose next read waits (after reading) until `resume` is set: a
    periodic reload that read the table before an admin change and finishes after it."""

    def __init__(self, db) -> None:
        self.db, self.read, self.resume = db, threading.Event(), threading.Event()

    @contextlib.contextmanager
    def connect(self):
        with self.db.connect() as conn:
            outer = self

            class Conn:
                def execute(self, *args, **kw):
                    result = conn.execute(*args, **kw).mappings().all()
                    outer.read.set()
                    outer.resume.wait(30)

                    class Rows:
                        def mappings(self):
                            return self

                        def all(self):
                            return result

                    return Rows()

            yield Conn()


def test_a_reload_that_read_before_a_revoke_does_not_undo_it(db):
    store, cache = KeyStore(db), KeyCache()
    _, secret = store.create({"name": "team-a"}, AUDIT)
    cache.load(db)
    paused = _PausedRead(db)
    stale = threading.Thread(target=cache.load, args=(paused,))
    stale.start()
    assert paused.read.wait(30)  # it read the table with the key live...
    store.revoke("team-a", AUDIT)
    cache.load(db)  # ...the admin change's reload runs and applies...
    assert cache.lookup(secret.encode()) is None
    paused.resume.set()  # ...then the stale one finishes: dropped
    stale.join(30)
    assert cache.lookup(secret.encode()) is None


def test_expiry_needs_no_reload(db):
    store, cache = KeyStore(db), KeyCache()
    soon = datetime.now(UTC) + timedelta(seconds=1)
    _, secret = store.create({"name": "short", "expires_at": soon.isoformat()}, AUDIT)
    cache.load(db)
    assert cache.lookup(secret.encode()) is not None
    # The same copy with its expiry passed: refused without a reload.
    cache._by_hash = {
        h: dataclasses.replace(k, expires_at=k.expires_at - timedelta(hours=1))
        for h, k in cache._by_hash.items()
    }
    assert cache.lookup(secret.encode()) is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "x", "requests_per_minute": -1}, "requests_per_minute"),
        ({"name": "x", "tokens_per_minute": 10**30}, "tokens_per_minute"),
        ({"name": "x", "max_concurrent": 0}, "max_concurrent"),
        ({"name": "x", "max_tokens_per_request": 1.5}, "max_tokens_per_request"),
        ({"name": "x", "budget_usd": float("nan")}, "budget_usd"),
        ({"name": "x", "budget_usd": float("inf")}, "budget_usd"),
        ({"name": "x", "budget_usd": -3}, "budget_usd"),
        ({"name": "x", "budget_period": "week"}, "budget_period"),
        ({"name": "x", "budget_action": "ignore"}, "budget_action"),
        ({"name": "x", "priority_class": True}, "priority_class"),
        ({"name": "x", "allowed_models": []}, "allowed_models"),
        ({"name": "x", "allowed_models": "m"}, "allowed_models"),
        ({"name": "x", "allowed_models": ["a\x00b"]}, "allowed_models"),
        ({"name": "x", "owner": "nul\x00"}, "owner"),
        ({"name": "x", "expires_at": "tomorrow"}, "expires_at"),
        ({"name": "x", "secret_hash": "00"}, "secret_hash"),
        ({"name": "x", "colour": 1}, "colour"),
        ({"name": ""}, "name"),
        ({"name": "(idle)"}, "name"),
        ({"name": "a b"}, "name"),
        ({"name": "x" * 129}, "name"),
        ({}, "name"),
    ],
)
def test_hostile_values_are_refused_naming_the_field(tmp_path, body, field):
    url = f"sqlite:///{tmp_path}/k.db"
    upgrade(url)
    store = KeyStore(make_engine(url))
    with pytest.raises(FieldError) as exc:
        store.create(body, AUDIT)
    assert exc.value.field == field
    assert store.list() == [] and history(store.db) == []


def test_names_are_unique_and_not_the_config_files(tmp_path):
    url = f"sqlite:///{tmp_path}/k.db"
    upgrade(url)
    store = KeyStore(make_engine(url))
    store.create({"name": "a"}, AUDIT)
    with pytest.raises(KeyConflictError, match="exists already"):
        store.create({"name": "a"}, AUDIT)
    with pytest.raises(KeyConflictError, match=r"config file"):
        store.create({"name": "from-file"}, AUDIT, config_names=["from-file"])
    with pytest.raises(KeyNotFoundError):
        store.update("nobody", {"owner": "x"}, AUDIT)
    assert [k["name"] for k in store.list()] == ["a"]


def test_auth_failures_window():
    f = AuthFailures(max_failures=3, window_s=10)
    for i in range(3):
        assert f.retry_after("1.2.3.4", now=100 + i) is None
        f.failed("1.2.3.4", f"guess-{i}".encode(), now=100 + i)
    assert f.retry_after("1.2.3.4", now=103) == 7  # until the oldest leaves the window
    assert f.retry_after("5.6.7.8", now=103) is None  # per address
    assert f.retry_after("1.2.3.4", now=110.5) is None  # the oldest has left
    g = AuthFailures(max_failures=3, window_s=10)
    for i in range(10):  # one stale key, resent: one guess
        g.failed("1.2.3.4", b"stale", now=100 + i / 10)
    assert g.retry_after("1.2.3.4", now=102) is None
    h = AuthFailures(max_failures=1, window_s=10, max_addresses=100)
    for i in range(1000):
        h.failed(f"10.0.{i // 256}.{i % 256}", b"x", now=100)
    assert len(h._failures) == 100  # memory bounded
