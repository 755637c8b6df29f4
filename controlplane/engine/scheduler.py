"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Each step: running sequences get their next token (decodes first, so a long prefill never
starves them), running prefills continue, then swapped-out and waiting requests are admitted
FCFS while the token budget, `max_num_seqs` and free KV blocks allow. When blocks run out the
most recently admitted sequence is preempted: recompute frees its blocks and requeues it at
the head; swap copies its blocks to host memory first (recompute if the swap space is full).

Prefix caching: a request admitted from the queue (new or recomputed) first takes the cached
blocks of its longest cached prefix and computes only the rest; a swapped-in one takes its
cached blocks instead of copying them back. The last token is always computed (its logits are
needed), so at most (tokens - 1) // block_size blocks come from the cache. After each step the
engine registers the blocks that became full (`cache_blocks`).

engine.scheduling_policy (live): fcfs is the order above; priority and fair order the prefill
work and pick preemption victims by engine/policy.py (decodes run first under every policy).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

from controlplane.engine.block_pool import BlockPool
from controlplane.engine.policy import Policy
from controlplane.engine.prompt_logprobs import cache_limit
from controlplane.engine.sequence import Sequence, SequenceStatus, chain_hashes, new_block_table
from controlplane.engine.settings import EngineSettings

if TYPE_CHECKING:
    from controlplane.engine.draft import DraftModel


