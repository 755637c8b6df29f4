"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Each step: running sequences get their next token (decodes first, so a long prefill never
starves them), running prefills continue, then swapped-out and waiting requests are admitted
FCFS while the token budget, `max_num_seqs` and free KV blocks allow. When blocks run out the
most recently admitted sequence is preempted: recompute frees its blocks and requeues it at
the head; swap copies its blocks to host memory first (recompute if the swap space is full).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from controlplane.engine.block_pool import BlockPool
from controlplane.engine.sequence import Sequence, SequenceStatus
from controlplane.engine.settings import EngineSettings


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # single-token rows first, then prefill chunks
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, settings: EngineSettings, pool: BlockPool, swap_pool: BlockPool, block_size: int
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.swap_pool = swap_pool
        self.block_size = block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0

    # -- queues -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED

    def _free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.release(seq.block_table)
            seq.block_table = []
        if seq.swap_table:
            self.swap_pool.release(seq.swap_table)
            seq.swap_table = []

    # -- blocks -------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new) // self.block_size)
        return max(0, total - len(seq.block_table))

    def _grow(self, seq: Sequence, num_new: int) -> None:
        need = self._blocks_needed(seq, num_new)
        if need:
            seq.block_table += self.pool.allocate(need)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed
        return (
            1
            if remaining == 1 and budget > 0
            else min(remaining, self.settings.prefill_chunk_size, budget)
        )

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        n = len(seq.block_table)
        if self.settings.preemption_mode == "swap" and n and self.swap_pool.can_allocate(n):
            host = self.swap_pool.allocate(n)
            out.swap_out += zip(seq.block_table, host, strict=True)
            self.pool.release(seq.block_table)
            seq.block_table, seq.swap_table = [], host
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
        else:
            # Recompute: drop the KV; it re-prefills prompt + generated tokens later.
            self._free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    # -- the step -----------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        s = self.settings
        out = SchedulerOutput(scheduled=[])
        budget = s.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}
        preempted = False

        # A lowered max_num_seqs takes effect now, not when sequences happen to finish.
        while len(self.running) > s.max_num_seqs:
            self._preempt(self.running[-1], out)
            preempted = True

        # Decodes before prefills: a decode needs one token, and max_num_batched_tokens >=
        # max_num_seqs guarantees they all fit.
        order = sorted(self.running, key=lambda q: q.num_uncomputed != 1)
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget)
            if n <= 0:
                break  # budget spent; only prefills come this late in `order`
            while self._blocks_needed(seq, n) > self.pool.num_free:
                victim = self.running[-1]
                budget += chosen.pop(victim, 0)
                self._preempt(victim, out)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self._grow(seq, n)
            chosen[seq] = n
            budget -= n

        # Admit only when nobody was preempted this step, or we would thrash.
        if not preempted:
            budget = self._admit_swapped(out, chosen, budget)
            while self.waiting and len(self.running) < s.max_num_seqs and budget > 0:
                seq = self.waiting[0]
                n = self._chunk(seq, budget)
                if self._blocks_needed(seq, n) > self.pool.num_free:
                    break  # FCFS: nobody overtakes the head of the queue
                self.waiting.popleft()
                self._grow(seq, n)
                seq.status = SequenceStatus.RUNNING
                if seq.metrics.first_scheduled_time is None:
                    seq.metrics.first_scheduled_time = now
                self.running.append(seq)
                chosen[seq] = n
                budget -= n

        # Single-token rows first, longest context first: attention buckets them by length.
        singles = sorted((seq for seq, n in chosen.items() if n == 1), key=lambda q: -q.num_tokens)
        out.scheduled += [ScheduledSeq(seq, 1) for seq in singles]
        for seq, n in chosen.items():
            if n > 1:
                out.scheduled.append(ScheduledSeq(seq, n))
        for item in out.scheduled:
            # A decode feeds back the token sampled last step; everything else is (re)prefill.
            if item.seq.output_token_ids and item.seq.num_uncomputed == 1:
                out.num_decode_tokens += 1
            else:
                out.num_prefill_tokens += item.num_new_tokens
        return out

    def _admit_swapped(self, out: SchedulerOutput, chosen: dict[Sequence, int], budget: int) -> int:
        """Swapped-out sequences were admitted before anything waiting: they go first."""
        s = self.settings
        while self.swapped and len(self.running) < s.max_num_seqs:
            seq = self.swapped[0]
            n = self._chunk(seq, budget)
            if n <= 0:
                break
            held = len(seq.swap_table)
            if -(-(seq.num_computed_tokens + n) // self.block_size) > self.pool.num_free:
                break
            self.swapped.popleft()
            device = self.pool.allocate(held)
            out.swap_in += zip(seq.swap_table, device, strict=True)
            self.swap_pool.release(seq.swap_table)
            seq.block_table, seq.swap_table = device, []
            self._grow(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen[seq] = n
            budget -= n
        return budget
