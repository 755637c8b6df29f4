"""Spend budgets per API key (issue 55): a table key's `budget_usd` per `budget_period` (a UTC
calendar day or month), at list price, and what happens at a soft threshold and at the budget.

Where the spend comes from. The request rows are already priced (store.recorder prices a final
record at ingest, with the price in force at its arrival), so a key's spend in a period is the
sum of its rows' `cost_usd` that arrived in the period. Each daemon reads that sum from SQL for
the keys that have a budget every `limits.budget_refresh_s` (`BudgetTracker.load`), by key and
UTC day, and adds what it spent itself since it started, counted here as each of its requests
ends (`BudgetTracker.spent`, priced by the same price book and function as the recorder). The
read leaves out this process's own rows (its instance id, arrived since it started): those are
the locally counted ones, so nothing is counted twice, and a row still in the recorder's buffer
is not missed. A single daemon therefore knows its own spend at once: it overspends by at most
the requests in flight when the budget is reached (a request admitted under the budget runs to
its end). Another daemon's spend reaches it once written (store.flush_interval_s) and read (one
budget_refresh_s): across a fleet the worst case is that window of the key's fleet-wide traffic
plus its requests in flight (docs/tenants.md#budgets).

Why its own refresh interval rather than server.key_refresh_s: the keys' reload reads one small
table, the spend read sums the period's request rows of every budgeted key. An operator may
want to read spend less often on a large database without slowing revocations, or more often
to tighten the fleet bound without reloading the keys more often.

Why per UTC day underneath: a key's period may change (day to month) between two reads, and a
month is a sum of days; the rows carry their arrival day (`day_bucket`) already.

The soft threshold (`limits.budget_soft_threshold`, a share of the budget) and the budget itself
each raise one `BudgetEvent` per key, period and budget amount (raising a budget re-arms them):
the runtime logs it, broadcasts it on /admin/events and counts it in Prometheus. At the budget,
admission asks `check`: `reject` (429 insufficient_quota) or `deprioritize` (admitted, at the
lowest priority class), per key (`budget_action`, default reject; `budget_period` defaults to
month).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

from sqlalchemy import Connection, Engine, and_, func, not_, select

from controlplane.store.models import ApiKeyRow, RequestRow, time_buckets
from controlplane.store.prices import PriceBook, cost
from controlplane.store.records import RequestRecord
from controlplane.tenants.keys import BUDGET_ACTIONS, BUDGET_PERIODS, KeyCache

log = logging.getLogger("controlplane.budgets")

REQUESTS = RequestRow.__table__
API_KEYS = ApiKeyRow.__table__
DEFAULT_PERIOD = "month"  # OpenAI's usage limits are monthly; the keys CLI shows this default
DEFAULT_ACTION = "reject"  # OpenAI's behaviour at a quota
SOFT, EXHAUSTED = "soft_threshold", "exhausted"
# Finished requests of this daemon held for pricing while no price book could be read yet
# (the store unreachable at the first read); beyond this the oldest are priced at nothing.
MAX_UNPRICED = 100_000


@dataclass(frozen=True, slots=True)
class Budget:
    """A key's budget as its row sets it, the defaults filled in."""

    usd: float
    period: str  # day | month
    action: str  # reject | deprioritize


class _Budgeted(Protocol):
    """What a budget is read from: a LiveKey, or an `api_keys` row."""

    @property
    def budget_usd(self) -> float | None: ...
    @property
    def budget_period(self) -> str | None: ...
    @property
    def budget_action(self) -> str | None: ...


def budget_of(key: _Budgeted | None) -> Budget | None:
    """The key's budget, or None: no budget_usd (a config file key has none)."""
    if key is None or key.budget_usd is None:
        return None
    period = key.budget_period if key.budget_period in BUDGET_PERIODS else DEFAULT_PERIOD
    action = key.budget_action if key.budget_action in BUDGET_ACTIONS else DEFAULT_ACTION
    return Budget(float(key.budget_usd), period, action)


