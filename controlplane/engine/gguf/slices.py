"""Part of a GGUF tensor, dequantized from the file map: the rows, or the columns, that a
tensor-parallel rank holds, without dequantizing (or reading) the rest.

A 2-D GGUF tensor is stored row-major, each row a run of quantization blocks along the last
dimension (the input features K): 32 values a block for Q4_0, Q4_1 and Q8_0, 256 for the
K-quants, 1 for F32, F16 and BF16. So rows [a, b) are one contiguous byte range, and columns
[c, d) are bytes [c / block * type_size, d / block * type_size) of every row whenever c and d
fall on block boundaries. A column slice that does not (a Q4_K tensor whose rank's share of K
is not a multiple of 256) is dequantized from whole rows, then sliced, and the log says so.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import dequantize as gguf_dequantize

from controlplane.engine.gguf.file import GGUFTensor

log = logging.getLogger(__name__)

_ALL = slice(None)


def byte_rows(t: GGUFTensor) -> np.ndarray:
    """The stored tensor as uint8 [rows, bytes_per_row]: a view of the map, nothing read yet."""
    data = t.data.reshape(t.data.shape[0], -1) if t.data.ndim > 1 else t.data.reshape(1, -1)
    return data.view(np.uint8)


def column_bytes(t: GGUFTensor, cols: slice) -> slice | None:
    """The byte range of every row that holds columns `cols`; None: they cut through a block."""
    block, type_size = GGML_QUANT_SIZES[t.type]
    start, stop, step = cols.indices(t.shape[-1])
    if step != 1 or start % block or stop % block:
        return None
    return slice(start // block * type_size, stop // block * type_size)


def read(t: GGUFTensor, rows: slice = _ALL, cols: slice = _ALL) -> torch.Tensor:
    """Rows `rows` (in this engine's order: `t.rows` applied) and columns `cols` of `t`, as a
    fresh float32 tensor (never a view of the file map)."""
    if len(t.shape) != 2:  # norms and biases: small, replicated on every rank
        if rows != _ALL or cols != _ALL:
            raise ValueError(f"{t.name}: a {len(t.shape)}-D tensor is read whole")
        return torch.from_numpy(_fresh(gguf_dequantize(t.data, t.type), t.data)).reshape(t.shape)
    n, k = t.shape
    r0, r1, step = rows.indices(n)
    if step != 1:
        raise ValueError(f"{t.name}: rows are read as one range, not every {step}th")
    c0, c1, _ = cols.indices(k)
    raw = byte_rows(t)
    picked = raw[r0:r1] if t.rows is None else raw[t.rows[r0:r1]]  # fancy index: a copy
    if r1 <= r0 or c1 <= c0:
        return torch.zeros((max(r1 - r0, 0), max(c1 - c0, 0)))
    span = column_bytes(t, cols)
    if span is None:
        log.info(
            "%s: columns %d:%d cut through %s blocks of %d values: dequantizing its rows whole, "
            "then slicing",
            t.name,
            c0,
            c1,
            t.type.name,
            GGML_QUANT_SIZES[t.type][0],
        )
        values = gguf_dequantize(np.ascontiguousarray(picked), t.type)[:, c0:c1]
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(r1 - r0, c1 - c0)
    part = np.ascontiguousarray(picked[:, span])  # only these bytes of the map are read
    values = _fresh(gguf_dequantize(part, t.type), raw)
    return torch.from_numpy(values).reshape(r1 - r0, c1 - c0)


def _fresh(values: np.ndarray, mapped: np.ndarray) -> np.ndarray:
    """`values`, copied if it is still the read-only file map (F32 dequantizes to a view)."""
    return values.copy() if np.may_share_memory(values, mapped) else values


class TensorPart:
    """A GGUF tensor indexed as a safetensors slice is (what `take_shard` takes): `[a:b]` reads
    rows, `[:, c:d]` columns, `[:]` all of it; each read dequantizes only its part."""

    def __init__(self, t: GGUFTensor) -> None:
        self.tensor = t

    def __getitem__(self, key: slice | tuple[slice, slice]) -> torch.Tensor:
        if isinstance(key, tuple):
            rows, cols = key
            return read(self.tensor, rows, cols)
        return read(self.tensor, key)
