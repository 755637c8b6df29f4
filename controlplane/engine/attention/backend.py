"""Paged attention over a ragged batch.

`AttentionBackend` is the seam a GPU kernel plugs into: `prepare` turns the step's layout
(which sequence contributes which rows, with which block table) into whatever metadata the
kernel wants, once per step; `forward` runs one layer. `TorchPagedAttention` is the pure
PyTorch implementation that runs anywhere.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

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
    context_blocks: torch.Tensor | None  # [blocks]; None when the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, context_len] bool, True = attend


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows of similar context length, padded to the longest of them."""

    start: int  # first row in the flat batch
    end: int
    blocks: torch.Tensor  # [rows * max_blocks] block ids (padded with block 0)
    mask: torch.Tensor  # [rows, 1, 1, max_blocks * block_size] True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each row's new K/V
    # DecodeBucket here; a backend's own record of decode rows where it reads the cache its
    # own way (each has .start and .end, the rows it covers in the flat batch).
    decodes: list[Any] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


def padded_block_tables(spans: list[SeqSpan], block_size: int) -> list[list[int]]:
    """Each span's blocks in use (those its context reaches), padded with block 0 to the
    longest's count."""
    used = [s.block_table[: -(-s.context_len // block_size)] for s in spans]
    width = max(map(len, used), default=0)
    return [u + [0] * (width - len(u)) for u in used]


class AttentionBackend(ABC):
    def __init__(self, kv_cache: KVCache) -> None:
        self.kv = kv_cache
        self.block_size = kv_cache.spec.block_size

    @abstractmethod
    def prepare(self, spans: list[SeqSpan], device: torch.device) -> AttentionMetadata:
        """Build per-step metadata. Spans list single-token sequences first, longest context
        first among them (the runner's order), then prefill chunks."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] for the new rows; returns [T, H, D]."""

    def graph_op(self) -> Any:
        """The op a compiled decode step calls for one layer's attention, (q, k, v, layer) ->
        out: `paged_attention` below, unless the backend has an op of its own that finds the
        step without Python (begin_step hands it the metadata)."""
        return torch.ops.controlplane.paged_attention

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Before a compiled forward: hand `meta` to the graph op, if it is the backend's own."""
        return None

    def end_step(self) -> None:
        """After it: let go of what begin_step handed over."""
        return None


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
        slot_mapping: list[int] = []
        decode_rows = 0
        for span in spans:
            table = span.block_table
            slot_mapping += [
                table[p // bs] * bs + p % bs
                for p in range(span.context_len - span.num_new_tokens, span.context_len)
            ]
            if span.num_new_tokens == 1:
                decode_rows += 1
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device)
        )
        meta.decodes = self._decode_buckets(spans[:decode_rows], device)
        row = decode_rows
        for span in spans[decode_rows:]:
            q_len, ctx = span.num_new_tokens, span.context_len
            if ctx == q_len:
                meta.prefills.append(PrefillSpan(row, row + q_len, ctx, None, None))
            else:
                blocks_t = torch.tensor(
                    span.block_table[: -(-ctx // bs)], dtype=torch.long, device=device
                )
                # Row i sits at position ctx - q_len + i and sees keys 0..that position.
                q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
                mask = torch.arange(ctx).unsqueeze(0) <= q_pos
                meta.prefills.append(PrefillSpan(row, row + q_len, ctx, blocks_t, mask.to(device)))
            row += q_len
        return meta

    def _decode_buckets(self, spans: list[SeqSpan], device: torch.device) -> list[Any]:
        """The decode rows' metadata (`spans`: the step's single-token sequences, longest
        context first), as `_decode` takes it."""
        buckets = []
        start = 0
        while start < len(spans):
            longest = spans[start].context_len
            end = start + 1
            while end < len(spans) and spans[end].context_len >= self.BUCKET_RATIO * longest:
                end += 1
            buckets.append(self._bucket(spans, start, end, device))
            start = end
        return buckets

    def _bucket(
        self, spans: list[SeqSpan], start: int, end: int, device: torch.device
    ) -> DecodeBucket:
        tables = padded_block_tables(spans[start:end], self.block_size)
        lens = torch.tensor([s.context_len for s in spans[start:end]], dtype=torch.long)
        mask = torch.arange(len(tables[0]) * self.block_size).unsqueeze(0) < lens.unsqueeze(1)
        return DecodeBucket(
            start,
            end,
            torch.tensor(tables, dtype=torch.long, device=device).flatten(),
            mask[:, None, None, :].to(device),
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


# -- the seam a compiled forward is split at ---------------------------------------------------
#
# A compiled graph cannot hold the backend (Python objects, per-step lists of buckets, the
# cache written in place), so it calls attention as one opaque custom op, as vLLM splits its
# graph around attention: the op finds the step's backend and metadata here, set by the
# runner around the forward. Everything between two attention calls (norms, projections,
# rotary, the MLP) is what the compiler fuses.

# Per thread: the compiled step warms up in a thread of its own while the step thread serves
# eagerly (compiled.py), each forward with its own backend and metadata.
_local = threading.local()


@contextmanager
def attention_step(backend: AttentionBackend, meta: AttentionMetadata) -> Iterator[None]:
    """Make `backend` and `meta` the ones `paged_attention` uses, for one forward on this
    thread."""
    _local.step = (backend, meta)
    backend.begin_step(meta)
    try:
        yield
    finally:
        _local.step = None
        backend.end_step()


@torch.library.custom_op("controlplane::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer's attention for the current step (writes the new K/V into the paged cache)."""
    step = getattr(_local, "step", None)
    if step is None:
        raise RuntimeError("paged_attention called outside attention_step()")
    backend, meta = step
    return backend.forward(layer, q, k, v, meta)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)
