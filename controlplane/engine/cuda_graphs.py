"""The decode step replayed as CUDA graphs (`engine.cuda_graphs`, `engine.cuda_graph_max_rows`).

Design: the compiled decode step (compiled.py) still launches dozens of kernels per layer, and
at small batches their launch cost is most of a step. A CUDA graph records those launches once
and replays them with one call, but it bakes in every tensor address and grid size, so the
step must run on STATIC buffers: token ids, positions and logits rows, and the Triton
backend's metadata (`TritonPagedAttention.static_decode_metadata`: a block table as wide as
max_model_len needs, so the decode grid never changes). Graphs are captured ONCE at start for
padded batch sizes (CAPTURE_SIZES: 1, 2, 4, 8, 16, 24, 32, 48, 64, ...) up to
`cuda_graph_max_rows` (by default the compiled step's ceiling, max_num_seqs at start; and that
ceiling itself), largest first, sharing one memory pool; their metadata are views of one set of
buffers. A decode-only step of n <= ceiling rows picks the smallest size >= n, copies its
ids, positions and metadata into the buffers (padding rows: token 0, position 0, slot -1 so
they write no K/V, one key in block 0), replays, and returns copies of the rows it needs.
Nothing captures after start: steps of more rows (a live `max_num_seqs` above the ceiling),
prefill chunks and verification run compiled (or eagerly) without graphs, as before.

Capture and replay are a thin `Replayer`: on CUDA a `torch.cuda.CUDAGraph`; on a CPU, for
tests, `CallAgain` calls the step again on the same buffers, so everything but the graph
itself (padding, metadata refill, row selection) is tested without a GPU.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from controlplane.engine.attention.backend import AttentionBackend, AttentionMetadata, SeqSpan
from controlplane.engine.model.llama import CausalLM
from controlplane.engine.transfer import copy_into, to_device

if TYPE_CHECKING:  # loaded only where Triton attention runs: the CPU engine never loads it
    from controlplane.engine.attention.triton import TritonAttentionMetadata, TritonPagedAttention

log = logging.getLogger(__name__)

# Padded batch sizes: a step of n rows replays the smallest size >= n. Dense where a decode
# step reads weights (its time barely grows with rows: padding is nearly free), sparser where
# its matmuls begin to cost by the row: from 16 rows a step pads by at most half (33 -> 48),
# from 64 by a quarter. 21 sizes up to 512 (vLLM captures every 8th: 67).
CAPTURE_SIZES = (
    *(1, 2, 4, 8, 16, 24, 32),
    *range(48, 129, 16),
    *range(160, 257, 32),
    *range(320, 513, 64),
)


def capture_sizes(max_rows: int) -> list[int]:
    """The sizes captured under a ceiling of `max_rows`: CAPTURE_SIZES below it, and it."""
    return [s for s in CAPTURE_SIZES if s < max_rows] + [max_rows]


# (input_ids, positions, logits_indices, backend, metadata) -> logits: CompiledDecode's call.
DecodeStep = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionBackend, AttentionMetadata], torch.Tensor
]


class Replayer(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run `fn` once, recording it; returns its output, which every replay overwrites."""

    def replay(self) -> None: ...


class CudaGraphReplayer:
    def __init__(self, pool: tuple[int, int]) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # Run it first on a side stream (as torch.cuda.graph's docs require), so that lazy
        # work (Triton's compile of each kernel specialization, cuBLAS handles and workspaces)
        # happens outside the capture, where it would be an error.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self._graph, pool=self._pool):
            out = fn()
        return out

    def replay(self) -> None:
        self._graph.replay()


class CallAgain:
    """The CPU stand-in for a graph (tests): replay calls the step again on the same static
    buffers and writes into the captured output, as a replay would."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._fn = fn
        self._out = fn()
        return self._out

    def replay(self) -> None:
        self._out.copy_(self._fn())


def cuda_replayers() -> Callable[[], Replayer]:
    """CUDA graph replayers sharing one memory pool: only one graph runs at a time, so the
    smaller graphs reuse the largest one's intermediate memory."""
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraphReplayer(pool)


