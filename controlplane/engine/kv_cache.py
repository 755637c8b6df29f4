"""KV cache storage: per-layer K and V in fixed-size blocks, plus a host swap space.

Block bookkeeping (free list, reference counts) lives in `BlockPool`; this module only owns
the tensors, the copies between device blocks and host swap blocks, and the cache's number
format: 16/32-bit, or 8 bits (int8 or fp8 e4m3) with one float32 scale per token and KV head.

Why a scale per token and head: it is computed when the row is written (amax over head_dim),
so it needs no calibration, a fresh outlier never clips older tokens, and a row is written
once and never rescaled. It costs 4 bytes per 64-128 values (3-6%).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from controlplane.engine.model.config import ModelConfig
from controlplane.engine.transfer import to_device

log = logging.getLogger(__name__)


# engine.kv_cache_dtype (settings.KV_CACHE_DTYPES but auto, the model's dtype) -> storage.
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}
# 8-bit storage dtypes and the largest magnitude each holds (int8: symmetric, -127..127).
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Hkv, D] K or V rows -> (8-bit rows, float32 scales [T, Hkv]); x ~= q * scale."""
    qmax = QMAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(-1)
    # Divided by a tensor, not the Python number: CUDA divides by a scalar as a multiply by
    # its reciprocal, 1 ulp off the correctly rounded quotient the Triton write kernel
    # (div_rn) and the CPU give, and the two backends' caches must hold the same bytes.
    scale = (amax / torch.full_like(amax, qmax)).clamp_min(torch.finfo(torch.float32).tiny)
    y = xf / scale.unsqueeze(-1)
    if dtype == torch.int8:
        y = y.round_()
    return y.clamp_(-qmax, qmax).to(dtype), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_kv, in `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor as bytes: CPU kernels such as index_copy_ lack float8 (torch 2.13)."""
    return t.view(torch.uint8) if t.dtype in QMAX else t


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # storage: the model's dtype, another 16/32-bit one, or 8-bit (QMAX)

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)

    @property
    def quantized(self) -> bool:
        return self.dtype in QMAX

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_head = self.head_dim * elem + (4 if self.quantized else 0)  # + a float32 scale
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * per_head


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
        # 8-bit: one float32 scale per slot and KV head (None: the values are stored as is).
        self.k_scale: list[torch.Tensor] | None = None
        self.v_scale: list[torch.Tensor] | None = None
        if spec.quantized:
            self.k_scale, self.v_scale = (
                [torch.zeros(shape[:2], device=device) for _ in range(spec.num_layers)]
                for _ in range(2)
            )
        swap_shape = (num_swap_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        pin = device.type == "cuda"
        self.swap_k = [torch.zeros(swap_shape, dtype=spec.dtype, pin_memory=pin) for _ in self.k]
        self.swap_v = [torch.zeros(swap_shape, dtype=spec.dtype, pin_memory=pin) for _ in self.v]
        self.swap_k_scale = self.swap_v_scale = None
        if spec.quantized:
            self.swap_k_scale, self.swap_v_scale = (
                [torch.zeros(swap_shape[:3], pin_memory=pin) for _ in range(spec.num_layers)]
                for _ in range(2)
            )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new rows k/v [T, Hkv, D] at `slots` (quantizing them for an 8-bit cache)."""
        if self.k_scale is None or self.v_scale is None:
            self.k[layer].index_copy_(0, slots, k.to(self.spec.dtype))
            self.v[layer].index_copy_(0, slots, v.to(self.spec.dtype))
            return
        for x, cache, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, scale = quantize_kv(x, self.spec.dtype)
            _raw(cache[layer]).index_copy_(0, slots, _raw(q))
            scales[layer].index_copy_(0, slots, scale)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """New rows x [T, Hkv, D] as a read of the cache returns them (8-bit: quantized and
        back), so a prompt attends to the same values whether its keys come from this step or
        from the cache: outputs do not depend on how a prompt was chunked or recomputed."""
        if not self.spec.quantized:
            return x
        return dequantize_kv(*quantize_kv(x, self.spec.dtype), x.dtype)

    def read_blocks(
        self, layer: int, blocks: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, [len(blocks) * block_size, Hkv, D] in `dtype`."""
        out = []
        for cache, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            rows = self._blocks(_raw(cache[layer])).index_select(0, blocks)
            rows = rows.view(self.spec.dtype).flatten(0, 1)
            if scales is not None:
                s = self._blocks(scales[layer]).index_select(0, blocks).flatten(0, 1)
                rows = dequantize_kv(rows, s, dtype)
            out.append(rows.to(dtype))
        return out[0], out[1]

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(self.num_blocks, self.spec.block_size, *flat.shape[1:])

    def _pairs(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """(device tensors, host swap tensors) of everything a block holds."""
        pairs = [(self.k, self.swap_k), (self.v, self.swap_v)]
        if self.k_scale is not None and self.v_scale is not None:
            assert self.swap_k_scale is not None and self.swap_v_scale is not None
            pairs += [(self.k_scale, self.swap_k_scale), (self.v_scale, self.swap_v_scale)]
        return pairs

    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        src = to_device(device_blocks, self.k[0].device)
        dst = torch.tensor(host_blocks)
        for cache, swap in self._pairs():
            for layer, host in zip(cache, swap, strict=True):
                _raw(host).index_copy_(0, dst, self._blocks(_raw(layer)).index_select(0, src).cpu())

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        src = torch.tensor(host_blocks)
        dst = to_device(device_blocks, self.k[0].device)
        for cache, swap in self._pairs():
            for layer, host in zip(cache, swap, strict=True):
                blocks = _raw(host).index_select(0, src).to(layer.device, non_blocking=True)
                self._blocks(_raw(layer)).index_copy_(0, dst, blocks)

    def copy(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Copy blocks within the device cache (copy-on-write of a shared partial block)."""
        dev = self.k[0].device
        src, dst = to_device(src_blocks, dev), to_device(dst_blocks, dev)
        for cache, _swap in self._pairs():
            for layer in cache:
                blocks = self._blocks(_raw(layer))
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