def period_bounds(period: str, now: datetime) -> tuple[datetime, datetime]:
    """[start, end) of the UTC calendar day or month that holds `now`."""
    now = now.astimezone(UTC)
    if period == "day":
        start = datetime(now.year, now.month, now.day, tzinfo=UTC)
        return start, start + timedelta(days=1)
    start = datetime(now.year, now.month, 1, tzinfo=UTC)
    end = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def usd(value: float) -> str:
    """Money as a message shows it: cents from a dollar up, else six decimals (a request on a
    small model costs a fraction of a cent)."""
    return f"${value:,.2f}" if abs(value) >= 1 else f"${value:.6f}"


def _day(at: datetime) -> str:
    return time_buckets(at)[1]


def use_of(spend_usd: float, budget_usd: float) -> float:
    """Spend / budget (a budget of 0: 1 once the period has begun, nothing may be spent)."""
    if budget_usd > 0:
        return spend_usd / budget_usd
    return 1.0 if spend_usd == 0 else math.inf


def spend_by_day(
    conn: Connection,
    names: Iterable[str],
    since: datetime,
    leave_out: tuple[str, datetime] | None = None,
) -> dict[str, dict[str, float]]:
    """The keys' list-price spend since `since`: key -> UTC arrival day -> USD, the sum of
    their priced request rows (`cost_usd`, priced at ingest) by `day_bucket`. `leave_out`
    (instance id, started at): that process's rows from then on are not read (a daemon counts
    its own locally). The one spend query: the budgets' read and the reports' budget use."""
    c = REQUESTS.c
    where = [c.api_key_name.in_(sorted(names)), c.arrival_time >= since, c.cost_usd.is_not(None)]
    if leave_out is not None:
        where.append(not_(and_(c.instance_id == leave_out[0], c.arrival_time >= leave_out[1])))
    stmt = (
        select(c.api_key_name, c.day_bucket, func.sum(c.cost_usd))
        .where(*where)
        .group_by(c.api_key_name, c.day_bucket)
    )
    out: dict[str, dict[str, float]] = {}
    for name, day, total in conn.execute(stmt):
        out.setdefault(name, {})[day] = float(total or 0.0)
    return out


def spend_since(days: dict[str, float] | None, start: datetime) -> float:
    """USD of a key's days (UTC day -> USD) from `start`'s day on: its spend in a period."""
    first = _day(start)
    return sum(v for d, v in days.items() if d >= first) if days else 0.0


@dataclass(frozen=True, slots=True)
class Use:
    """A table key's spend against its budget in the period holding `now`, from the rows."""

    budget: Budget
    spend_usd: float
    period_start: datetime
    resets_at: datetime

    @property
    def use(self) -> float:
        return use_of(self.spend_usd, self.budget.usd)


def budget_use(
    conn: Connection, now: datetime, names: Iterable[str] | None = None
) -> dict[str, Use]:
    """Every live (not revoked) table key with a budget (of `names`, default all): its spend
    in its current period, from every instance's request rows (what the whole fleet spent,
    once written). What `controlplane report requests --group-by api_key` shows; the daemon's
    own figure (BudgetTracker) is the same sum, its own spend counted as each request ends."""
    k = API_KEYS.c
    stmt = select(k.name, k.budget_usd, k.budget_period, k.budget_action).where(
        k.revoked_at.is_(None), k.budget_usd.is_not(None)
    )
    if names is not None:
        stmt = stmt.where(k.name.in_(sorted(names)))
    budgets = {r.name: b for r in conn.execute(stmt) if (b := budget_of(r)) is not None}
    if not budgets:
        return {}
    bounds = {name: period_bounds(b.period, now) for name, b in budgets.items()}
    days = spend_by_day(conn, budgets, min(start for start, _ in bounds.values()))
    out = {}
    for name, b in budgets.items():
        start, end = bounds[name]
        out[name] = Use(b, spend_since(days.get(name), start), start, end)
    return out


