"""Paged attention over a ragged batch: the protocol every backend implements, and what they
share.

`AttentionBackend` is the seam a kernel plugs into: `prepare` turns the step's layout (which
sequence contributes which rows, with which block table) into whatever metadata the kernel
wants, once per step; `forward` runs one layer. The backends themselves: torch_paged.py (pure
PyTorch, runs anywhere), cpu.py (our C++ decode kernel), triton.py (GPUs); registry.py names
them for `engine.attention_backend`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from controlplane.engine.kv_cache import KVCache
from controlplane.engine.transfer import to_device


@dataclass(slots=True)
class SeqSpan:
    """One sequence's share of the flat batch."""

    num_new_tokens: int  # rows this sequence has in the batch (chunk length, or 1 for a decode)
    context_len: int  # tokens it attends to after this step, the new ones included
    block_table: array | list[int]  # sequence.block_table (an array; a list works, slower)


@dataclass(slots=True)
class PrefillSpan:
    start: int  # first row in the flat batch
    end: int
    context_len: int
    context_blocks: torch.Tensor | None  # [blocks]; None when the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, context_len] bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each row's new K/V
    # torch_paged.DecodeBucket, or a backend's own record of decode rows where it reads the
    # cache its own way (each has .start and .end, the rows it covers in the flat batch).
    decodes: list[Any] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


def padded_block_tables(spans: list[SeqSpan], block_size: int) -> list[list[int]]:
    """Each span's blocks in use (those its context reaches), padded with block 0 to the
    longest's count."""
    used = [list(s.block_table[: -(-s.context_len // block_size)]) for s in spans]
    width = max(map(len, used), default=0)
    return [u + [0] * (width - len(u)) for u in used]


def flat_block_tables(spans: list[SeqSpan], block_size: int, width: int) -> array:
    """The spans' padded block tables (padded_block_tables) as one int64 array, row after
    row: a memory copy a row for tables held as arrays (sequence.block_table), where a list's
    ints are converted one by one (docs/benchmarks.md#host-overhead)."""
    flat = array("q")
    zeros = array("q", bytes(8 * width))
    for s in spans:
        n = -(-s.context_len // block_size)
        flat.extend(s.block_table[:n])
        if n < width:
            flat += zeros[: width - n]
    return flat


def padded_block_table(
    spans: list[SeqSpan],
    block_size: int,
    device: torch.device,
    width: int | None = None,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """padded_block_tables as a tensor [len(spans), width] (default: the longest's count)."""
    if width is None:
        width = max((-(-s.context_len // block_size) for s in spans), default=0)
    flat = flat_block_tables(spans, block_size, width)
    return to_device(flat, device, dtype).view(len(spans), width)


class AttentionBackend(ABC):
    def __init__(self, kv_cache: KVCache) -> None:
        self.kv = kv_cache
        self.block_size = kv_cache.spec.block_size

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on `device` (None: it can). Asked before `create`, so
        that a setting naming it is refused with the reason."""
        return None

    @classmethod
    def create(cls, kv_cache: KVCache, bf16_dot: bool = True) -> AttentionBackend:
        """The backend over `kv_cache`, from the engine's settings (`bf16_dot`:
        engine.bf16_dot, for the backends whose kernels have a bf16 dot-product path)."""
        return cls(kv_cache)

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
