"""KV cache storage: per-layer K and V in fixed-size blocks, plus a host swap space.

Block bookkeeping (free list, reference counts) lives in `BlockPool`; this module only owns
the tensors and the copies between device blocks and host swap blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from controlplane.engine.model.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, num_swap_blocks: int, device: torch.device
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        shape = (num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        # Zeros, not empty: padded gathers read arbitrary slots, and 0 * NaN would poison a row.
        self.k = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        swap_shape = (num_swap_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        pin = device.type == "cuda"
        self.swap_k = [torch.zeros(swap_shape, dtype=spec.dtype, pin_memory=pin) for _ in self.k]
        self.swap_v = [torch.zeros(swap_shape, dtype=spec.dtype, pin_memory=pin) for _ in self.v]

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(self.num_blocks, self.spec.block_size, *flat.shape[1:])

    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        src = torch.tensor(device_blocks, device=self.k[0].device)
        dst = torch.tensor(host_blocks)
        for cache, swap in ((self.k, self.swap_k), (self.v, self.swap_v)):
            for layer, host in zip(cache, swap, strict=True):
                host.index_copy_(0, dst, self._blocks(layer).index_select(0, src).cpu())

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        src = torch.tensor(host_blocks)
        dst = torch.tensor(device_blocks, device=self.k[0].device)
        for cache, swap in ((self.k, self.swap_k), (self.v, self.swap_v)):
            for layer, host in zip(cache, swap, strict=True):
                blocks = host.index_select(0, src).to(layer.device, non_blocking=True)
                self._blocks(layer).index_copy_(0, dst, blocks)

    def copy(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Copy blocks within the device cache (copy-on-write of a shared partial block)."""
        dev = self.k[0].device
        src = torch.tensor(src_blocks, device=dev)
        dst = torch.tensor(dst_blocks, device=dev)
        for layer in (*self.k, *self.v):
            blocks = self._blocks(layer)
            blocks.index_copy_(0, dst, blocks.index_select(0, src))


def plan_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    *,
    cpu_bytes: int,
    gpu_fraction: float,
    explicit: int | None,
) -> tuple[int, str]:
    """How many blocks fit the budget, and a sentence saying why (logged at start)."""
    per_block = spec.bytes_per_block
    if explicit is not None:
        return (
            explicit,
            f"{explicit} blocks (num_kv_blocks), {explicit * per_block / 2**20:.1f} MiB",
        )
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_fraction)
        source = f"{gpu_fraction:.0%} of {free / 2**30:.1f} GiB free GPU memory"
    else:
        budget = cpu_bytes
        source = f"kv_cache_memory_bytes={cpu_bytes}"
    n = budget // per_block
    return (
        n,
        f"{n} blocks x {spec.block_size} tokens = {n * spec.block_size} tokens ({source}, {per_block} B/block)",
    )