@dataclass(frozen=True, slots=True)
class Standing:
    """A key's spend against its budget in the current period."""

    key: str
    budget: Budget
    spend_usd: float
    period_start: datetime
    resets_at: datetime
    soft_threshold: float  # the share of the budget that raises the soft event

    @property
    def use(self) -> float:
        return use_of(self.spend_usd, self.budget.usd)

    @property
    def exhausted(self) -> bool:
        return self.spend_usd >= self.budget.usd

    @property
    def state(self) -> str:
        if self.exhausted:
            return EXHAUSTED
        return SOFT if self.spend_usd >= self.soft_threshold * self.budget.usd else "ok"

    def view(self) -> dict[str, object]:
        """What /admin/keys adds to a key's `budget`."""
        return {
            "spend_usd": round(self.spend_usd, 12),
            "use": None if math.isinf(self.use) else round(self.use, 6),
            "state": self.state,
            "period_start": self.period_start.isoformat(),
            "resets_at": self.resets_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class BudgetEvent:
    """A key crossed its soft threshold or its budget (once per key, period and amount)."""

    kind: str  # SOFT | EXHAUSTED
    standing: Standing

    def payload(self) -> dict[str, object]:
        """The /admin/events message (`type` budget)."""
        s = self.standing
        return {
            "type": "budget",
            "event": self.kind,
            "key": s.key,
            "budget_usd": s.budget.usd,
            "budget_period": s.budget.period,
            "budget_action": s.budget.action,
            "soft_threshold": s.soft_threshold,
            **s.view(),
        }

    def message(self) -> str:
        """The log line."""
        s = self.standing
        done = {"reject": "rejected", "deprioritize": "deprioritized"}[s.budget.action]
        what = (
            f"reached its budget: its further requests are {done}"
            if self.kind == EXHAUSTED
            else f"passed its soft threshold ({s.soft_threshold:.0%} of the budget)"
        )
        return (
            f"api key {s.key!r} {what}: spent {usd(s.spend_usd)} of {usd(s.budget.usd)} this "
            f"{s.budget.period} (resets at {s.resets_at.isoformat()})"
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """Admission's answer for a key at its budget."""

    action: str  # reject | deprioritize
    message: str
    retry_after_s: int  # seconds until the period resets


class BudgetTracker:
    """Each daemon's view of the budgeted keys' spend (see the module docstring).

    `load` (a worker thread) reads SQL; `spent`, `check` and `standing` run on the event loop.
    A lock guards the few dicts they share; `load` swaps in what it read whole."""

    def __init__(
        self,
        keys: KeyCache,
        instance_id: str,
        started_at: datetime,
        soft_threshold: Callable[[], float],
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.keys = keys
        self.clock = clock  # the periods' clock (a test's fixed time)
        self.instance_id = instance_id
        # This process's rows arrived at or after this: counted locally, left out of the read.
        self.started_at = started_at
        self.soft_threshold = soft_threshold
        # Called on the event loop with each new event (the runtime: log, SSE, metric).
        self.on_event: Callable[[BudgetEvent], None] | None = None
        self._lock = threading.Lock()
        self._fleet: dict[str, dict[str, float]] = {}  # key -> UTC day -> USD, as last read
        self._local: dict[str, dict[str, float]] = {}  # key -> UTC day -> USD, this process
        self._book: PriceBook | None = None
        self._unpriced: list[RequestRecord] = []
        # (key, event, period start, budget) already announced: once per period and amount.
        self._announced: set[tuple[str, str, datetime, float]] = set()
        self.loaded_at: datetime | None = None
        self.errors = 0

    # -- spend ----------------------------------------------------------------------------
    def _spend(self, key: str, start: datetime) -> float:
        return spend_since(self._fleet.get(key), start) + spend_since(self._local.get(key), start)

    def standing(self, name: str | None, now: datetime | None = None) -> Standing | None:
        """The key's spend against its budget now; None: no such live key, or no budget."""
        key = self.keys.key(name)
        budget = budget_of(key)
        if key is None or budget is None:
            return None
        now = now or self.clock()
        start, end = period_bounds(budget.period, now)
        with self._lock:
            spend = self._spend(key.name, start)
        return Standing(key.name, budget, spend, start, end, self.soft_threshold())

    def spent(self, rec: RequestRecord) -> None:
        """A request of this daemon ended (`rec` final): its list price counts at once. Every
        key's, budgeted or not, so that a budget set later in the period finds it (this
        process's rows are never read back)."""
        if rec.api_key_name is None or not rec.is_final:
            return
        with self._lock:
            if self._book is None:  # no price book read yet: priced at the next read
                self._unpriced.append(rec)
                del self._unpriced[:-MAX_UNPRICED]
                return
            self._add(rec)
        self._announce([rec.api_key_name])

    def _add(self, rec: RequestRecord) -> None:
        """(Lock held.) Price `rec` as the recorder does and count it on its arrival day."""
        assert self._book is not None and rec.api_key_name is not None
        arrival = rec.arrival_time.astimezone(UTC)
        price = self._book.lookup(rec.model, arrival)
        if price is None:
            return  # no price in force: the row's cost_usd is NULL too
        amount = cost(price, rec.prompt_tokens, rec.cached_prompt_tokens, rec.completion_tokens)
        days = self._local.setdefault(rec.api_key_name, {})
        days[_day(arrival)] = days.get(_day(arrival), 0.0) + amount

    # -- admission ------------------------------------------------------------------------
    def check(self, name: str | None, now: datetime | None = None) -> Verdict | None:
        """None: admit as usual. Otherwise the key is at its budget: what to do."""
        s = self.standing(name, now)
        if s is None or not s.exhausted:
            return None
        self._announce([s.key], now)  # a budget lowered below the spend: announced here
        now = now or self.clock()
        resets = s.resets_at.isoformat().replace("+00:00", "Z")
        message = (
            f"You exceeded your current quota: API key {s.key!r} has spent {usd(s.spend_usd)} "
            f"of its {usd(s.budget.usd)} budget for this {s.budget.period} (budget_usd, "
            f"budget_period {s.budget.period}); the budget resets at {resets}"
        )
        wait = max(1, math.ceil((s.resets_at - now).total_seconds()))
        return Verdict(s.budget.action, message, wait)

    # -- events ---------------------------------------------------------------------------
    def _events(self, names: Iterable[str], now: datetime | None = None) -> list[BudgetEvent]:
        """The events not announced yet for these keys (marked announced)."""
        out = []
        for name in names:
            s = self.standing(name, now)
            if s is None:
                continue
            kinds = [SOFT] if s.state == SOFT else [SOFT, EXHAUSTED] if s.exhausted else []
            for kind in kinds:
                mark = (s.key, kind, s.period_start, s.budget.usd)
                with self._lock:
                    if mark in self._announced:
                        continue
                    self._announced.add(mark)
                out.append(BudgetEvent(kind, s))
        return out

    def _announce(self, names: Iterable[str], now: datetime | None = None) -> None:
        for event in self._events(names, now):
            if self.on_event is not None:
                self.on_event(event)

    # -- the SQL read ---------------------------------------------------------------------
    def load(self, db: Engine, now: datetime | None = None) -> list[BudgetEvent]:
        """Read the budgeted keys' spend since the earliest of their period starts, by key and
        day, without this process's own rows; reload the price book and price what waited
        for it. Returns the events the new figures raise (the caller announces them: this
        runs in a worker thread, the announcements belong on the event loop)."""
        now = now or self.clock()
        budgets = {k.name: b for k in self.keys.live() if (b := budget_of(k)) is not None}
        month_start = period_bounds("month", now)[0]
        fleet: dict[str, dict[str, float]] = {}
        with db.connect() as conn:
            book = PriceBook.load(conn)
            if budgets:
                since = min(period_bounds(b.period, now)[0] for b in budgets.values())
                own = (self.instance_id, self.started_at)
                fleet = spend_by_day(conn, budgets, since, leave_out=own)
        first = _day(month_start)
        with self._lock:
            self._fleet, self._book = fleet, book
            waiting, self._unpriced = self._unpriced, []
            for rec in waiting:
                self._add(rec)
            # Days before this month are in no period any more.
            for days in self._local.values():
                for d in [d for d in days if d < first]:
                    del days[d]
            self._announced = {m for m in self._announced if m[2] >= month_start}
            self.loaded_at = now
        return self._events(budgets, now)

    async def refresh(self, db: Engine | None) -> None:
        if db is None:
            return
        try:
            events = await asyncio.to_thread(self.load, db)
        except Exception as exc:  # the last figures stay, local spend keeps counting
            self.errors += 1
            log.warning("budget spend not read (%s: %s)", type(exc).__name__, exc)
            return
        for event in events:
            if self.on_event is not None:
                self.on_event(event)

    async def run_forever(
        self, db: Callable[[], Engine | None], refresh_s: Callable[[], float]
    ) -> None:
        """Reads every `refresh_s()` seconds (the first read is the caller's: refresh)."""
        while True:
            await asyncio.sleep(refresh_s())
            await self.refresh(db())