def _num_tokens(seq: Sequence) -> int:
    return seq.num_tokens


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # single-token rows first, then prefill chunks
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Tokens the scheduled rows attend to once the step has run (each row's context after it):
    # the attention part of a step's cost (planning's cost model fits on it).
    num_context_tokens: int = 0

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
        # Prefix cache counters (tokens), cumulative: looked up at admission, found cached.
        self.num_cache_queries = 0
        self.num_cache_hits = 0
        self.draft: DraftModel | None = None  # speculative decoding's draft model, if loaded
        self.policy = Policy()  # priority and fair (fair's virtual times live across steps)

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
        self._free(seq)  # PENDING (an unforked choice): in no queue, holding nothing
        seq.status = SequenceStatus.FINISHED

    def _free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.release(seq.block_table)
            seq.block_table = new_block_table()
            seq.num_registered_blocks = 0
        if self.draft is not None:
            self.draft.release(seq)
        if seq.swap_table:
            self.swap_pool.release(seq.swap_table)
            seq.swap_table = []

    # -- blocks -------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new) // self.block_size)
        return max(0, total - len(seq.block_table)) + self._shared_tail(seq)

    def _shared_tail(self, seq: Sequence) -> int:
        """1 if the block the next token goes into is shared (the last partial block of a
        parallel-sampling fork): it is copied before this sequence writes to it."""
        j = seq.num_computed_tokens // self.block_size
        return int(j < len(seq.block_table) and self.pool.ref_counts[seq.block_table[j]] > 1)

    def _grow(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        if self._shared_tail(seq):
            j = seq.num_computed_tokens // self.block_size
            (copy,) = self.pool.allocate(1)
            out.copies.append((seq.block_table[j], copy))
            self.pool.release([seq.block_table[j]])
            seq.block_table[j] = copy
        need = self._blocks_needed(seq, num_new)
        if need:
            seq.block_table.extend(self.pool.allocate(need))

    # -- the prefix cache -------------------------------------------------------------------
    def _lookup(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Cached blocks for the longest cached prefix of seq's first `num_blocks` full blocks."""
        if not self.settings.enable_prefix_caching or num_blocks <= 0:
            return []
        chain_hashes(seq.token_ids, self.block_size, seq.block_hashes, seq.hash_root)
        return self.pool.lookup(seq.block_hashes[:num_blocks])

    def _cacheable_blocks(self, seq: Sequence) -> int:
        """Leading full blocks seq may take from the cache when (re)computing: not its last
        token's (its logits are needed), nor any whose prompt logprobs it must still compute."""
        blocks = (seq.num_tokens - 1) // self.block_size
        limit = cache_limit(seq)
        return blocks if limit is None else min(blocks, limit // self.block_size)

    def _count_hits(self, seq: Sequence, tokens: int) -> None:
        self.num_cache_hits += tokens
        if seq.metrics.num_preemptions == 0 and not seq.output_token_ids:
            # Billed at the cached price: prompt tokens its first pass did not compute.
            seq.metrics.num_cached_tokens += tokens

    def _inflight(self, prefills: list[Sequence]) -> dict[bytes, Sequence]:
        """Full blocks that running prefills are about to compute: hash -> the earliest
        admitted sequence computing it. `prefills`: the running sequences with more than one
        token to compute, in admission order."""
        inflight: dict[bytes, Sequence] = {}
        if self.settings.enable_prefix_caching:
            for seq in prefills:
                self._add_inflight(seq, inflight)
        return inflight

    def _add_inflight(self, seq: Sequence, inflight: dict[bytes, Sequence]) -> None:
        if seq.num_uncomputed > 1 and self.settings.enable_prefix_caching:
            chain_hashes(seq.token_ids, self.block_size, seq.block_hashes, seq.hash_root)
            for h in seq.block_hashes[seq.num_computed_tokens // self.block_size :]:
                inflight.setdefault(h, seq)

    def _waits(self, seq: Sequence, inflight: dict[bytes, Sequence]) -> bool:
        """Whether seq's next block is being computed by a sequence admitted before it: then
        seq waits for it rather than computing the same block in the same steps (a burst of
        requests with one system prompt computes it once, not once per request)."""
        bs = self.block_size
        j = seq.num_computed_tokens // bs
        if not inflight or seq.num_computed_tokens % bs or j >= (seq.num_tokens - 1) // bs:
            return False
        limit = cache_limit(seq)
        if limit is not None and (j + 1) * bs > limit:
            return False  # it needs this block's logits (prompt logprobs): it computes it
        chain_hashes(seq.token_ids, bs, seq.block_hashes, seq.hash_root)
        owner = inflight.get(seq.block_hashes[j])
        return owner is not None and owner is not seq

    def _late_hits(self, seq: Sequence) -> None:
        """A running prefill takes the blocks that others registered since it was admitted."""
        bs = self.block_size
        j = seq.num_computed_tokens // bs
        limit = self._cacheable_blocks(seq)
        if seq.num_computed_tokens % bs or j >= limit or seq.num_registered_blocks != j:
            return
        hits = self._lookup(seq, limit)[j:]
        for k, block in enumerate(hits):
            self.pool.take([block])
            if j + k < len(seq.block_table):  # its own block, allocated but not computed yet
                self.pool.release([seq.block_table[j + k]])
                seq.block_table[j + k] = block
            else:
                seq.block_table.append(block)
        seq.num_computed_tokens += len(hits) * bs
        seq.num_registered_blocks += len(hits)
        self._count_hits(seq, len(hits) * bs)

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past the next token's (speculative tokens rejected)."""
        keep = -(-(seq.num_computed_tokens + 1) // self.block_size)
        if len(seq.block_table) > keep:
            self.pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def cache_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that are full and computed (after a step): computed, or being
        computed by a step in flight, and their tokens known (a pending token's is not)."""
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if full <= seq.num_registered_blocks or not self.settings.enable_prefix_caching:
            return
        chain_hashes(seq.token_ids, self.block_size, seq.block_hashes, seq.hash_root)
        for j in range(seq.num_registered_blocks, full):
            self.pool.register(seq.block_table[j], seq.block_hashes[j])
        seq.num_registered_blocks = full

    def fork(self, seq: Sequence) -> list[Sequence]:
        """Choice 0 of a parallel-sampling request has its prompt computed: its pending
        choices start from the same state, holding its blocks by reference."""
        seq.forked = True
        children = [c for c in seq.group if c.status is SequenceStatus.PENDING]
        at = self.running.index(seq) + 1
        for child in children:
            child.token_ids = list(seq.token_ids)
            child.num_computed_tokens = seq.num_computed_tokens
            child.block_hashes = list(seq.block_hashes)
            child.num_registered_blocks = seq.num_registered_blocks
            child.block_table = new_block_table(seq.block_table)
            child.prompt_logprobs = seq.prompt_logprobs  # scored once, by choice 0
            self.pool.share(child.block_table)
            child.status = SequenceStatus.RUNNING
        self.running[at:at] = children
        return children

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed
        if remaining == 1 and budget > 0:
            # A decode, plus its draft tokens (speculative decoding) as far as the budget goes.
            del seq.draft_token_ids[budget - 1 :]
            return 1 + len(seq.draft_token_ids)
        return min(remaining, self.settings.prefill_chunk_size, budget)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.draft_token_ids, seq.draft_probs = [], None
        if self.draft is not None:
            self.draft.release(seq)  # it catches up when it speculates again
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        n = len(seq.block_table)
        if self.settings.preemption_mode == "swap" and n and self.swap_pool.can_allocate(n):
            host = self.swap_pool.allocate(n)
            out.swap_out += zip(seq.block_table, host, strict=True)
            self.pool.release(seq.block_table)
            seq.block_table, seq.swap_table = new_block_table(), host
            seq.num_registered_blocks = 0
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

        fcfs = s.scheduling_policy == "fcfs"
        if not fcfs:
            self.policy.begin_step(
                s.scheduling_policy, chain(self.running, self.waiting, self.swapped)
            )

        # A lowered max_num_seqs takes effect now, not when sequences happen to finish.
        while len(self.running) > s.max_num_seqs:
            self._preempt(self._victim(), out)
            preempted = True

        # Decodes before prefills: a decode needs one token, and max_num_batched_tokens >=
        # max_num_seqs guarantees they all fit.
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in self.running:
            (decodes if seq.num_uncomputed == 1 else prefills).append(seq)
        inflight = self._inflight(prefills)
        bs = self.block_size
        ref_counts = self.pool.ref_counts
        running = SequenceStatus.RUNNING
        for seq in decodes + prefills if prefills and fcfs else decodes:
            if seq.status is not running:
                continue  # preempted earlier in this loop
            if budget > 0 and not seq.draft_token_ids:
                # Fast path, most decodes: the next token's slot is in a block of its own
                # already (not a fork's shared one): one token, no block to allocate.
                table = seq.block_table
                j = seq.num_computed_tokens // bs
                if j < len(table) and ref_counts[table[j]] <= 1 and seq.num_uncomputed == 1:
                    chosen[seq] = 1
                    budget -= 1
                    continue
            if seq.num_uncomputed > 1 and self.settings.enable_prefix_caching:
                self._late_hits(seq)
                if self._waits(seq, inflight):
                    continue
            n = self._chunk(seq, budget)
            if n <= 0:
                break  # budget spent; only prefills come this late in `order`
            if n > 1 and seq.draft_token_ids and self._blocks_needed(seq, n) > self.pool.num_free:
                seq.draft_token_ids, n = [], 1  # drop the drafts before preempting anyone
            while self._blocks_needed(seq, n) > self.pool.num_free:
                victim = self._victim()
                budget += chosen.pop(victim, 0)  # charged to its tenant after this loop
                self._preempt(victim, out)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self._grow(seq, n, out)
            chosen[seq] = n
            budget -= n

        if not fcfs:
            for seq, n in chosen.items():
                self.policy.charge(seq, n)
            self._schedule_by_policy(prefills, out, chosen, budget, now, inflight, preempted)
        # Admit only when nobody was preempted this step, or we would thrash.
        elif not preempted:
            budget = self._admit_swapped(out, chosen, budget)
            for seq in list(self.waiting):
                if budget <= 0:
                    break
                if self.running and len(self.running) + seq.num_slots > s.max_num_seqs:
                    break
                admitted = self._admit_waiting(seq, out, chosen, budget, now, inflight)
                if admitted is None:
                    continue  # its next blocks are being computed: it may be overtaken
                if not admitted:
                    break  # FCFS: nobody overtakes the head of the queue for want of blocks
                budget -= chosen[seq]
                self._add_inflight(seq, inflight)

        # Single-token rows first, longest context first (stable: equal lengths keep their
        # order): attention buckets them by length.
        singles = [seq for seq, n in chosen.items() if n == 1]
        singles.sort(key=_num_tokens, reverse=True)
        scheduled = out.scheduled
        scheduled += [ScheduledSeq(seq, 1) for seq in singles]
        if len(singles) < len(chosen):
            scheduled += [ScheduledSeq(seq, n) for seq, n in chosen.items() if n > 1]
        decode_tokens = prefill_tokens = context_tokens = 0
        for item in scheduled:
            # A decode feeds back the token sampled last step; everything else is (re)prefill.
            seq = item.seq
            context_tokens += seq.num_computed_tokens + item.num_new_tokens
            if seq.output_token_ids and seq.num_uncomputed == 1:
                decode_tokens += item.num_new_tokens  # with any draft tokens
            else:
                prefill_tokens += item.num_new_tokens
        out.num_decode_tokens, out.num_prefill_tokens = decode_tokens, prefill_tokens
        out.num_context_tokens = context_tokens
        return out

    def _admit_waiting(
        self,
        seq: Sequence,
        out: SchedulerOutput,
        chosen: dict[Sequence, int],
        budget: int,
        now: float,
        inflight: dict[bytes, Sequence],
    ) -> bool | None:
        """Admit a waiting sequence if its blocks fit, after the cached prefix it reuses.
        None: not now, as a running sequence is computing its next block (admitted later, it
        finds that block cached instead of computing it a second time)."""
        bs = self.block_size
        hits = self._lookup(seq, self._cacheable_blocks(seq))
        cached = len(hits) * bs
        seq.num_computed_tokens = cached  # sizes the chunk; undone below if it does not fit
        if self._waits(seq, inflight):
            seq.num_computed_tokens = 0
            return None
        n = self._chunk(seq, budget)
        need = -(-(cached + n) // bs) - len(hits) + self.pool.num_unheld(hits)
        if need > self.pool.num_free:
            seq.num_computed_tokens = 0
            return False
        self.waiting.remove(seq)
        self.pool.take(hits)
        seq.block_table, seq.num_registered_blocks = new_block_table(hits), len(hits)
        if self.settings.enable_prefix_caching:
            self.num_cache_queries += seq.num_tokens
            self._count_hits(seq, cached)
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = now
        self._grow(seq, n, out)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        chosen[seq] = n
        return True

    def _admit_swapped(self, out: SchedulerOutput, chosen: dict[Sequence, int], budget: int) -> int:
        """Swapped-out sequences were admitted before anything waiting: they go first."""
        while self.swapped and self._swap_in(self.swapped[0], out, chosen, budget):
            budget -= chosen[self.running[-1]]
        return budget

    def _swap_in(
        self, seq: Sequence, out: SchedulerOutput, chosen: dict[Sequence, int], budget: int
    ) -> bool:
        """Bring a swapped-out sequence back if a slot and its blocks are free. Blocks still
        in the prefix cache are taken from it rather than copied back."""
        bs = self.block_size
        if self.running and len(self.running) + seq.num_slots > self.settings.max_num_seqs:
            return False
        n = self._chunk(seq, budget)
        if n <= 0:
            return False
        held = len(seq.swap_table)
        full = min(seq.num_computed_tokens // bs, (seq.num_tokens - 1) // bs)
        hits = self._lookup(seq, full)
        k = len(hits)
        grow = max(0, -(-(seq.num_computed_tokens + n) // bs) - held)
        if held - k + self.pool.num_unheld(hits) + grow > self.pool.num_free:
            return False
        self.swapped.remove(seq)
        self.pool.take(hits)
        device = self.pool.allocate(held - k)
        out.swap_in += zip(seq.swap_table[k:], device, strict=True)
        self.swap_pool.release(seq.swap_table)
        seq.block_table, seq.swap_table = new_block_table(hits + device), []
        seq.num_registered_blocks = k
        self._grow(seq, n, out)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        chosen[seq] = n
        return True

    # -- priority and fair (engine/policy.py) ---------------------------------------------------
    def _victim(self, spare: set[Sequence] | None = None) -> Sequence:
        """The running sequence preempted first: fcfs, the last admitted; else the policy's,
        sparing those admitted this step (`spare`: a sequence swapped in and out in one step
        would copy out blocks the swap-in has not filled yet)."""
        if self.settings.scheduling_policy == "fcfs":
            return self.running[-1]
        pool = [s for s in self.running if s not in spare] if spare else self.running
        return self.policy.victim(pool or self.running)

    def _unchoose(self, seq: Sequence, chosen: dict[Sequence, int]) -> int:
        """Take a sequence about to be preempted out of this step (priority and fair): the
        tokens it gave back."""
        n = chosen.pop(seq, 0)
        if n:
            self.policy.charge(seq, -n)  # charged when it was chosen (a no-op unless fair)
        return n

    def _schedule_by_policy(
        self,
        prefills: list[Sequence],
        out: SchedulerOutput,
        chosen: dict[Sequence, int],
        budget: int,
        now: float,
        inflight: dict[bytes, Sequence],
        preempted: bool,
    ) -> None:
        """The prefill work (running prefills, swapped-out and waiting requests) in the
        policy's order, after the decodes. A running prefill grows as under fcfs (preempting
        the policy's victim for blocks); a swapped or waiting one is admitted when it fits or
        when the policy lets it displace a running sequence, and is skipped after a KV-pressure
        preemption this step (it would thrash)."""
        s = self.settings
        running = SequenceStatus.RUNNING
        picker = self.policy.picker([*prefills, *self.swapped, *self.waiting])
        evicted: set[Sequence] = set()  # preempted this step: not re-admitted in it
        fresh: set[Sequence] = set()  # admitted this step: not preempted in it
        while budget > 0 and (seq := picker.next()) is not None:
            if seq in evicted:
                continue
            if seq.status is running:
                if s.enable_prefix_caching:
                    self._late_hits(seq)
                    if self._waits(seq, inflight):
                        continue
                n = self._chunk(seq, budget)
                while self._blocks_needed(seq, n) > self.pool.num_free:
                    victim = self._victim(fresh - {seq})
                    budget += self._unchoose(victim, chosen)
                    self._preempt(victim, out)
                    evicted.add(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status is not running:
                    continue
                self._grow(seq, n, out)
                chosen[seq] = n
            elif preempted:
                continue
            else:
                budget += self._displace(seq, budget, out, chosen, evicted, fresh)
                if seq.status is SequenceStatus.SWAPPED:
                    admitted = self._swap_in(seq, out, chosen, budget)
                elif self.running and len(self.running) + seq.num_slots > s.max_num_seqs:
                    admitted = False
                else:
                    admitted = self._admit_waiting(seq, out, chosen, budget, now, inflight)
                if admitted is None:
                    continue  # its next blocks are being computed: it may be overtaken
                if not admitted:
                    picker.blocked(seq)
                    continue
                self._add_inflight(seq, inflight)
                fresh.add(seq)
            budget -= chosen[seq]
            self.policy.charge(seq, chosen[seq])

    def _displace(
        self,
        seq: Sequence,
        budget: int,
        out: SchedulerOutput,
        chosen: dict[Sequence, int],
        evicted: set[Sequence],
        fresh: set[Sequence],
    ) -> int:
        """Preempt the running sequences the policy lets `seq` (swapped or waiting) take a
        slot or KV blocks from, while it lacks either. Blocks are estimated without prefix
        cache hits (an over-estimate: at most one chunk's blocks). Returns the tokens the
        victims gave back to the step's budget."""
        s = self.settings
        bs = self.block_size
        first = min(seq.num_uncomputed, s.prefill_chunk_size, budget)
        need_blocks = len(seq.swap_table) + -(-(seq.num_computed_tokens + first) // bs)
        if seq.status is SequenceStatus.SWAPPED:
            need_blocks -= -(-seq.num_computed_tokens // bs)
        refund = 0
        while True:
            others = [r for r in self.running if r not in fresh]
            if self.running and len(self.running) + seq.num_slots > s.max_num_seqs:
                victim = self.policy.displaces(seq, others, "slots", seq.num_slots)
            elif need_blocks > self.pool.num_free:
                held = -(-seq.num_tokens // bs)
                victim = self.policy.displaces(seq, others, "blocks", held)
            else:
                return refund
            if victim is None:
                return refund
            refund += self._unchoose(victim, chosen)
            self._preempt(victim, out)
            evicted.add(victim)
