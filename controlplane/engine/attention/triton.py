"""Paged attention in Triton: the GPU backend behind `AttentionBackend`, which builds each
step's metadata as device tensors and launches triton_kernels.py's kernels (what they compute,
and how an 8-bit cache and Triton's interpreter on a CPU are handled, is said there)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass

import torch

from controlplane.engine.attention import triton_kernels as tk
from controlplane.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    PrefillSpan,
    SeqSpan,
    flat_block_tables,
    padded_block_table,
)
from controlplane.engine.attention.triton_kernels import (
    BLOCK_N,
    PARTITION,
    PREFILL_BLOCK_M,
    ensure_interpreter_on_cpu,
    next_pow2,
)
from controlplane.engine.kv_cache import QMAX, KVCache
from controlplane.engine.transfer import copy_into, to_device

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class TritonAttentionMetadata(AttentionMetadata):
    """Everything the kernels read, as device tensors built once per step. `prefills` keeps one
    tensor-free `PrefillSpan` per chunk so callers asking "any prefill?" (the compiled decode
    step) still can; the kernels use only the tensors."""

    query_start: torch.Tensor  # [num_seqs + 1] int32: first row of each sequence, then T
    query_lens: torch.Tensor  # [num_seqs] int32: new rows per sequence
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with block 0
    num_decodes: int  # leading single-row sequences (rows 0..num_decodes-1)
    num_partitions: int  # decode partitions per sequence (grid size, from padded maxima)
    max_query_len: int  # longest prefill chunk (0 without prefills)


class TritonPagedAttention(AttentionBackend):
    """`max_blocks_per_seq` pins the block-table width (and so the decode grid) to a fixed
    maximum, the shape a CUDA graph captures; by default it is the step's longest context."""

    def __init__(self, kv_cache: KVCache, max_blocks_per_seq: int | None = None) -> None:
        super().__init__(kv_cache)
        ensure_interpreter_on_cpu(kv_cache.k[0].device)
        tk.jit_kernels()
        self.max_blocks_per_seq = max_blocks_per_seq

    @classmethod
    def create(cls, kv_cache: KVCache, bf16_dot: bool = True) -> AttentionBackend:
        if kv_cache.k[0].device.type == "cpu":
            log.warning(
                "attention_backend triton on CPU: Triton's interpreter runs the kernels, "
                "for tests and debugging only (orders of magnitude slower than torch)"
            )
        return cls(kv_cache)  # turns the interpreter on for a CPU cache

    def prepare(self, spans: list[SeqSpan], device: torch.device) -> TritonAttentionMetadata:
        bs = self.block_size
        q_lens = [s.num_new_tokens for s in spans]
        ctx = [s.context_len for s in spans]
        num_decodes = 0
        while num_decodes < len(spans) and q_lens[num_decodes] == 1:
            num_decodes += 1
        used = [-(-c // bs) for c in ctx]
        width = self.max_blocks_per_seq or max(used, default=1)
        if max(used, default=0) > width:
            raise ValueError(f"a context of {max(ctx)} tokens exceeds max_blocks_per_seq={width}")
        block_tables = padded_block_table(spans, bs, torch.device("cpu"), width, torch.int32)
        starts = list(itertools.accumulate(q_lens, initial=0))
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        ctx_t = torch.tensor(ctx, dtype=torch.int32)
        query_start = torch.tensor(starts, dtype=torch.int32)
        # Each row's position, then its slot: vectorized over the rows, not a Python loop.
        seq_of_row = torch.repeat_interleave(torch.arange(len(spans)), q_lens_t)
        first_pos = (ctx_t - q_lens_t - query_start[:-1]).long()
        pos = torch.arange(starts[-1]) + first_pos[seq_of_row]
        slots = block_tables[seq_of_row, pos // bs].long() * bs + pos % bs
        decode_span = width * bs if self.max_blocks_per_seq else max(ctx[:num_decodes], default=0)
        return TritonAttentionMetadata(
            slot_mapping=to_device(slots, device),
            prefills=[
                PrefillSpan(starts[i], starts[i + 1], ctx[i], None, None)
                for i in range(num_decodes, len(spans))
            ],
            query_start=to_device(query_start, device, torch.int32),
            query_lens=to_device(q_lens_t, device, torch.int32),
            seq_lens=to_device(ctx_t, device, torch.int32),
            block_tables=to_device(block_tables, device, torch.int32),
            num_decodes=num_decodes,
            num_partitions=max(1, -(-decode_span // PARTITION)),
            max_query_len=max(q_lens[num_decodes:], default=0),
        )

    def static_decode_metadata(
        self, sizes: list[int], max_blocks_per_seq: int, device: torch.device
    ) -> dict[int, TritonAttentionMetadata]:
        """Decode-only metadata for each batch size in `sizes`, for CUDA graphs: views of the
        first rows of one set of tensors (max(sizes) padding rows) that never move, refilled
        in place by `prepare_into`. The block-table width, and with it the decode grid, is
        fixed by `max_blocks_per_seq`."""
        rows = max(sizes)
        full = TritonAttentionMetadata(
            slot_mapping=torch.full((rows,), -1, dtype=torch.long, device=device),
            query_start=torch.arange(rows + 1, dtype=torch.int32, device=device),
            query_lens=torch.ones(rows, dtype=torch.int32, device=device),
            seq_lens=torch.ones(rows, dtype=torch.int32, device=device),
            block_tables=torch.zeros((rows, max_blocks_per_seq), dtype=torch.int32, device=device),
            num_decodes=rows,
            num_partitions=max(1, -(-max_blocks_per_seq * self.block_size // PARTITION)),
            max_query_len=0,
        )
        return {
            n: dataclasses.replace(
                full,
                slot_mapping=full.slot_mapping[:n],
                query_start=full.query_start[: n + 1],
                query_lens=full.query_lens[:n],
                seq_lens=full.seq_lens[:n],
                block_tables=full.block_tables[:n],
                num_decodes=n,
            )
            for n in sizes
        }

    def prepare_into(self, meta: TritonAttentionMetadata, spans: list[SeqSpan]) -> None:
        """Refill decode-only `meta` (from `static_decode_metadata`) in place for `spans`,
        single-token ones, at most `meta.num_decodes` of them; the rows after
        them become padding: slot -1 (writes nothing) and one key, slot 0 of block 0 (the
        reduce assumes every row has a key). Shapes and `num_partitions` stay as they are.

        Only the block-table columns the longest context uses are written: the kernels read
        no column past those a row's own `seq_len` covers, so older entries there are harmless."""
        bs = self.block_size
        pad = meta.num_decodes - len(spans)
        ctx = [s.context_len for s in spans] + [1] * pad
        width = max(-(-c // bs) for c in ctx)
        if width > meta.block_tables.shape[1]:
            raise ValueError(
                f"a context of {max(ctx)} tokens exceeds {meta.block_tables.shape[1]} blocks"
            )
        tables = flat_block_tables(spans, bs, width)
        tables.frombytes(bytes(8 * width * pad))
        slots = [
            s.block_table[(s.context_len - 1) // bs] * bs + (s.context_len - 1) % bs for s in spans
        ]
        copy_into(meta.seq_lens, ctx)
        copy_into(meta.slot_mapping, slots + [-1] * pad)
        copy_into(meta.block_tables[:, :width], tables)

    def _layer_cache(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """(k, v, k_scale, v_scale, quantized) of one layer, as the kernels take them. A
        16/32-bit cache has no scales: the kernels never read them (QUANT is off) and the
        cache stands in. An fp8 cache goes as its uint8 bits (see `triton_kernels._fp8_encode`)."""
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        if k_cache.dtype not in QMAX:
            return k_cache, v_cache, k_cache, v_cache, False
        if k_cache.dtype == torch.float8_e4m3fn:
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        return k_cache, v_cache, self.kv.k_scale[layer], self.kv.v_scale[layer], True

    def write_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store rows k/v [T, Hkv, D] at cache slots `slot_mapping` [T] (rows at a negative
        slot are skipped), quantized when the cache is 8-bit."""
        if not k.shape[0]:
            return
        k_cache, v_cache, k_scale, v_scale, quant = self._layer_cache(layer)
        kv_heads, head_dim = k.shape[1], k.shape[2]
        tk.write_kv_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
            k_cache.stride(1), k_scale.stride(0), kv_heads,
            HEAD_DIM=head_dim, BLOCK_H=next_pow2(kv_heads), QUANT=quant,
            QMAX=QMAX.get(self.kv.k[layer].dtype, 1.0),
        )  # fmt: skip

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] (last dim contiguous); returns [T, H, D] in q's dtype."""
        assert isinstance(meta, TritonAttentionMetadata)
        self.write_kv(layer, k, v, meta.slot_mapping)
        k_cache, v_cache, k_scale, v_scale, quant = self._layer_cache(layer)
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k.shape[1]
        group = num_heads // kv_heads
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_scale.stride(0))

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        common = dict(
            HEAD_DIM=head_dim,
            PAGE=self.block_size,
            BLOCK_N=BLOCK_N,
            QUANT=quant,
            DOT_TY=tk.dot_dtype(q.dtype),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides)
        bt_stride = meta.block_tables.stride(0)
        sm_scale = math.log2(math.e) / math.sqrt(head_dim)  # exp2 in the kernels
        nd, parts = meta.num_decodes, meta.num_partitions
        if nd:
            split = parts > 1
            if split:
                part_m = torch.empty((nd, num_heads, parts), dtype=torch.float32, device=q.device)
                part_l = torch.empty_like(part_m)
                part_acc = part_m.new_empty((nd, num_heads, parts, head_dim))
            else:  # the decode kernel writes `out` itself; `out` stands in for the partials
                part_m = part_l = part_acc = out
            tk.decode_kernel[(nd, kv_heads, parts)](
                q, k_cache, v_cache, k_scale, v_scale, meta.block_tables, meta.seq_lens, out,
                part_m, part_l, part_acc, *strides, bt_stride, sm_scale, group, num_heads, parts,
                BLOCK_G=max(16, next_pow2(group)), PARTITION=PARTITION, SPLIT=split,
                **common,
            )  # fmt: skip
            if split:
                tk.reduce_kernel[(nd, num_heads)](
                    part_m, part_l, part_acc, out, out.stride(0), out.stride(1), num_heads,
                    parts, HEAD_DIM=head_dim, BLOCK_P=next_pow2(parts),
                )  # fmt: skip
        num_prefills = meta.query_lens.shape[0] - nd
        if num_prefills:
            block_m = max(PREFILL_BLOCK_M, next_pow2(group))
            per_block = block_m // group
            grid = (num_prefills, kv_heads, -(-meta.max_query_len // per_block))
            tk.prefill_kernel[grid](
                q, k_cache, v_cache, k_scale, v_scale, meta.block_tables, meta.seq_lens,
                meta.query_start, out, *strides, bt_stride, sm_scale, group, per_block, nd,
                BLOCK_M=block_m, **common,
            )  # fmt: skip
        return out
