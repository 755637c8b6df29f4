"""The Triton kernels of the weight-only quantized linears on a GPU (the wrappers that pack the
weights, pick a variant and launch these: triton_linear.py).

Five kernels:

- `int4_kernel`: W4A16, the int4 values packed eight to an int32 in *nibble planes* (below),
  unpacked to the dot dtype (exact: 0..15) and multiplied as they are in `tl.dot`, float32
  sums; each group's (scale, zero) (weights.py's convention, w = (q - 8) * scale + zero)
  applies once to its sums: s * sum(x q) + (z - 8 s) * sum(x), never to each weight.
- `int4_gemv_kernel`: the same sums for one row a program on the CUDA cores (one user's
  decode, a few): tl.dot would pay for 16 rows and move each unpacked tile into its operand
  layout; the products accumulate elementwise and are summed across the plane once.
- `int4_dequant_kernel`: the weight itself, w = (q - 8) s + z, written [K, N] in the
  activations' dtype, for many-row calls that then run as one dense matmul.
- `int8_kernel`: W8A16, the int8 (or float8 e4m3) weight as stored ([N, K], one row per
  output feature), widened to the dot dtype (exact: |q| <= 127; e4m3's values all lie in
  bf16 and fp16), summed in float32, times the row's float32 scale at the end.
- `splitk_reduce_kernel`: the split-K variant's second pass: the partial sums of every split
  added in a fixed order (so a result does not depend on which program finished first, as an
  atomic add's would), times the int8 scales, rounded once to the output dtype.

Both weight kernels serve both variants: with `SPLIT` a program sums one slice of K for one
tile of outputs into a float32 partial (`partial[split, m, n]`), without it a program sums all
of K and writes the output.

Nibble planes. The int4 weight is stored as int32 words [K / 8, N] (N contiguous, so a tile
of words is one coalesced read per K row). K is cut into periods of PERIOD = 8 * PLANE input
features; in period t, word t * PLANE + j holds in its nibble i (bits 4i..4i+3) the value of
input feature k = t * PERIOD + i * PLANE + j. So nibble i of a [PLANE, BLOCK_N] tile of words
is the weight of PLANE *consecutive* input features: a shift and a mask unpack it into a tile
`tl.dot` takes as is, against the activations' columns i * PLANE .. i * PLANE + PLANE - 1 (no
interleave or reshape in registers, which is where Triton kernels on packed int4 lose time).
PLANE = 16 is `tl.dot`'s smallest K; the group size is a multiple of it and divides or fills a
period, so each plane lies in one group, and a group's planes are consecutive.

K need not be a multiple of anything: the weight is zero-padded to whole periods at load and
the activations' columns past K are masked to zero, so they are never padded per call.

On a CPU the kernels run under Triton's interpreter (tests only), with CPU tensors; Triton
3.9's interpreter multiplies bf16 tiles as their raw bits, so there the dot dtype is float32
(triton_linear.dot_dtype). This module imports triton lazily (`jit_kernels`), after
`ensure_interpreter_on_cpu`, like engine/attention/triton_kernels.py.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the kernels' annotations; at run time `jit_kernels` binds it
    import triton.language as tl

PLANE = 16  # input features per nibble plane: tl.dot's smallest K
PERIOD = 8 * PLANE  # input features per period of PLANE int32 words

_KERNEL_NAMES = (
    "_cast",
    "_period_words",
    "_scale_zero",
    "_int4_period",
    "int4_kernel",
    "int4_gemv_kernel",
    "int4_dequant_kernel",
    "int8_kernel",
    "splitk_reduce_kernel",
)
_jitted = False


def _cast(v, ty: tl.constexpr, RNE: tl.constexpr):
    # float32 -> ty. Triton 3.9's interpreter converts float32 to bf16 by truncation, where a
    # GPU (and torch) rounds to nearest even: with RNE, round the bits first (interpreter).
    if RNE and ty == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        v = b.to(tl.float32, bitcast=True)
    return v.to(ty)


def _period_words(packed, t, j, n, n_ok, stride_pk, PLANE: tl.constexpr):
    # Period t's PLANE words (j: arange(PLANE)) for columns n: [PLANE, len(n)] int32, each
    # row one coalesced read.
    words_at = packed + (t * PLANE + j)[:, None] * stride_pk + n[None, :]
    return tl.load(words_at, mask=n_ok[None, :], other=0)


def _scale_zero(sz, k0, n, n_ok, stride_sg, stride_sn, GROUP: tl.constexpr):
    # The (scale, zero) pair, as float32, of the group holding input feature k0, for columns n.
    group = sz + (k0 // GROUP) * stride_sg + n * stride_sn
    scale = tl.load(group, mask=n_ok, other=0.0).to(tl.float32)
    return scale, tl.load(group + 1, mask=n_ok, other=0.0).to(tl.float32)


def _int4_period(
    acc, x, packed, sz, t, m, n, m_ok, n_ok, K, stride_xm, stride_pk, stride_sg, stride_sn,
    GROUP: tl.constexpr, GROUP_PLANES: tl.constexpr, PLANE: tl.constexpr,
    DOT_TY: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # One period: PLANE words per output column, eight planes of PLANE input features each.
    # The int4 values (exact in any float dtype) go into the dot as they are; each group's
    # scale and zero apply to its sums once (GROUP_PLANES planes a group, at most 8):
    #   sum_k x_k ((q_k - 8) s + z) = s * sum_k x_k q_k + (z - 8 s) * sum_k x_k
    # so a weight costs a shift, a mask and a conversion, not a dequantization in registers.
    j = tl.arange(0, PLANE)
    words = _period_words(packed, t, j, n, n_ok, stride_pk, PLANE)
    part = tl.zeros_like(acc)
    xsum = tl.sum(part, axis=1)
    for i in tl.static_range(8):
        k = t * (8 * PLANE) + i * PLANE + j
        xi = tl.load(
            x + m[:, None] * stride_xm + k[None, :],
            mask=m_ok[:, None] & (k < K)[None, :],
            other=0.0,
        ).to(DOT_TY)
        q = ((words >> (4 * i)) & 15).to(DOT_TY)
        part += tl.dot(xi, q, input_precision=PRECISION)
        xsum += tl.sum(xi.to(tl.float32), axis=1)
        if (i + 1) % GROUP_PLANES == 0:
            k0 = t * (8 * PLANE) + i * PLANE
            scale, zero = _scale_zero(sz, k0, n, n_ok, stride_sg, stride_sn, GROUP)
            acc += part * scale[None, :] + xsum[:, None] * (zero - 8.0 * scale)[None, :]
            part = tl.zeros_like(acc)
            xsum = tl.sum(part, axis=1)
    return acc


def int4_kernel(
    x, packed, sz, out, partial, M, N, K, periods, periods_per_split,
    stride_xm, stride_pk, stride_sg, stride_sn, stride_om,
    GROUP: tl.constexpr, GROUP_PLANES: tl.constexpr, PLANE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_TY: tl.constexpr,
    PRECISION: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    # Grid (row tiles, column tiles, splits): row tiles vary fastest, so the programs running
    # at once share their weight tile (read from memory once) rather than their activations.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t0 = pid_s * periods_per_split
    t1 = tl.minimum(t0 + periods_per_split, periods)
    for t in range(t0, t1):
        acc = _int4_period(
            acc, x, packed, sz, t, m, n, m_ok, n_ok, K, stride_xm, stride_pk, stride_sg,
            stride_sn, GROUP, GROUP_PLANES, PLANE, DOT_TY, PRECISION,
        )  # fmt: skip
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(partial + (pid_s * M + m[:, None]) * N + n[None, :], acc, mask=mask)
    else:
        y = _cast(acc, out.dtype.element_ty, RNE)
        tl.store(out + m[:, None] * stride_om + n[None, :], y, mask=mask)


def int4_gemv_kernel(
    x, packed, sz, out, partial, M, N, K, periods, periods_per_split,
    stride_xm, stride_pk, stride_sg, stride_sn, stride_om,
    GROUP: tl.constexpr, GROUP_PLANES: tl.constexpr, PLANE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    # Grid (rows, column tiles, splits): one row a program; a few rows' programs read the same
    # weight tile at about the same time (once from memory, then from L2). Every product is
    # accumulated elementwise in a [PLANE, BLOCK_N] tile, the scales applied elementwise at
    # each group's end, and the PLANE axis summed once at the end: no reduction across threads
    # inside the loop.
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    j = tl.arange(0, PLANE)
    total = tl.zeros((PLANE, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((PLANE, BLOCK_N), dtype=tl.float32)
    xg = tl.zeros((PLANE,), dtype=tl.float32)  # the group's activations, feature by feature
    t0 = pid_s * periods_per_split
    t1 = tl.minimum(t0 + periods_per_split, periods)
    for t in range(t0, t1):
        words = _period_words(packed, t, j, n, n_ok, stride_pk, PLANE)
        for i in tl.static_range(8):
            k = t * (8 * PLANE) + i * PLANE + j
            xi = tl.load(x + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            part += xi[:, None] * ((words >> (4 * i)) & 15).to(tl.float32)
            xg += xi
            if (i + 1) % GROUP_PLANES == 0:
                k0 = t * (8 * PLANE) + i * PLANE
                scale, zero = _scale_zero(sz, k0, n, n_ok, stride_sg, stride_sn, GROUP)
                total += part * scale[None, :] + xg[:, None] * (zero - 8.0 * scale)[None, :]
                part = tl.zeros_like(part)
                xg = tl.zeros_like(xg)
    acc = tl.sum(total, axis=0)
    if SPLIT:
        tl.store(partial + (pid_s * M + m) * N + n, acc, mask=n_ok)
    else:
        tl.store(out + m * stride_om + n, _cast(acc, out.dtype.element_ty, RNE), mask=n_ok)


def int4_dequant_kernel(
    packed, sz, out, N, stride_pk, stride_sg, stride_sn, stride_ok,
    GROUP: tl.constexpr, PLANE: tl.constexpr, BLOCK_N: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    # Grid (periods, column tiles): one period of PLANE words a column, written as its
    # 8 * PLANE rows of the [K, N] weight (N contiguous, as the words are: coalesced both ways).
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    j = tl.arange(0, PLANE)
    words = _period_words(packed, t, j, n, n_ok, stride_pk, PLANE)
    for i in tl.static_range(8):
        k0 = t * (8 * PLANE) + i * PLANE
        scale, zero = _scale_zero(sz, k0, n, n_ok, stride_sg, stride_sn, GROUP)
        q = ((words >> (4 * i)) & 15).to(tl.float32)
        w = (q - 8.0) * scale[None, :] + zero[None, :]
        at = out + (k0 + j)[:, None] * stride_ok + n[None, :]
        tl.store(at, _cast(w, out.dtype.element_ty, RNE), mask=n_ok[None, :])


def int8_kernel(
    x, w, scale, out, partial, M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    DOT_TY: tl.constexpr, PRECISION: tl.constexpr, RNE: tl.constexpr, W_ZERO: tl.constexpr,
):  # fmt: skip
    # W_ZERO: the masked weights' value in the weight's own type (0 for int8, 0.0 for e4m3:
    # the interpreter casts no int to float8).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_hi
        xk = tl.load(x + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :])
        # [BLOCK_K, BLOCK_N] of the [N, K] weight: K is the contiguous axis of the tile.
        wk = tl.load(
            w + n[None, :] * stride_wn + k[:, None],
            mask=k_ok[:, None] & n_ok[None, :],
            other=W_ZERO,
        )
        acc += tl.dot(xk.to(DOT_TY), wk.to(DOT_TY), input_precision=PRECISION)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(partial + (pid_s * M + m[:, None]) * N + n[None, :], acc, mask=mask)
    else:
        acc = acc * tl.load(scale + n, mask=n_ok, other=0.0)[None, :]
        y = _cast(acc, out.dtype.element_ty, RNE)
        tl.store(out + m[:, None] * stride_om + n[None, :], y, mask=mask)


def splitk_reduce_kernel(
    partial, scale, out, M, N, splits, stride_om,
    HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    # partial: [splits, M, N] float32, contiguous; out: [M, N] rows `stride_om` apart.
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (m < M)[:, None] & (n < N)[None, :]
    offs = m[:, None] * N + n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(partial + s * M * N + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        acc = acc * tl.load(scale + n, mask=n < N, other=0.0)[None, :]
    y = _cast(acc, out.dtype.element_ty, RNE)
    tl.store(out + m[:, None] * stride_om + n[None, :], y, mask=mask)


def jit_kernels() -> None:
    """Import triton and jit the kernels above (once), binding `tl` for their bodies."""
    global _jitted
    if _jitted:
        return
    import triton
    import triton.language

    module = globals()
    module["tl"] = triton.language
    for name in _KERNEL_NAMES:
        # The row count varies with every step: one compiled kernel for all of them (Triton
        # would otherwise compile again for 1 row and for multiples of 16).
        rows = ["M"] if "M" in inspect.signature(module[name]).parameters else None
        module[name] = triton.jit(module[name], do_not_specialize=rows)
    _jitted = True
