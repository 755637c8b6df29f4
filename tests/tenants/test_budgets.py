"""Spend budgets per API key (controlplane.tenants.budgets) on real SQLite (and PostgreSQL for
the read): the UTC periods, the spend read by key and day with this process's own rows left
out and counted locally instead (never twice, never missed), the verdicts at the budget
(reject, deprioritize), the soft and budget events once per key, period and amount, and
hostile budget values refused naming the field and its limit."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import insert

from controlplane.config import Price, build_config
from controlplane.errors import FieldError
from controlplane.store import RequestRow, make_engine, sync_prices, upgrade
from controlplane.store.recorder import row_values
from controlplane.store.records import RequestRecord
from controlplane.tenants.budgets import (
    EXHAUSTED,
    SOFT,
    BudgetTracker,
    period_bounds,
)
from controlplane.tenants.keys import Audit, KeyCache, KeyStore

AUDIT = Audit("me", "api", "ops")
ME, OTHER = "me", "other"
NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
STARTED = NOW - timedelta(hours=1)  # this process's start: its rows after it are its own
# $1 per token, prompt, cached and completion alike: a record's cost is its token count.
PRICE = Price(
    model="*",
    effective_from=datetime(2026, 1, 1, tzinfo=UTC),
    prompt_per_mtok=1e6,
    cached_prompt_per_mtok=1e6,
    completion_per_mtok=1e6,
)


def record(
    key: str | None, at: datetime, tokens: int, instance: str = OTHER, **kw
) -> RequestRecord:
    rid = f"{key}-{instance}-{at.isoformat()}-{tokens}-{kw.get('status', 'success')}"
    return RequestRecord(
        id=rid,
        instance_id=instance,
        model="m",
        endpoint="completions",
        status=kw.pop("status", "success"),
        arrival_time=at,
        api_key_name=key,
        prompt_tokens=tokens,
        completion_tokens=0,
        **kw,
    )


class Setup:
    def __init__(self, url: str) -> None:
        upgrade(url)
        self.db = make_engine(url)
        sync_prices(self.db, [PRICE])
        self.store, self.cache = KeyStore(self.db), KeyCache()
        self.soft, self.now = 0.8, NOW
        self.tracker = BudgetTracker(
            self.cache, ME, STARTED, lambda: self.soft, clock=lambda: self.now
        )
        self.events: list = []
        self.tracker.on_event = self.events.append

    def key(self, name: str, **fields) -> None:
        self.store.create({"name": name, **fields}, AUDIT)
        self.cache.load(self.db)

    def rows(self, *records: RequestRecord) -> None:
        """Write the records as the recorder would (priced at ingest)."""
        from controlplane.store import PriceBook

        book = PriceBook.load(self.db)
        with self.db.begin() as conn:
            conn.execute(insert(RequestRow.__table__), [row_values(r, book) for r in records])

    def load(self, now: datetime = NOW) -> list:
        found = self.tracker.load(self.db, now)
        self.events += found
        return found

    def spend(self, name: str, now: datetime = NOW) -> float:
        s = self.tracker.standing(name, now)
        assert s is not None
        return s.spend_usd


@pytest.fixture
def sqlite(tmp_path) -> Setup:
    s = Setup(f"sqlite:///{tmp_path}/b.db")
    yield s
    s.db.dispose()


def test_periods_are_utc_calendar_days_and_months():
    assert period_bounds("day", NOW) == (
        datetime(2026, 11, 20, tzinfo=UTC),
        datetime(2026, 11, 21, tzinfo=UTC),
    )
    assert period_bounds("month", NOW) == (
        datetime(2026, 11, 1, tzinfo=UTC),
        datetime(2026, 12, 1, tzinfo=UTC),
    )
    december = datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC)
    assert period_bounds("month", december)[1] == datetime(2027, 1, 1, tzinfo=UTC)
    assert period_bounds("day", december)[1] == datetime(2027, 1, 1, tzinfo=UTC)
    assert period_bounds("month", datetime(2028, 2, 29, 8, tzinfo=UTC))[1] == datetime(
        2028, 3, 1, tzinfo=UTC
    )
    # An aware time elsewhere is taken in UTC: 01:30 at +05:00 is the previous UTC day.
    east = datetime(2026, 11, 20, 1, 30, tzinfo=timezone(timedelta(hours=5)))
    assert period_bounds("day", east)[0] == datetime(2026, 11, 19, tzinfo=UTC)


def test_the_read_sums_each_period_and_leaves_out_only_this_process_rows(db_url):
    s = Setup(db_url)
    try:
        s.key("daily", budget_usd=100, budget_period="day")
        s.key("monthly", budget_usd=100)  # budget_period null: a month
        s.key("free")  # no budget: never read
        yesterday, month_start = NOW - timedelta(days=1), datetime(2026, 11, 1, 0, 0, 1, tzinfo=UTC)
        s.rows(
            record("daily", NOW - timedelta(minutes=5), 2),
            record("daily", yesterday, 5),  # another day: not in today's period
            record("daily", NOW - timedelta(minutes=4), 9, status="running"),  # not priced yet
            record("monthly", month_start, 3),
            record("monthly", NOW - timedelta(minutes=3), 1),
            record("monthly", datetime(2026, 10, 31, 23, 59, tzinfo=UTC), 40),  # last month
            # This instance before this process started (a previous run): read.
            record("daily", STARTED - timedelta(minutes=1), 4, instance=ME),
            # This process's own rows: left out (counted locally as they end).
            record("daily", STARTED + timedelta(minutes=1), 7, instance=ME),
            record("free", NOW - timedelta(minutes=1), 50),
        )
        s.load()
        assert s.spend("daily") == 2 + 4
        assert s.spend("monthly") == 3 + 1
        assert s.tracker.standing("free", NOW) is None  # no budget
        assert s.tracker.standing("nobody", NOW) is None and s.tracker.standing(None) is None
        assert set(s.tracker._fleet) == {"daily", "monthly"}  # only budgeted keys were read
        # Tomorrow the day's spend starts again; the month's is kept.
        assert s.spend("daily", NOW + timedelta(days=1)) == 0
    finally:
        s.db.dispose()


def test_own_spend_counts_at_once_and_once(sqlite):
    s = sqlite
    s.key("k", budget_usd=100, budget_period="day")
    s.load()
    rec = record("k", NOW - timedelta(minutes=1), 6, instance=ME)
    s.tracker.spent(rec)
    assert s.spend("k") == 6  # at once, before any row is written or read
    s.tracker.spent(record("k", NOW, 3, instance=ME, status="running"))  # not final: nothing
    s.tracker.spent(record(None, NOW, 3, instance=ME))  # an open API: nothing
    assert s.spend("k") == 6
    s.rows(rec)  # its row reaches the database; the next read leaves it out
    s.load()
    assert s.spend("k") == 6
    s.rows(record("k", NOW - timedelta(minutes=1), 10))  # another daemon's
    s.load()
    assert s.spend("k") == 16


def test_spend_before_the_first_read_is_priced_at_it(sqlite):
    s = sqlite
    s.key("k", budget_usd=100)
    s.tracker.spent(record("k", NOW, 5, instance=ME))  # no price book yet
    assert s.spend("k") == 0
    s.load()
    assert s.spend("k") == 5


def test_a_key_without_a_budget_yet_keeps_its_own_spend(sqlite):
    """This process's rows are never read back: spend counted before a budget is set on the
    key still counts once it has one."""
    s = sqlite
    s.key("k")
    s.load()
    s.tracker.spent(record("k", NOW - timedelta(minutes=2), 30, instance=ME))
    s.store.update("k", {"budget_usd": 40, "budget_period": "day"}, AUDIT)
    s.cache.load(s.db)
    s.load()
    assert s.spend("k") == 30


def test_reject_at_the_budget_naming_it_the_spend_and_the_reset(sqlite):
    s = sqlite
    s.key("k", budget_usd=10, budget_period="day")
    s.rows(record("k", NOW - timedelta(minutes=1), 9))
    s.load()
    assert s.tracker.check("k", NOW) is None  # $9 of $10: admitted
    s.tracker.spent(record("k", NOW, 1, instance=ME))
    verdict = s.tracker.check("k", NOW)
    assert verdict is not None and verdict.action == "reject"
    assert "'k'" in verdict.message and "$10.00" in verdict.message
    assert "spent $10.00" in verdict.message and "this day" in verdict.message
    assert "2026-11-21T00:00:00Z" in verdict.message  # when the period resets
    assert verdict.retry_after_s == 12 * 3600  # noon to midnight
    # Raised live: admitted again (the key cache is the budget's source).
    s.store.update("k", {"budget_usd": 11}, AUDIT)
    s.cache.load(s.db)
    assert s.tracker.check("k", NOW) is None


def test_deprioritize_and_a_zero_budget(sqlite):
    s = sqlite
    s.key("slow", budget_usd=0, budget_action="deprioritize")
    s.key("stop", budget_usd=0)
    s.load()
    slow, stop = s.tracker.check("slow", NOW), s.tracker.check("stop", NOW)
    assert slow is not None and slow.action == "deprioritize"
    assert stop is not None and stop.action == "reject"  # the default action
    # A month budget resets on the 1st: 10 days and 12 hours from NOW.
    assert stop.retry_after_s == (10 * 24 + 12) * 3600
    assert s.tracker.standing("stop", NOW).use == 1.0


def test_events_once_per_key_period_and_amount(sqlite):
    s = sqlite
    s.soft = 0.5
    s.key("k", budget_usd=10, budget_period="day")
    s.load()
    spend = [3, 2, 1, 4, 1]  # $3 (30%), $5 (50%: soft), $6, $10 (budget), $11
    kinds = []
    for tokens in spend:
        s.tracker.spent(record("k", NOW - timedelta(seconds=tokens), tokens, instance=ME))
        kinds.append([e.kind for e in s.events])
    assert kinds == [[], [SOFT], [SOFT], [SOFT, EXHAUSTED], [SOFT, EXHAUSTED]]
    s.load()  # a read finds nothing new to announce
    s.tracker.check("k", NOW)
    assert len(s.events) == 2
    soft, exhausted = s.events
    body = soft.payload()
    assert body["type"] == "budget" and body["event"] == SOFT and body["key"] == "k"
    assert body["budget_usd"] == 10 and body["budget_period"] == "day"
    assert body["spend_usd"] == 5 and body["use"] == 0.5 and body["soft_threshold"] == 0.5
    assert body["resets_at"] == "2026-11-21T00:00:00+00:00"
    assert "passed its soft threshold (50% of the budget)" in soft.message()
    assert "spent $5.00 of $10.00 this day" in soft.message()
    assert "its further requests are rejected" in exhausted.message()

    # A budget raised in the period re-arms both events.
    s.store.update("k", {"budget_usd": 20}, AUDIT)
    s.cache.load(s.db)
    s.tracker.spent(record("k", NOW, 0, instance=ME))  # $11 of $20: soft again
    assert [e.kind for e in s.events[2:]] == [SOFT]

    # The next day is a new period: nothing spent, nothing announced until it is.
    s.now = tomorrow = NOW + timedelta(days=1)
    assert s.load(tomorrow) == []
    s.tracker.spent(record("k", tomorrow, 12, instance=ME))
    assert [e.kind for e in s.events[3:]] == [SOFT]
    assert s.events[3].standing.period_start == datetime(2026, 11, 21, tzinfo=UTC)


def test_a_read_announces_what_another_daemon_spent(sqlite):
    s = sqlite
    s.key("k", budget_usd=10, budget_period="day")
    s.rows(record("k", NOW - timedelta(minutes=1), 12))
    found = s.load()
    assert [e.kind for e in found] == [SOFT, EXHAUSTED]
    assert found[1].standing.spend_usd == 12 and math.isclose(found[1].standing.use, 1.2)


def test_a_failed_read_keeps_the_last_figures(sqlite):
    import asyncio

    s = sqlite
    s.key("k", budget_usd=10, budget_period="day")
    s.rows(record("k", datetime.now(UTC) - timedelta(seconds=1), 4))
    asyncio.run(s.tracker.refresh(s.db))
    assert s.spend("k", datetime.now(UTC)) == 4
    s.db.dispose()
    broken = make_engine("sqlite:////nonexistent/dir/b.db")
    asyncio.run(s.tracker.refresh(broken))
    assert s.tracker.errors == 1 and s.spend("k", datetime.now(UTC)) == 4


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"budget_usd": float("nan")}, "from 0 to 1e+09"),
        ({"budget_usd": float("-inf")}, "from 0 to 1e+09"),
        ({"budget_usd": -0.01}, "from 0 to 1e+09"),
        ({"budget_usd": 1e12}, "from 0 to 1e+09"),
        ({"budget_usd": 10**400}, "from 0 to 1e+09"),  # an int no float can hold
        ({"budget_usd": True}, "from 0 to 1e+09"),
        ({"budget_usd": "5"}, "from 0 to 1e+09"),
        ({"budget_period": "week"}, "day, month"),
        ({"budget_period": "Month"}, "day, month"),
        ({"budget_period": 30}, "day, month"),
        ({"budget_action": "drop"}, "reject, deprioritize"),
    ],
)
def test_hostile_budgets_are_refused_naming_the_field_and_its_limit(sqlite, body, says):
    s = sqlite
    field = next(iter(body))
    with pytest.raises(FieldError) as exc:
        s.store.create({"name": "x", **body}, AUDIT)
    assert exc.value.field == field and says in exc.value.message
    s.key("kept", budget_usd=5)
    with pytest.raises(FieldError) as exc:
        s.store.update("kept", body, AUDIT)
    assert exc.value.field == field
    assert s.store.get("kept")["budget"]["budget_usd"] == 5  # unchanged


@pytest.mark.parametrize("value", [0, -0.5, 1.01, float("nan"), "high"])
def test_the_soft_threshold_is_a_share_of_the_budget(value):
    with pytest.raises(FieldError) as exc:
        build_config({"limits": {"budget_soft_threshold": value}}, env={})
    assert exc.value.field == "limits.budget_soft_threshold"
    with pytest.raises(FieldError) as exc:
        build_config({"limits": {"budget_refresh_s": 0}}, env={})
    assert exc.value.field == "limits.budget_refresh_s"
    assert (
        build_config({"limits": {"budget_soft_threshold": 1}}, env={}).limits.budget_soft_threshold
        == 1
    )
