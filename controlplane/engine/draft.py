"""The draft model of speculative decoding: a small model with its own paged KV cache.

Each step, for the sequences that speculate (batched): the draft first catches up on the
tokens it has not seen (the last token, plus any accepted since; a whole prompt after a
fork or a preemption), which yields its first proposal, then runs k - 1 single-token steps.
It samples each proposal from its own distribution q (greedy requests: its argmax) and keeps
q for the verification's acceptance rule. After verification the engine rolls the draft's
KV back with the target's (`rollback`).
"""

from __future__ import annotations

import torch

from controlplane.engine.attention.backend import SeqSpan
from controlplane.engine.attention.torch_paged import TorchPagedAttention
from controlplane.engine.block_pool import BlockPool
from controlplane.engine.kv_cache import KVCache
from controlplane.engine.model.llama import CausalLM
from controlplane.engine.sampler import argmax_rows, draw, filter_probs
from controlplane.engine.sequence import Sequence, new_block_table
from controlplane.engine.transfer import to_device


class DraftModel:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv = kv_cache
        self.backend = TorchPagedAttention(kv_cache)
        self.pool = BlockPool(kv_cache.num_blocks)
        self.pool.enable_caching = False
        self.block_size = kv_cache.spec.block_size
        self.device = device

    def release(self, seq: Sequence) -> None:
        """Forget seq's draft KV (finished, preempted or aborted)."""
        if seq.draft_block_table:
            self.pool.release(seq.draft_block_table)
            seq.draft_block_table = new_block_table()
        seq.draft_num_computed = 0

    def rollback(self, seq: Sequence) -> None:
        """After verification: the draft's KV is valid up to the last token it saw that was
        kept; blocks past the next token's are released."""
        seq.draft_num_computed = min(seq.draft_num_computed, seq.num_tokens - 1)
        keep = -(-(seq.draft_num_computed + 1) // self.block_size)
        if len(seq.draft_block_table) > keep:
            self.pool.release(seq.draft_block_table[keep:])
            del seq.draft_block_table[keep:]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], generator: torch.Generator) -> None:
        """Set draft_token_ids (k each, fewer where the draft cache is full) and draft_probs."""
        live: list[tuple[Sequence, int]] = []
        for seq, k in zip(seqs, ks, strict=True):
            # Positions fed: everything not yet seen, then k - 1 proposals.
            need = -(-(seq.num_tokens + k - 1) // self.block_size) - len(seq.draft_block_table)
            if need > self.pool.num_free:
                self.release(seq)  # make room for the others; it catches up another time
                continue
            if need > 0:
                seq.draft_block_table.extend(self.pool.allocate(need))
            seq.draft_token_ids = []
            seq.draft_probs = None
            live.append((seq, k))
        if not live:
            return
        probs: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq, _ in live}
        # Round 0: catch up (the rows end at each sequence's last token).
        feeds = [(seq, seq.token_ids[seq.draft_num_computed :]) for seq, _ in live]
        self._forward_and_sample(feeds, probs, generator)
        for r in range(1, max(k for _, k in live)):
            feeds = [(seq, seq.draft_token_ids[-1:]) for seq, k in live if k > r]
            self._forward_and_sample(feeds, probs, generator)
        for seq, _ in live:
            if not seq.params.greedy:
                seq.draft_probs = torch.stack(probs[seq])

    def _forward_and_sample(
        self,
        feeds: list[tuple[Sequence, list[int]]],
        probs: dict[Sequence, list[torch.Tensor]],
        generator: torch.Generator,
    ) -> None:
        # The attention backend wants single-token rows first, longest context first.
        feeds.sort(key=lambda f: (len(f[1]) != 1, -(f[0].draft_num_computed + len(f[1]))))
        input_ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        rows: list[int] = []
        for seq, tokens in feeds:
            start = seq.draft_num_computed
            input_ids += tokens
            positions += range(start, start + len(tokens))
            spans.append(SeqSpan(len(tokens), start + len(tokens), seq.draft_block_table))
            rows.append(len(input_ids) - 1)
            seq.draft_num_computed = start + len(tokens)
        dev = self.device
        logits = self.model(
            to_device(input_ids, dev),
            to_device(positions, dev),
            self.backend,
            self.backend.prepare(spans, dev),
            to_device(rows, dev),
        )
        best = argmax_rows(logits).tolist()
        for i, (seq, _) in enumerate(feeds):
            if seq.params.greedy:
                seq.draft_token_ids.append(best[i])
                continue
            q = filter_probs(logits[i : i + 1], [seq.params])[0]
            gen = seq.generator or generator
            seq.draft_token_ids.append(draw(q, gen))
            probs[seq].append(q)
