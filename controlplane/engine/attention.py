"""Paged attention over a ragged batch.

`AttentionBackend` is the seam a GPU kernel plugs into: `prepare` turns the step's layout
(which sequence contributes which rows, with which block table) into whatever metadata the
kernel wants, once per step; `forward` runs one layer. `TorchPagedAttention` is the pure
PyTorch implementation that runs anywhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from controlplane.engine.kv_cache import KVCache


@dataclass(slots=True)
class SeqSpan:
    """One sequence's share of the flat batch."""

    num_new_tokens: int  # rows this sequence has in the batch (chunk length, or 1 for a decode)
    context_len: int  # tokens it attends to after this step, the new ones included
    block_table: list[int]


@dataclass(slots=True)
class PrefillSpan:
    start: int  # first row in the flat batch
    end: int
    context_len: int
    context_slots: torch.Tensor | None  # [context_len]; None when the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, context_len] bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each row's new K/V
    num_decode_rows: int  # the first rows are single-query sequences (decodes)
    decode_slots: torch.Tensor | None = None  # [Nd, L] slots each decode row attends to (padded)
    decode_mask: torch.Tensor | None = None  # [Nd, 1, 1, L] bool, True = attend
    prefills: list[PrefillSpan] = field(default_factory=list)


class AttentionBackend(ABC):
    def __init__(self, kv_cache: KVCache) -> None:
        self.kv = kv_cache
        self.block_size = kv_cache.spec.block_size

    @abstractmethod
    def prepare(self, spans: list[SeqSpan], device: torch.device) -> AttentionMetadata:
        """Build per-step metadata; spans must list single-token sequences first."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] for the new rows; returns [T, H, D]."""


class TorchPagedAttention(AttentionBackend):
    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, spans: list[SeqSpan], device: torch.device) -> AttentionMetadata:
        bs = self.block_size
        slot_mapping: list[int] = []
        decode_rows = 0
        for span in spans:
            slot_mapping += self._slots(
                span.block_table, span.context_len - span.num_new_tokens, span.context_len
            )
            if span.num_new_tokens == 1:
                decode_rows += 1
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            num_decode_rows=decode_rows,
        )
        decodes = spans[:decode_rows]
        if decodes:
            # Gather whole blocks: [Nd, max_blocks] block ids -> [Nd, max_blocks * bs] slots.
            max_blocks = max((s.context_len + bs - 1) // bs for s in decodes)
            table = torch.tensor(
                [
                    s.block_table[:max_blocks]
                    + [0] * (max_blocks - len(s.block_table[:max_blocks]))
                    for s in decodes
                ],
                dtype=torch.long,
            )
            offsets = torch.arange(bs, dtype=torch.long)
            slots = (table.unsqueeze(-1) * bs + offsets).view(len(decodes), max_blocks * bs)
            lens = torch.tensor([s.context_len for s in decodes], dtype=torch.long)
            mask = torch.arange(max_blocks * bs).unsqueeze(0) < lens.unsqueeze(1)
            meta.decode_slots = slots.to(device)
            meta.decode_mask = mask[:, None, None, :].to(device)
        row = decode_rows
        for span in spans[decode_rows:]:
            q_len, ctx = span.num_new_tokens, span.context_len
            if ctx == q_len:
                meta.prefills.append(PrefillSpan(row, row + q_len, ctx, None, None))
            else:
                slots_t = torch.tensor(self._slots(span.block_table, 0, ctx), dtype=torch.long)
                # Row i sits at position ctx - q_len + i and sees keys 0..that position.
                q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
                mask = torch.arange(ctx).unsqueeze(0) <= q_pos
                meta.prefills.append(
                    PrefillSpan(row, row + q_len, ctx, slots_t.to(device), mask.to(device))
                )
            row += q_len
        return meta

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decode_rows
        if nd:
            # q: [Nd, H, 1, D]; k/v: [Nd, Hkv, L, D]
            kd = k_cache[meta.decode_slots].transpose(1, 2)
            vd = v_cache[meta.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, enable_gqa=True
            )
            out[:nd] = o.squeeze(2)
        for p in meta.prefills:
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            if p.context_slots is None:
                kp = k[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, q_len, D]
                vp = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                kp = k_cache[p.context_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
                vp = v_cache[p.context_slots].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        return out