def graphs_enabled(
    mode: str, device: torch.device, backend: AttentionBackend, compiled: bool
) -> bool:
    """What `engine.cuda_graphs` means: auto captures on CUDA when attention runs in Triton
    (the torch backend's per-step Python bucketing cannot be captured) and the decode step
    is compiled."""
    if mode != "auto" or device.type != "cuda" or not compiled:
        return False
    from controlplane.engine.attention.triton import TritonPagedAttention

    return isinstance(backend, TritonPagedAttention)


def eager_step(model: CausalLM) -> DecodeStep:
    """The model's uncompiled forward as a DecodeStep (a capture with compile off)."""
    return lambda ids, positions, rows, backend, meta: model(ids, positions, backend, meta, rows)


class CudaGraphDecode:
    def __init__(
        self,
        step: DecodeStep,
        backend: TritonPagedAttention,
        max_rows: int,
        max_blocks_per_seq: int,
        device: torch.device,
        replayers: Callable[[], Replayer],
    ) -> None:
        self.backend = backend
        self.max_rows = max_rows
        self.sizes = capture_sizes(max_rows)
        self.capture_s = 0.0
        self.captures = 0  # graphs recorded (only at start)
        self.replays = 0  # steps that ran as a replay
        self._step = step
        self._replayers = replayers
        # size -> (its graph, the graph's output, the metadata views it was captured with)
        self._graphs: dict[int, tuple[Replayer, torch.Tensor, TritonAttentionMetadata]] = {}
        # Inference tensors, like the runner's: the compiled graph guards on the dispatch keys,
        # and ordinary tensors here made every call a recompile (seen on CPU).
        with torch.inference_mode():
            self._ids = torch.zeros(max_rows, dtype=torch.long, device=device)
            self._positions = torch.zeros(max_rows, dtype=torch.long, device=device)
            self._rows = torch.arange(max_rows, device=device)
            self._metas = backend.static_decode_metadata(self.sizes, max_blocks_per_seq, device)

    def applies(self, spans: list[SeqSpan]) -> bool:
        """Whether a step of these spans replays a graph: decode-only, at most max_rows."""
        return 0 < len(spans) <= self.max_rows and all(s.num_new_tokens == 1 for s in spans)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first. Before any request: the buffers hold
        padding only (slot -1), so the capture runs write no K/V."""
        t0 = time.perf_counter()
        for size in reversed(self.sizes):
            meta = self._metas[size]
            ids, positions, rows = self._ids[:size], self._positions[:size], self._rows[:size]
            fn = functools.partial(self._step, ids, positions, rows, self.backend, meta)
            replayer = self._replayers()
            self._graphs[size] = (replayer, replayer.capture(fn), meta)
            self.captures += 1
        self.capture_s = time.perf_counter() - t0
        log.info(
            "captured the decode step as CUDA graphs for %s rows in %.1fs; larger decode "
            "steps run without a graph",
            ", ".join(map(str, self.sizes)),
            self.capture_s,
        )

    def __call__(
        self,
        input_ids: list[int],
        positions: list[int],
        spans: list[SeqSpan],
        rows: list[int],
        fed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits (float32) of `rows` (row indices of this step, ascending) for a step that
        `applies`; a copy, since the next replay overwrites the graph's output."""
        n = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        replayer, out, meta = self._graphs[size]
        pad = [0] * (size - n)
        copy_into(self._ids[:size], input_ids + pad)
        copy_into(self._positions[:size], positions + pad)
        if fed is not None:  # rows whose token the previous step sampled on the device
            self._ids[fed[0]] = fed[1]
        self.backend.prepare_into(meta, spans)
        replayer.replay()
        self.replays += 1
        if len(rows) == n:  # every row: rows == range(n)
            return out[:n].clone()
        return out[to_device(rows, out.device)]
