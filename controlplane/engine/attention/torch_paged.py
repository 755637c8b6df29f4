"""Paged attention in pure PyTorch: the backend that runs anywhere (SDPA over gathered blocks),
and the one the others are checked against."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from controlplane.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    PrefillSpan,
    SeqSpan,
    padded_block_table,
)
from controlplane.engine.transfer import host_tensor, to_device


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows of similar context length, padded to the longest of them."""

    start: int  # first row in the flat batch
    end: int
    blocks: torch.Tensor  # [rows * max_blocks] block ids (padded with block 0)
    mask: torch.Tensor  # [rows, 1, 1, max_blocks * block_size] True = attend


class TorchPagedAttention(AttentionBackend):
    """Gathers whole blocks (index_select of contiguous block_size x Hkv x D chunks, 5x faster
    here than per-slot indexing) and folds the query heads of each KV group into the query
    length, so SDPA needs no GQA expansion and takes its fast path."""

    # A bucket closes when the next row's context is shorter than this fraction of the
    # bucket's longest: padding then wastes at most ~1/BUCKET_RATIO of the gathered K/V, for a
    # few more kernel calls. Decode attention is memory-bound, so bytes are what count.
    BUCKET_RATIO = 0.7

    def prepare(self, spans: list[SeqSpan], device: torch.device) -> AttentionMetadata:
        bs = self.block_size
        slot_mapping = array("q")
        add_slot = slot_mapping.append
        decode_rows = 0
        for span in spans:
            table, ctx, n = span.block_table, span.context_len, span.num_new_tokens
            if n == 1:  # a decode: its one new slot
                add_slot(table[(ctx - 1) // bs] * bs + (ctx - 1) % bs)
                decode_rows += 1
            else:
                slot_mapping.extend([table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)])
        meta = AttentionMetadata(slot_mapping=to_device(slot_mapping, device))
        meta.decodes = self._decode_buckets(spans[:decode_rows], device)
        row = decode_rows
        for span in spans[decode_rows:]:
            q_len, ctx = span.num_new_tokens, span.context_len
            if ctx == q_len:
                meta.prefills.append(PrefillSpan(row, row + q_len, ctx, None, None))
            else:
                blocks_t = to_device(span.block_table[: -(-ctx // bs)], device)
                # Row i sits at position ctx - q_len + i and sees keys 0..that position.
                q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
                mask = torch.arange(ctx).unsqueeze(0) <= q_pos
                meta.prefills.append(
                    PrefillSpan(
                        row, row + q_len, ctx, blocks_t, to_device(mask, device, torch.bool)
                    )
                )
            row += q_len
        return meta

    def _decode_buckets(self, spans: list[SeqSpan], device: torch.device) -> list[Any]:
        """The decode rows' metadata (`spans`: the step's single-token sequences, longest
        context first), as `_decode` takes it."""
        buckets = []
        start = 0
        ratio = self.BUCKET_RATIO
        while start < len(spans):
            floor = ratio * spans[start].context_len
            end = start + 1
            while end < len(spans) and spans[end].context_len >= floor:
                end += 1
            buckets.append(self._bucket(spans, start, end, device))
            start = end
        return buckets

    def _bucket(
        self, spans: list[SeqSpan], start: int, end: int, device: torch.device
    ) -> DecodeBucket:
        part = spans[start:end]
        tables = padded_block_table(part, self.block_size, device)
        lens = host_tensor([s.context_len for s in part], torch.long)
        mask = torch.arange(tables.shape[1] * self.block_size).unsqueeze(0) < lens.unsqueeze(1)
        return DecodeBucket(
            start, end, tables.flatten(), to_device(mask[:, None, None, :], device, torch.bool)
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        self.kv.write(layer, meta.slot_mapping, k, v)
        if not meta.prefills and len(meta.decodes) == 1:
            # A decode-only step in one bucket (every batch-1 step): its output is the whole
            # result, with no buffer to allocate and copy into.
            return self._decode(layer, q, meta.decodes[0])
        out = torch.empty_like(q)
        for b in meta.decodes:
            out[b.start : b.end] = self._decode(layer, q[b.start : b.end], b)
        for p in meta.prefills:
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            if p.context_blocks is None:
                kp = self.kv.as_stored(k[p.start : p.end]).transpose(0, 1).unsqueeze(0)
                vp = self.kv.as_stored(v[p.start : p.end]).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                ctx = p.context_len
                kp, vp = self.kv.read_blocks(layer, p.context_blocks, q.dtype)
                kp = kp[:ctx].transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
                vp = vp[:ctx].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode(self, layer: int, q: torch.Tensor, b: Any) -> torch.Tensor:
        """One bucket's rows q [n, H, D]: a KV group's heads act as `group` query rows of one
        SDPA over that group's gathered K/V ([n, Hkv, L, D])."""
        n, num_heads, head_dim = q.shape
        kd, vd = self.kv.read_blocks(layer, b.blocks, q.dtype)
        kv_heads = kd.shape[1]
        kd = kd.view(n, -1, kv_heads, head_dim).transpose(1, 2)
        vd = vd.view(n, -1, kv_heads, head_dim).transpose(1, 2)
        qd = q.view(n, kv_heads, num_heads // kv_heads, head_dim)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=b.mask)
        return o.reshape(n, num_heads, head_dim)
