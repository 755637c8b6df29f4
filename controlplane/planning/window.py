"""A window of recorded requests: the rows of `requests` that arrived in [since, until), read as
plain `Recorded` values for a replay (and for the side-by-side figures of what was served).

What is left out, and why: rows still `running` (their tokens are not final), and rows without
a completion token (errors and aborts before one, prompt scoring): what they cost the engine
is not recorded well enough to drive again. Refused requests (429, 403) have no row at all:
the `refusals` table counts them. The window must hold one model's rows: a replay drives one
model, so several models are an error that lists them (pick one with `model`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import sqlalchemy as sa

from controlplane.store.models import RequestRow

# The most rows a window may hold unless told otherwise: a million requests replayed in real
# time is a day of 12 req/s; past that the simulator (not yet built) is the tool.
MAX_ROWS = 1_000_000
_BATCH = 10_000  # rows fetched per round trip (progress is reported per batch)


class PlanningError(Exception):
    """A window, a workload or a replay that cannot be made, with what to do instead (the CLI
    prints it and exits with status 2)."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """One request row, as a replay reads it."""

    id: str
    arrival: float  # epoch seconds
    key: str | None  # api_key_name
    status: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int  # summed over its n choices
    n: int
    max_tokens: int | None
    structured: str | None
    queue_time_s: float | None
    ttft_s: float | None
    mean_itl_s: float | None
    e2e_latency_s: float | None
    preemptions: int
    draft_tokens: int
    accepted_draft_tokens: int
    cost_usd: float | None


@dataclass(slots=True)
class Window:
    since: datetime
    until: datetime
    model: str
    rows: list[Recorded]
    skipped: dict[str, int] = field(default_factory=dict)  # why -> rows left out

    @property
    def span_s(self) -> float:
        """Seconds from the first arrival to the last (0 for one row)."""
        return self.rows[-1].arrival - self.rows[0].arrival if self.rows else 0.0


def read_window(
    db: sa.Engine,
    since: datetime,
    until: datetime,
    *,
    key: str | None = None,
    model: str | None = None,
    max_rows: int = MAX_ROWS,
    newest: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Window:
    """The requests that arrived in [since, until) (of `key`, of `model`), oldest first.
    PlanningError when the window is empty, holds several models and none was chosen, or holds
    more than `max_rows` rows (counted first: nothing is read then), unless `newest`: then the
    window starts at the newest `max_rows` rows' first arrival. `progress(read, total)` after
    each batch."""
    if until <= since:
        raise PlanningError(
            f"--until ({until.isoformat()}) must be after --since ({since.isoformat()})"
        )
    t = RequestRow.__table__
    where = [t.c.arrival_time >= since, t.c.arrival_time < until]
    if key is not None:
        where.append(t.c.api_key_name == key)
    who = f" of key {key!r}" if key is not None else ""
    span = (
        f"between {since.isoformat(timespec='seconds')} and {until.isoformat(timespec='seconds')}"
    )
    with db.connect() as conn:
        models = dict(
            conn.execute(
                sa.select(t.c.model, sa.func.count()).where(*where).group_by(t.c.model)
            ).all()
        )
        if not models:
            raise PlanningError(f"no request rows{who} arrived {span}: nothing to replay")
        if model is None:
            if len(models) > 1:
                listed = ", ".join(f"{m} ({n:,} rows)" for m, n in sorted(models.items()))
                raise PlanningError(
                    f"the window holds requests for {len(models)} models ({listed}): "
                    "a replay drives one; choose it with --model"
                )
            (model,) = models
        elif model not in models:
            listed = ", ".join(sorted(models))
            raise PlanningError(
                f"no rows of model {model!r}{who} {span}; the window holds: {listed}"
            )
        total = models[model]
        where.append(t.c.model == model)
        if total > max_rows and newest:
            # The newest max_rows: the window starts at the oldest of them (rows arriving in
            # the same microsecond at the cut come along: a few more than max_rows at most).
            since = conn.execute(
                sa.select(t.c.arrival_time)
                .where(*where)
                .order_by(t.c.arrival_time.desc())
                .offset(max_rows - 1)
                .limit(1)
            ).scalar_one()
            where[0] = t.c.arrival_time >= since
            total = conn.execute(sa.select(sa.func.count()).where(*where)).scalar_one()
            if since.tzinfo is None:  # SQLite hands back naive UTC
                since = since.replace(tzinfo=UTC)
        elif total > max_rows:
            raise PlanningError(
                f"the window holds {total:,} rows of {model}{who}, more than --max-rows "
                f"({max_rows:,}): narrow --since/--until or --key, or raise --max-rows"
            )
        query = sa.select(t).where(*where).order_by(t.c.arrival_time, t.c.id)
        rows: list[Recorded] = []
        skipped: dict[str, int] = {}
        result = conn.execution_options(yield_per=_BATCH).execute(query)
        for batch in result.partitions():
            for r in batch:
                why = _skip(r)
                if why is not None:
                    skipped[why] = skipped.get(why, 0) + 1
                    continue
                rows.append(_recorded(r))
            if progress is not None:
                progress(len(rows) + sum(skipped.values()), total)
    if not rows:
        reasons = ", ".join(f"{n:,} {why}" for why, n in skipped.items())
        raise PlanningError(f"no replayable request{who} {span} ({reasons})")
    return Window(since, until, model, rows, skipped)


def _skip(r: sa.Row) -> str | None:
    if r.status == "running":
        return "still running"
    if r.completion_tokens == 0:
        return "without a completion token (errors, aborts, scoring)"
    return None


def _recorded(r: sa.Row) -> Recorded:
    return Recorded(
        id=r.id,
        arrival=r.arrival_time.timestamp(),
        key=r.api_key_name,
        status=r.status,
        prompt_tokens=r.prompt_tokens,
        cached_prompt_tokens=r.cached_prompt_tokens,
        completion_tokens=r.completion_tokens,
        n=r.n or 1,
        max_tokens=r.max_tokens,
        structured=r.structured,
        queue_time_s=r.queue_time_s,
        ttft_s=r.ttft_s,
        mean_itl_s=r.mean_itl_s,
        e2e_latency_s=r.e2e_latency_s,
        preemptions=r.preemptions,
        draft_tokens=r.draft_tokens,
        accepted_draft_tokens=r.accepted_draft_tokens,
        cost_usd=r.cost_usd,
    )
