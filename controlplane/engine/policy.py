"""Scheduling policies (engine.scheduling_policy): who gets a step's prefill tokens and batch
slots first, and who is preempted first.

Decodes are never reordered: every running sequence's next token is scheduled each step
(max_num_batched_tokens >= max_num_seqs). A policy orders the rest, the prefill work: running
prefills, swapped-out and waiting requests, and picks the victims of preemption.

- fcfs: arrival order; the last admitted is preempted first (Scheduler's own loop: this module
  is not consulted, so fcfs costs nothing).
- priority: rank = (priority class, request priority, arrival), strict: nobody overtakes a head
  that cannot be placed; a waiting request may preempt a running one of a strictly lower rank
  (vLLM's priority scheduling).
- fair: classes are strict tiers; inside a class, the tenants (API keys) share the step's
  tokens equally by weighted fair queuing: each tenant's virtual time is the tokens scheduled
  for it (decodes included, every choice of an n > 1 request), and the next candidate is the
  head of the tenant with the least. A tenant becoming active starts at the least virtual time
  among the active ones (no credit banked while idle). A tenant whose head cannot be placed
  stops for the step; the others go on. A waiting request may preempt a running one of a
  tenant holding more slots (or KV blocks) than its own tenant would after admission, so a
  tenant holding every slot gives them up down to an equal share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

from controlplane.engine.sequence import Sequence

Measure = Literal["slots", "blocks"]


def tenant_of(seq: Sequence) -> str:
    return seq.params.tenant or ""


def rank(seq: Sequence) -> tuple[int, int, float]:
    """Lower runs sooner: priority class, the request's priority, then arrival."""
    p = seq.params
    return (p.priority_class, p.priority, seq.metrics.arrival_time)


class Picker:
    """One step's prefill candidates in policy order: `next()` the next one, `blocked(seq)`
    when it could not be placed."""

    def next(self) -> Sequence | None:
        raise NotImplementedError

    def blocked(self, seq: Sequence) -> None:
        raise NotImplementedError


class _RankPicker(Picker):
    """priority: one order; a head that cannot be placed stops admission for the step."""

    def __init__(self, candidates: list[Sequence]) -> None:
        self._order = sorted(candidates, key=rank, reverse=True)  # popped from the end
        self._stopped = False

    def next(self) -> Sequence | None:
        return None if self._stopped or not self._order else self._order.pop()

    def blocked(self, seq: Sequence) -> None:
        self._stopped = True


class _FairPicker(Picker):
    def __init__(self, candidates: list[Sequence], served: dict[str, float]) -> None:
        queues: dict[str, list[Sequence]] = {}
        for seq in candidates:
            queues.setdefault(tenant_of(seq), []).append(seq)
        for q in queues.values():
            q.sort(key=rank, reverse=True)  # popped from the end
        self._queues = queues
        self._served = served  # live: charges made during the step reorder the rest of it

    def next(self) -> Sequence | None:
        best: tuple | None = None
        for t, q in self._queues.items():
            head = q[-1]
            key = (head.params.priority_class, self._served.get(t, 0.0), rank(head))
            if best is None or key < best[0]:
                best = (key, t)
        if best is None:
            return None
        q = self._queues[best[1]]
        seq = q.pop()
        if not q:
            del self._queues[best[1]]
        return seq

    def blocked(self, seq: Sequence) -> None:
        self._queues.pop(tenant_of(seq), None)


class Policy:
    """priority or fair (fcfs never gets here). Holds fair's virtual times across steps."""

    def __init__(self) -> None:
        self.name = "priority"
        self.served: dict[str, float] = {}  # tenant -> tokens scheduled (fair's virtual time)
        self._active: set[str] = set()

    # -- fair's virtual time ---------------------------------------------------------------
    def begin_step(self, name: str, live: Iterable[Sequence]) -> None:
        self.name = name
        if name != "fair":
            return
        tenants = {tenant_of(seq) for seq in live}
        still = [self.served[t] for t in tenants & self._active if t in self.served]
        if still:
            floor = min(still)
            for t in tenants - self._active:
                self.served[t] = max(self.served.get(t, floor), floor)
            # An idle tenant at or below the floor would be lifted to it on return: forget it
            # (the table stays as small as the set of tenants that used more than the rest).
            for t in [t for t, v in self.served.items() if t not in tenants and v <= floor]:
                del self.served[t]
        self._active = tenants

    def charge(self, seq: Sequence, tokens: int) -> None:
        if self.name == "fair":
            t = tenant_of(seq)
            self.served[t] = self.served.get(t, 0.0) + tokens

    # -- order -----------------------------------------------------------------------------
    def picker(self, candidates: list[Sequence]) -> Picker:
        if self.name == "fair":
            return _FairPicker(candidates, self.served)
        return _RankPicker(candidates)

    # -- preemption --------------------------------------------------------------------------
    def victim(self, running: list[Sequence]) -> Sequence:
        """The running sequence to preempt under KV pressure: the lowest class first; then,
        under fair, from the tenant holding the most KV blocks (equal shares: the one most
        over its share); then the lowest rank, the last admitted among equals."""
        worst_class = max(seq.params.priority_class for seq in running)
        pool = [seq for seq in running if seq.params.priority_class == worst_class]
        if self.name == "fair":
            held = _held(pool, _blocks)
            top = max(held.values())
            pool = [seq for seq in pool if held[tenant_of(seq)] == top]
        return max(reversed(pool), key=rank)  # reversed: the last admitted wins ties

    def displaces(
        self,
        seq: Sequence,
        running: list[Sequence],
        measure: Measure,
        need: int,
    ) -> Sequence | None:
        """A running sequence that `seq` (waiting, `need` slots or blocks short) may preempt
        to be admitted, or None. priority: one of a strictly lower priority. fair: one of a
        lower class, or of a tenant that would still hold more than seq's tenant after it."""
        if not running:
            return None
        if self.name != "fair":
            v = max(reversed(running), key=rank)
            return v if rank(v)[:2] > rank(seq)[:2] else None

        lower = [s for s in running if s.params.priority_class > seq.params.priority_class]
        if lower:
            return self.victim(lower)
        same = [s for s in running if s.params.priority_class == seq.params.priority_class]
        if not same:
            return None
        held = _held(same, _one if measure == "slots" else _blocks)
        mine = held.get(tenant_of(seq), 0)
        richest = max(held, key=lambda t: held[t])
        if richest == tenant_of(seq) or held[richest] <= mine + need:
            return None  # taking from it would only move the imbalance (and thrash)
        return max(reversed([s for s in same if tenant_of(s) == richest]), key=rank)


def _one(seq: Sequence) -> int:
    return 1


def _blocks(seq: Sequence) -> int:
    return len(seq.block_table)


def _held(seqs: list[Sequence], size: Callable[[Sequence], int]) -> dict[str, int]:
    held: dict[str, int] = {}
    for s in seqs:
        t = tenant_of(s)
        held[t] = held.get(t, 0) + size(s)
    return held
