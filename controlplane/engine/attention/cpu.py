"""Paged attention on the CPU with our own decode kernel (cpu_ops: csrc/cpu_ops.cpp).

Decode rows read the paged cache in place through a block table, one kernel call per layer
for all of a step's decode rows whatever their context lengths: no gather of whole blocks
into a contiguous copy, no padding mask, no bucket of similar lengths. Prefill chunks are
TorchPagedAttention's (SDPA's flash kernel is fast on many query rows).

Why: in a compiled batch-1 decode step of SmolLM2 (30 layers) torch's attention took ~38 us a
layer: SDPA 15.6, the block gathers 9.5, the K/V write 3.9, the rest Python (docs/engine.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from controlplane.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    SeqSpan,
    padded_block_table,
)
from controlplane.engine.attention.torch_paged import TorchPagedAttention
from controlplane.engine.kernels import cpu_ops
from controlplane.engine.kv_cache import KVCache
from controlplane.engine.transfer import to_device


@dataclass(slots=True)
class DecodeRows:
    """A step's decode rows, for the kernel."""

    start: int  # first row in the flat batch
    end: int
    block_table: torch.Tensor  # int64 [rows, blocks of the longest], padded with block 0
    context_lens: torch.Tensor  # int64 [rows]


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self, kv_cache: KVCache, bf16_dot: bool = True) -> None:
        if not cpu_ops.available():
            raise RuntimeError(f"the CPU kernels did not build: {cpu_ops.build_error()}")
        super().__init__(kv_cache)
        self.sm_scale = kv_cache.spec.head_dim**-0.5  # SDPA's default, as the torch backend
        # bf16 queries on a bf16 cache by bf16 dot products where the CPU has them
        # (engine.bf16_dot); off: float32 scores and sums, the probabilities unrounded.
        self.bf16_dot = bf16_dot

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return "the device is " + device.type
        return None if cpu_ops.available() else cpu_ops.build_error()

    @classmethod
    def create(cls, kv_cache: KVCache, bf16_dot: bool = True) -> AttentionBackend:
        return cls(kv_cache, bf16_dot)

    def _decode_buckets(self, spans: list[SeqSpan], device: torch.device) -> list[DecodeRows]:
        if not spans:
            return []
        return [
            DecodeRows(
                0,
                len(spans),
                padded_block_table(spans, self.block_size, device),
                to_device([s.context_len for s in spans], device),
            )
        ]

    def graph_op(self) -> Any:
        # The kernel's own op, with the step in C++ (cpu_ops.cpp, step_attention), where the
        # kernel writes the new K/V itself: 16- and 32-bit caches. 8-bit ones are written by
        # KVCache.write, through the Python op.
        if self.kv.spec.quantized:
            return super().graph_op()
        return torch.ops.controlplane_cpu.step_attention

    def begin_step(self, meta: AttentionMetadata) -> None:
        # Compiled steps are decode-only (CompiledDecode.applies): one DecodeRows.
        if not self.kv.spec.quantized and meta.decodes and not meta.prefills:
            b = meta.decodes[0]
            torch.ops.controlplane_cpu.set_decode_step(
                self.kv.k,
                self.kv.v,
                b.block_table,
                b.context_lens,
                meta.slot_mapping,
                self.block_size,
                self.sm_scale,
                self.bf16_dot,
            )

    def end_step(self) -> None:
        torch.ops.controlplane_cpu.clear_decode_step()

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if not meta.prefills and meta.decodes and not self.kv.spec.quantized:
            # A decode-only step: the kernel writes the rows' K/V itself (8-bit caches are
            # quantized by KVCache.write, the one quantizer every backend shares).
            return self._decode(layer, q, meta.decodes[0], (k, v, meta.slot_mapping))
        return super().forward(layer, q, k, v, meta)

    def _decode(
        self,
        layer: int,
        q: torch.Tensor,
        b: DecodeRows,
        new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        kv = self.kv
        scales = (None, None) if kv.k_scale is None else (kv.k_scale[layer], kv.v_scale[layer])
        if new is not None:
            new = (new[0].to(q.dtype).contiguous(), new[1].to(q.dtype).contiguous(), new[2])
        return torch.ops.controlplane_cpu.paged_decode_attention(
            q.contiguous(),
            kv.k[layer],
            kv.v[layer],
            *scales,
            b.block_table,
            b.context_lens,
            self.block_size,
            self.sm_scale,
            *(new or ()),
            bf16_dot=self.bf16_dot,
        )
