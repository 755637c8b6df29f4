"""The weights a CPU decode step streams, moved into one region on 2 MB pages, in the order a
step reads them.

A decode step reads every weight once, from memory. The hardware prefetcher follows a stream
only to the end of a page, and each 4 KB page costs a TLB miss. SmolLM2's int4 weights are
0.3-0.9 MB a linear, too small for a 2 MB page each, so the weights go into one region, one after
the other as the layers use them: a step's whole read is then one near-sequential stream across
its linears, on huge pages (transparent huge pages, in `madvise` or `always` mode; where the
kernel refuses, the region is plain pages and only the order remains). Measured on a 2-core Zen
4, one row, interleaved rounds (benchmarks/weight_placement.py): SmolLM2's 121 streamed modules
1.085x faster (21 rounds), a 1.1B Llama's bf16 linears 1.04-1.05x (9-15 rounds); SmolLM2's
one-user decode 1.06-1.10x end to end (two runs, either order).

Moved: the tensors our kernels and torch's quantized ones read (Int4Linear, Int8Linear,
Int8Embedding buffers, PackedLinear's bf16 panels), which the loader built in private memory.
Not moved: float weights still mapped from the checkpoint file (they stay shared with the page
cache), oneDNN's opaque packed weights, anything on a GPU.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # a cache line: each tensor starts on one

# The buffers / attributes each module kind streams (a tied table is one tensor, moved once).
_STREAMED = {
    "Int4Linear": ("packed", "scales_and_zeros", "scales", "mins"),
    "Int8Linear": ("qweight", "scales"),
    "Int8Embedding": ("qweight", "scales"),
    "PackedLinear": ("packed",),
}


def _huge_region(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed anonymous memory, 2 MB aligned, advised onto huge pages (uint8)."""
    # Private: Python's default anonymous map is shared memory, which THP leaves on 4 KB pages
    # unless shmem_enabled says otherwise (`never` here).
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive
    start = -whole.data_ptr() % HUGE_PAGE
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        buf.madvise(mmap.MADV_HUGEPAGE)
    return whole[start : start + nbytes]


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def streamed(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of each tensor place_weights moves, in the order the modules are
    registered, i.e. as a step reads them (oneDNN's opaque packed weights are left out)."""
    found = []
    for module in model.modules():
        for name in _STREAMED.get(type(module).__name__, ()):
            t = getattr(module, name, None)
            if (
                isinstance(t, torch.Tensor)
                and not t.is_mkldnn
                and t.device.type == "cpu"
                and t.numel()
                and t.is_contiguous()
            ):
                found.append((module, name))
    return found


def place_weights(model: nn.Module) -> int:
    """Move the streamed weights of a CPU `model` into one region on huge pages, in step order;
    returns the bytes moved (0: nothing to move). The results are the same bits; each old tensor
    is freed once its last holder has the new one (no second copy of the model at once)."""
    entries = streamed(model)
    # A tensor is known by its address, dtype and shape while every one of them is alive: a
    # tied table (one tensor, two modules) gets one place.
    offsets: dict[tuple, int] = {}
    size = 0
    for module, name in entries:
        t = getattr(module, name)
        key = _key(t)
        if key not in offsets:
            offsets[key] = size
            size += -(-_nbytes(t) // _ALIGN) * _ALIGN
        del t  # no reference kept past this loop: each old tensor is freed once replaced
    if not size:
        return 0
    region = _huge_region(size)
    placed: dict[tuple, torch.Tensor] = {}
    for module, name in entries:
        t = getattr(module, name)
        key = _key(t)
        new = placed.get(key)
        if new is None:
            start = offsets[key]
            new = region[start : start + _nbytes(t)].view(t.dtype).view(t.shape)
            new.copy_(t)
            placed[key] = new
        del t
        if name in module._buffers:
            module._buffers[name] = new
        else:
            setattr(module, name, new)
    return size
