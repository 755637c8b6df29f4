"""Spend over an exact window (1 minute to 24 hours) by API key, model and end user: from the
request rows, equal to a direct SQL sum over the same rows; rows just outside are left out;
whole hours agree with the hourly rollups; the CLI and GET /admin/costs (scope instance or
fleet) state the window and source they used, and refuse a window they cannot answer."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, insert

from controlplane.accounting.cli import add_report_parser
from controlplane.accounting.reports import cost_report, cost_window
from controlplane.accounting.rollup import run_rollup
from controlplane.client.admin import AdminClient
from controlplane.config import Price
from controlplane.errors import FieldError
from controlplane.store import RequestRow, sync_prices, time_buckets
from harness import wait_rows

PRICE = Price("*", datetime(2026, 1, 1, tzinfo=UTC), 0.10, 0.05, 0.40)
T = datetime(2026, 3, 1, 12, 34, 17, tzinfo=UTC)  # a window start that is not a whole hour
TEN = timedelta(minutes=10)
KEYS = ("api_key", "model", "end_user")


def price_id(engine: Engine) -> int:
    sync_prices(engine, [PRICE])
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT id FROM prices")).scalar_one()


def add(
    engine: Engine,
    rid: str,
    at: datetime,
    *,
    pid: int,
    key: str | None = "alice",
    user: str | None = "u1",
    model: str = "m",
    instance: str = "inst-a",
    status: str = "success",
    prompt: int = 100,
    cached: int = 0,
    completion: int = 10,
) -> None:
    cost = (
        (prompt - cached) * PRICE.prompt_per_mtok
        + cached * PRICE.cached_prompt_per_mtok
        + completion * PRICE.completion_per_mtok
    ) / 1e6
    hour, day = time_buckets(at)
    with engine.begin() as conn:
        conn.execute(
            insert(RequestRow.__table__).values(
                id=rid,
                instance_id=instance,
                model=model,
                endpoint="completions",
                api_key_name=key,
                end_user=user,
                status=status,
                arrival_time=at,
                prompt_tokens=prompt,
                cached_prompt_tokens=cached,
                completion_tokens=completion,
                price_id=None if status == "running" else pid,
                cost_usd=None if status == "running" else cost,
                hour_bucket=hour,
                day_bucket=day,
            )
        )


def seed_window(engine: Engine) -> None:
    """Final rows inside [T, T + 10 min) (the first exactly at T), a running one inside, and
    rows just outside on both sides (the end is exclusive)."""
    pid = price_id(engine)
    s = timedelta(seconds=1)
    add(engine, "in-0", T, pid=pid, prompt=120, cached=40, completion=7)
    add(engine, "in-1", T + 2 * s, pid=pid, key="bob", user="u2", completion=30)
    add(engine, "in-2", T + 61 * s, pid=pid, key=None, user=None, model="m2", completion=3)
    add(engine, "in-3", T + 5 * TEN / 10, pid=pid, user="u2", status="error", completion=0)
    add(engine, "in-4", T + TEN - s, pid=pid, key="bob", model="m2", prompt=900, completion=90)
    add(engine, "in-5", T + 3 * s, pid=pid, key="", user="", prompt=5, completion=5)  # "" = None
    add(engine, "in-b", T + 4 * s, pid=pid, instance="inst-b", key="bob", completion=11)
    add(engine, "running", T + 30 * s, pid=pid, status="running", prompt=999)
    add(engine, "before", T - s, pid=pid, prompt=7777)
    add(engine, "at-end", T + TEN, pid=pid, prompt=8888)
    add(engine, "after", T + TEN + s, pid=pid, prompt=9999)


def sql_sums(engine: Engine, since: datetime, until: datetime, groups, instance=None) -> dict:
    """The same figures, straight from SQL: group -> (requests, succeeded, prompt, completion,
    list cost)."""
    cols = {
        "api_key": "coalesce(api_key_name, '')",
        "model": "model",
        "end_user": "coalesce(end_user, '')",
    }
    keys = ", ".join(cols[g] for g in groups) or "'all'"
    where = "arrival_time >= :s AND arrival_time < :u AND status <> 'running'"
    if instance:
        where += " AND instance_id = :i"
    stmt = sa.text(
        f"SELECT {keys}, count(*), sum(CASE WHEN status = 'success' THEN 1 ELSE 0 END), "
        f"sum(prompt_tokens), sum(completion_tokens), sum(cost_usd) FROM requests "
        f"WHERE {where} GROUP BY {keys}"
    ).bindparams(  # stored as the column stores them (naive UTC text on SQLite)
        sa.bindparam("s", type_=RequestRow.__table__.c.arrival_time.type),
        sa.bindparam("u", type_=RequestRow.__table__.c.arrival_time.type),
    )
    out: dict = {}
    with engine.connect() as conn:
        for r in conn.execute(stmt, {"s": since, "u": until, "i": instance}):
            n = len(groups)
            key = tuple(r[:n]) if groups else ()
            got = out.setdefault(key, [0, 0, 0, 0, 0.0])
            for i, v in enumerate(r[max(n, 1) :]):
                got[i] += float(v) if i == 4 else int(v)
    return {k: tuple(v) for k, v in out.items()}


def figures(row: dict) -> tuple:
    return (
        row["requests"],
        row["requests_succeeded"],
        row["prompt_tokens"],
        row["completion_tokens"],
        row["list_cost_usd"],
    )


def assert_matches(report, expected: dict) -> None:
    got = {tuple(r[g] for g in report.group_by): figures(r) for r in report.rows}
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        assert got[key][:4] == want[:4], key
        assert got[key][4] == pytest.approx(want[4], rel=1e-12, abs=1e-15), key
    total = tuple(sum(v[i] for v in expected.values()) for i in range(5))
    assert figures(report.totals)[:4] == total[:4]
    assert report.totals["list_cost_usd"] == pytest.approx(total[4], rel=1e-12)


# -- store level: a 10-minute window -------------------------------------------------------------


@pytest.mark.parametrize("groups", [["api_key", "model", "end_user"], ["api_key"], ["end_user"]])
def test_ten_minute_window_equals_sql(db_engine: Engine, groups: list[str]) -> None:
    seed_window(db_engine)
    report = cost_report(db_engine, since=T, until=T + TEN, group_by=groups, source="auto")
    assert report.source == "requests" and report.scope == "fleet"
    assert (report.since, report.until) == (T.isoformat(), (T + TEN).isoformat())  # exact
    expected = sql_sums(db_engine, T, T + TEN, report.group_by)
    assert_matches(report, expected)
    # Six final rows of inst-a and one of inst-b; the running row and the rows at T - 1 s,
    # T + 10 min and after are out.
    assert report.totals["requests"] == 7 and report.totals["requests_failed"] == 1
    assert report.totals["prompt_tokens"] == 120 + 100 + 100 + 100 + 900 + 5 + 100
    # Token shares: each group's prompt + completion tokens over the window's.
    all_tokens = report.totals["prompt_tokens"] + report.totals["completion_tokens"]
    for r in report.rows:
        share = (r["prompt_tokens"] + r["completion_tokens"]) / all_tokens
        assert r["token_share"] == pytest.approx(share, rel=1e-12)
    assert math.fsum(r["token_share"] for r in report.rows) == pytest.approx(1.0, rel=1e-12)
    assert report.totals["token_share"] == pytest.approx(1.0)
    # Nothing from the rows is provisional, and there is no GPU figure (kept per hour).
    assert report.totals["provisional"] is False and report.totals["gpu_cost_usd"] is None
    # Cached tokens are priced and counted as the rollup counts them.
    assert report.totals["cached_prompt_tokens"] == 40
    saved = 40 * (PRICE.prompt_per_mtok - PRICE.cached_prompt_per_mtok) / 1e6
    assert report.totals["cache_savings_usd"] == pytest.approx(saved, rel=1e-12)


def test_instance_scope_counts_one_instance(db_engine: Engine) -> None:
    seed_window(db_engine)
    groups = ["api_key", "end_user"]
    mine = cost_report(db_engine, since=T, until=T + TEN, group_by=groups, source="auto", instance_id="inst-a")  # fmt: skip
    assert (mine.scope, mine.instance_id) == ("instance", "inst-a")
    assert_matches(mine, sql_sums(db_engine, T, T + TEN, groups, instance="inst-a"))
    fleet = cost_report(db_engine, since=T, until=T + TEN, group_by=groups, source="auto")
    assert fleet.totals["requests"] == mine.totals["requests"] + 1  # inst-b's row
    assert fleet.to_dict()["scope"] == "fleet" and mine.to_dict()["instance_id"] == "inst-a"


def test_whole_hours_agree_between_rows_and_rollups(db_engine: Engine) -> None:
    pid = price_id(db_engine)
    start = datetime(2026, 3, 1, 11, tzinfo=UTC)
    n = 0
    for minute in (0, 7, 59, 60, 61, 95, 119, 120, 150, 179):
        for inst, key, user in (("inst-a", "alice", "u1"), ("inst-b", "bob", None)):
            n += 1
            add(db_engine, f"r{n}", start + timedelta(minutes=minute), pid=pid, instance=inst,
                key=key, user=user, model="m" if minute % 2 else "m2", prompt=100 + n,
                cached=n % 3 * 10, completion=n, status="error" if n % 5 == 0 else "success")  # fmt: skip
    add(db_engine, "late", start + timedelta(minutes=180), pid=pid)  # 14:00: outside
    later = start + timedelta(hours=3, minutes=10)
    for inst in ("inst-a", "inst-b"):
        run_rollup(db_engine, inst, now=later, gpu_hourly_usd=0.0, num_gpus=1, peak_flops=0.0)
    since, until = start, start + timedelta(hours=3)
    for groups in (["hour", "model", "api_key"], ["api_key"], []):
        rows = cost_report(db_engine, since=since, until=until, group_by=groups, source="requests")
        rolled = cost_report(db_engine, since=since, until=until, group_by=groups, source="rollups")
        assert (rows.source, rolled.source) == ("requests", "rollups")
        assert (rows.since, rows.until) == (rolled.since, rolled.until)
        assert rolled.totals["provisional"] is False
        same = (
            "requests",
            "requests_succeeded",
            "requests_failed",
            "prompt_tokens",
            "cached_prompt_tokens",
            "completion_tokens",
            "token_share",
        )
        money = ("list_cost_usd", "cache_savings_usd", "list_usd_per_mtok_prompt", "list_usd_per_mtok_completion")  # fmt: skip
        assert len(rows.rows) == len(rolled.rows) and rows.rows
        for a, b in [*zip(rows.rows, rolled.rows, strict=True), (rows.totals, rolled.totals)]:
            assert {k: a.get(k) for k in (*groups, *same)} == {
                k: b.get(k) for k in (*groups, *same)
            }
            for k in money:
                assert a[k] == pytest.approx(b[k], rel=1e-12), k
    # Over whole hours "auto" reads the rollups, unless it groups by end user.
    auto = cost_report(db_engine, since=since, until=until, group_by="api_key", source="auto")
    assert auto.source == "rollups" and auto.totals["requests"] == 20
    by_user = cost_report(db_engine, since=since, until=until, group_by="end_user", source="auto")
    assert by_user.source == "requests"
    assert {r["end_user"]: r["requests"] for r in by_user.rows} == {"": 10, "u1": 10}


def test_which_source_and_refused_windows() -> None:
    hour = datetime(2026, 3, 1, 11, tzinfo=UTC)
    assert cost_window(T, T + TEN, []) == ("requests", T, T + TEN)
    assert cost_window(T, T + timedelta(hours=24), ["api_key"])[0] == "requests"
    assert cost_window(hour, hour + timedelta(hours=2), ["api_key"]) == (
        "rollups",
        hour,
        hour + timedelta(hours=2),
    )
    # Over 24 h: the rollups' whole hours (the Report says so in since / until).
    source, start, end = cost_window(T, T + timedelta(hours=25), [])
    assert (source, start, end) == ("rollups", hour.replace(hour=12), hour.replace(hour=14, day=2))

    def refused(*args, **kwargs) -> FieldError:
        with pytest.raises(FieldError) as exc:
            cost_window(*args, **kwargs)
        return exc.value

    e = refused(T, T + timedelta(seconds=59), [])
    assert e.field == "since" and "at least 1m" in e.message and "59s" in e.message
    e = refused(T, T + timedelta(hours=25), ["end_user"])
    assert e.field == "since" and "at most 24h" in e.message and "25h" in e.message
    e = refused(T, T + timedelta(hours=25), [], "requests")
    assert e.field == "since" and "at most 24h" in e.message
    assert refused(hour, hour + timedelta(hours=1), ["end_user"], "rollups").field == "group_by"
    assert refused(T, T + TEN, [], "guess").field == "source"
    assert refused(T + TEN, T, []).field == "since"


# -- the CLI --------------------------------------------------------------------------------------


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="controlplane")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", "cost", *argv])
    return args.func(args)


def test_cli_since_10m_states_the_window_and_matches_sql(db_engine: Engine, db_url: str, capsys) -> None:  # fmt: skip
    pid = price_id(db_engine)
    now = datetime.now(UTC)
    add(db_engine, "new-a", now - timedelta(minutes=3), pid=pid, completion=20)
    add(db_engine, "new-b", now - timedelta(minutes=4), pid=pid, key="bob", user="u2", completion=5)
    add(db_engine, "new-c", now - timedelta(minutes=5), pid=pid, key="bob", prompt=300)
    add(db_engine, "old", now - timedelta(minutes=11), pid=pid, prompt=5000)  # outside 10 minutes
    assert cli("--url", db_url, "--since", "10m", "--group-by", "api_key", "--format", "json") == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    since, until = (datetime.fromisoformat(doc[k]) for k in ("since", "until"))
    assert until - since == TEN  # exactly ten minutes, not widened to whole hours
    assert (doc["source"], doc["scope"]) == ("requests", "fleet")
    expected = sql_sums(db_engine, since, until, ["api_key"])
    assert {r["api_key"]: figures(r)[:4] for r in doc["rows"]} == {
        k[0]: v[:4] for k, v in expected.items()
    }
    assert expected == {("alice",): (1, 1, 100, 20, pytest.approx(expected[("alice",)][4])),
                        ("bob",): (2, 2, 400, 15, pytest.approx(expected[("bob",)][4]))}  # fmt: skip
    assert doc["totals"]["list_cost_usd"] == pytest.approx(
        math.fsum(v[4] for v in expected.values()), rel=1e-12
    )
    # The table states the exact window (to the second) and where it was read from.
    assert cli("--url", db_url, "--since", "10m", "--group-by", "api_key,end_user") == 0
    out = capsys.readouterr().out
    title = out.splitlines()[0]
    assert "exact window, from the request rows" in title
    assert title.count(":") >= 4 and " to " in title  # HH:MM:SS on both bounds
    assert "alice" in out and "u2" in out and "GPU $" not in out and "provisional" not in out
    # One instance only: the rows are all inst-a's, so the same totals; another id, none.
    assert cli("--url", db_url, "--since", "10m", "--instance", "inst-a", "--format", "json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["scope"], doc["instance_id"], doc["totals"]["requests"]) == ("instance", "inst-a", 3)  # fmt: skip
    assert cli("--url", db_url, "--since", "10m", "--instance", "nobody") == 0
    assert capsys.readouterr().out.startswith("no cost data between ")


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (("--since", "0.5m"), "--since", "at least 1m"),
        (("--since", "10x"), "--since", "expected a duration"),
        (("--since", "2d", "--group-by", "end_user"), "--since", "at most 24h"),
        (("--since", "10m", "--until", "2026-13-01"), "--until", ""),
        (("--since", "10m", "--group-by", "user"), "--group-by", "end_user"),
    ],
)
def test_cli_refuses_a_window_it_cannot_answer(argv, flag, words, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli("--url", "sqlite://", *argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and words in err


# -- a live daemon ------------------------------------------------------------------------------

TOKEN = "windows-token-0123456789ab"
KEYS_CFG = [{"name": "alice", "key": "sk-alice-0"}, {"name": "bob", "key": "sk-bob-0"}]


def test_admin_costs_five_minutes_by_key_and_user(make_daemon) -> None:
    d = make_daemon(
        store={"flush_interval_s": 0.1},
        api_keys=KEYS_CFG,
        admin_tokens=[{"name": "ops", "token": TOKEN}],
    )
    cfg = d.cfg
    sent = [("sk-alice-0", "u1", 3), ("sk-alice-0", "u2", 5), ("sk-bob-0", "u1", 4)]
    for key, user, n in sent:
        body = {"model": "model", "prompt": "spend", "max_tokens": n, "ignore_eos": True,
                "user": user}  # fmt: skip
        r = httpx.post(d.url + "/v1/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        assert r.status_code == 200, r.text
    done = wait_rows(cfg.store_url, lambda f: len(f) == 3, where="status = 'success'")
    (instance,) = {r["instance_id"] for r in done}
    db = sa.create_engine(cfg.store_url)
    # Another instance's request on the same database: fleet scope counts it.
    add(db, "elsewhere", datetime.now(UTC) - timedelta(minutes=1), pid=done[0]["price_id"],
        instance="other-instance", key="bob", user="u9", model="model")  # fmt: skip
    c = d.client(TOKEN, timeout=30)
    groups = ["api_key", "end_user"]
    for scope, only in (("fleet", None), ("instance", instance)):
        got = c.get("/admin/costs", params={"since": "5m", "group_by": "api_key,end_user", "scope": scope})  # fmt: skip
        assert got.status_code == 200, got.text
        doc = got.json()
        assert (doc["source"], doc["scope"], doc["instance_id"]) == ("requests", scope, only)
        since, until = (datetime.fromisoformat(doc[k]) for k in ("since", "until"))
        assert until - since == timedelta(minutes=5)
        expected = sql_sums(db, since, until, groups, instance=only)
        rows = {(r["api_key"], r["end_user"]): r for r in doc["rows"]}
        assert rows.keys() == expected.keys()
        for k, want in expected.items():
            assert figures(rows[k])[:4] == want[:4], k
            assert rows[k]["list_cost_usd"] == pytest.approx(want[4], rel=1e-12)
        want_keys = {("alice", "u1"), ("alice", "u2"), ("bob", "u1")}
        assert set(rows) == (want_keys | ({("bob", "u9")} if scope == "fleet" else set()))
        assert rows[("alice", "u2")]["completion_tokens"] == 5

    # The dashboard's client asks the same.
    async def via_client() -> dict:
        client = AdminClient(d.url, TOKEN)
        try:
            return await client.costs("5m", group_by="api_key,end_user", scope="instance")
        finally:
            await client.aclose()

    doc = asyncio.run(via_client())
    assert doc["scope"] == "instance" and doc["totals"]["requests"] == 3
    # Windows it cannot answer: 422 naming the parameter and the limit.
    for params, param, words in (
        ({"since": "0.5m"}, "since", "at least 1m"),
        ({"since": "2d", "group_by": "end_user"}, "since", "at most 24h"),
        ({"since": "soon"}, "since", "expected a duration"),
        ({"since": "10m", "scope": "galaxy"}, "scope", "fleet or instance"),
    ):
        r = c.get("/admin/costs", params=params)
        assert r.status_code == 422, (params, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    db.dispose()
