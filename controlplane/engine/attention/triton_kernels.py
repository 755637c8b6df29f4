"""The Triton kernels of paged attention (the backend that launches them: triton.py).

Three kernels per layer, all reading the paged cache through a padded block table:

- `write_kv_kernel`: the step's new K/V rows into their slots (`slot_mapping`; a negative slot is
  skipped, so padded rows of a captured batch write nothing), quantizing per (slot, kv head)
  when the cache is 8-bit.
- `decode_kernel`: flash-decoding. One program per (decode row, kv head, context partition of
  PARTITION tokens); it loads the GQA group's query heads as the rows of one tile (padded to
  16 for `tl.dot`), so each K/V tile is read once per group, never expanded per query head.
  With one partition it writes the output; otherwise `reduce_kernel` merges the partitions'
  (max, sum, unnormalized acc).
- `prefill_kernel`: one program per (chunk, kv head, block of query rows); rows are (token, head of
  the group) pairs, so a K/V tile also serves the whole group. Keys come from the cache (the
  chunk's own were just written), with the causal mask on positions and an online softmax.

8-bit caches (int8, float8_e4m3fn) hold one float32 scale per slot and kv head in
`kv.k_scale[layer]` / `kv.v_scale[layer]` ([slots, kv heads]; value = stored * scale). The
kernels widen the stored codes to the query dtype (exact: |int8| <= 127 and e4m3 values are
representable in fp16/bf16), apply K's scale to the score columns after the dot and fold V's
scale into the probabilities, so the dequantized cache is never materialized. fp8 travels as
its uint8 bits, encoded and decoded in integer arithmetic (see `_fp8_encode`).
The kernel writes the bytes of `kv_cache.quantize_kv`, the torch backend's quantizer.

On a CPU the kernels run only under Triton's interpreter: `TRITON_INTERPRET=1` must be set
before triton is first imported, and the tensors must be CPU tensors. This module imports
triton lazily (`jit_kernels`, on the first `TritonPagedAttention`), after
`ensure_interpreter_on_cpu`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the kernels' annotations; at run time `jit_kernels` binds it
    import triton.language as tl

# Decode context per program: long enough that the partials and the reduce stay cheap, short
# enough that a few long sequences still spread over many programs (vLLM uses 512 as well).
PARTITION = 512
BLOCK_N = 64  # keys per tile; any multiple of 16 (tl.dot), independent of the cache block size
PREFILL_BLOCK_M = 64  # query rows ((token, group head) pairs) per prefill program


def ensure_interpreter_on_cpu(device: torch.device) -> None:
    """On a CPU, turn on Triton's interpreter (the only way its kernels run there).

    Triton reads the setting when a kernel is decorated (older versions: when triton is
    imported), so it must be on before triton is imported; if triton already was without
    it, say so rather than fail obscurely at the first launch."""
    if device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            "Triton kernels on a CPU need the interpreter, but triton was imported without "
            "TRITON_INTERPRET=1: set TRITON_INTERPRET=1 in the environment before anything "
            "imports triton"
        )
    os.environ["TRITON_INTERPRET"] = "1"


# -- kernels ------------------------------------------------------------------------------------
#
# Plain functions here, jitted by `jit_kernels` on first use: decorating at import would
# import triton (and fix interpreter-or-not) before `ensure_interpreter_on_cpu` could run.
# `tl` is bound into this module's globals at that point; the string annotations (future
# import) are what triton reads for constexpr parameters.

_KERNEL_NAMES = (
    "_fp8_encode",
    "_fp8_decode",
    "_store_kv",
    "_widen",
    "_attend_tile",
    "write_kv_kernel",
    "decode_kernel",
    "reduce_kernel",
    "prefill_kernel",
)
_jitted = False


def _fp8_encode(y):
    # float32 (|y| <= 448) -> e4m3fn bits, rounded to nearest even, in integer/fp32 arithmetic:
    # Triton has no e4m3 type before sm89, and the 3.9 interpreter's fp32 -> e4m3 conversion
    # drops the carry of a mantissa that rounds up (127.9 -> 64) and mangles subnormals.
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    # Adding 2^(E + 20) (E: a's exponent, at least -6 where e4m3 turns subnormal) leaves
    # exactly e4m3's 3 mantissa bits of a, so fp32's own rounding is the e4m3 rounding.
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)
    magic = ((e + 20) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    rb = r.to(tl.int32, bitcast=True)
    re = (rb >> 23) & 0xFF
    normal = ((re - 120) << 3) | ((rb >> 20) & 7)
    code = tl.where(re >= 121, normal, (r * 512.0).to(tl.int32))  # subnormal: r = code * 2^-9
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


def _fp8_decode(code):
    # e4m3fn bits (as uint8) -> float32; the inverse of `_fp8_encode` (NaN is never written).
    c = code.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)  # 2^-9
    return tl.where((c & 0x80) != 0, -mag, mag)


def _store_kv(src, dst, scale_dst, mask, head_mask, QUANT: tl.constexpr, QMAX: tl.constexpr):
    # An fp8 cache arrives viewed as uint8 (see `_fp8_encode`); int8 is stored as itself.
    x = tl.load(src, mask=mask, other=0.0)
    if QUANT:
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), axis=1)
        scale = tl.maximum(tl.div_rn(amax, QMAX), 1.1754943508222875e-38)  # FLT_MIN
        y = tl.minimum(tl.maximum(tl.div_rn(xf, scale[:, None]), -QMAX), QMAX)
        if dst.dtype.element_ty == tl.int8:
            # + 2^23 leaves no fraction bits: fp32's own rounding, half to even (torch.round).
            r = (tl.abs(y) + 8388608.0) - 8388608.0
            codes = tl.where(y < 0, -r, r).to(tl.int8)
        else:
            codes = _fp8_encode(y)
        tl.store(dst, codes, mask=mask)
        tl.store(scale_dst, scale, mask=head_mask)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


def write_kv_kernel(
    k, v, k_cache, v_cache, k_scale, v_scale, slots,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_ss, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
):  # fmt: skip
    # One program per row, all its kv heads at once: the 8-bit scale is a max over D per head.
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    # A bool tensor & a bool scalar comes out int32 under the interpreter (not a valid mask):
    # fold the slot check into the head count instead.
    head_mask = h < tl.where(slot >= 0, num_kv_heads, 0)
    mask = head_mask[:, None]
    dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    scale_dst = slot * stride_ss + h
    src_k = k + t * stride_kt + h[:, None] * stride_kh + d[None, :]
    src_v = v + t * stride_vt + h[:, None] * stride_vh + d[None, :]
    _store_kv(src_k, k_cache + dst, k_scale + scale_dst, mask, head_mask, QUANT, QMAX)
    _store_kv(src_v, v_cache + dst, v_scale + scale_dst, mask, head_mask, QUANT, QMAX)


def _widen(x, DOT_TY: tl.constexpr):
    # Cache values -> the dot dtype; fp8 codes (uint8) are decoded first, int8 converts as is.
    if x.dtype == tl.uint8:
        return _fp8_decode(x).to(DOT_TY)
    return x.to(DOT_TY)


def _attend_tile(
    q, m_i, l_i, acc, k_cache, v_cache, k_scale, v_scale, table_row, kv_head, pos, seq_len,
    valid, stride_cs, stride_ch, stride_ss, sm_scale,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, QUANT: tl.constexpr, DOT_TY: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # One online-softmax step over the keys at `pos` (any positions: each is looked up in the
    # block table, so a tile may span pages of any size). Scores are in log2 units.
    in_ctx = pos < seq_len
    page = tl.load(table_row + pos // PAGE, mask=in_ctx, other=0).to(tl.int64)
    slot = page * PAGE + pos % PAGE
    d = tl.arange(0, HEAD_DIM)
    offs = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
    k = _widen(tl.load(k_cache + offs, mask=in_ctx[:, None], other=0), DOT_TY)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if QUANT:
        ks = tl.load(k_scale + slot * stride_ss + kv_head, mask=in_ctx, other=0.0)
        s = s * ks[None, :]
    s = tl.where(valid, s * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _widen(tl.load(v_cache + offs, mask=in_ctx[:, None], other=0), DOT_TY)
    if QUANT:
        p = p * tl.load(v_scale + slot * stride_ss + kv_head, mask=in_ctx, other=0.0)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v, input_precision=PRECISION)
    return m_new, l_i, acc


def decode_kernel(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, out, part_m, part_l, part_acc,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_ss, stride_bt,
    sm_scale, group, num_heads, num_partitions,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr, DOT_TY: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)  # decode rows come first: row index == sequence index
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * group + g
    in_group = g < group
    q_offs = seq * stride_qt + heads[:, None] * stride_qh + d[None, :]
    qt = tl.load(q + q_offs, mask=in_group[:, None], other=0.0).to(DOT_TY)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    start = part * PARTITION
    end = tl.minimum(seq_len, start + PARTITION)  # <= start for partitions past the context
    table_row = block_tables + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        # Padding rows of the group stay unmasked: their q is 0, so their scores are finite
        # (a row masked whole would compute -inf - -inf), and they are never stored.
        valid = (pos < seq_len)[None, :]
        m_i, l_i, acc = _attend_tile(
            qt, m_i, l_i, acc, k_cache, v_cache, k_scale, v_scale, table_row, kv_head, pos,
            seq_len, valid, stride_cs, stride_ch, stride_ss, sm_scale,
            HEAD_DIM, PAGE, QUANT, DOT_TY, PRECISION,
        )  # fmt: skip
    if SPLIT:
        # Unnormalized: an empty partition leaves (-inf, 0, 0), which `reduce_kernel` weighs as 0.
        idx = (seq * num_heads + heads) * num_partitions + part
        tl.store(part_m + idx, m_i, mask=in_group)
        tl.store(part_l + idx, l_i, mask=in_group)
        tl.store(part_acc + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=in_group[:, None])
    else:
        o = acc / l_i[:, None]
        o_offs = seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out + o_offs, o.to(out.dtype.element_ty), mask=in_group[:, None])


def reduce_kernel(
    part_m, part_l, part_acc, out, stride_ot, stride_oh, num_heads, num_partitions,
    HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, HEAD_DIM)
    in_range = p < num_partitions
    idx = (seq * num_heads + head) * num_partitions + p
    m = tl.load(part_m + idx, mask=in_range, other=float("-inf"))
    l_p = tl.load(part_l + idx, mask=in_range, other=0.0)
    acc = tl.load(
        part_acc + idx[:, None] * HEAD_DIM + d[None, :], mask=in_range[:, None], other=0.0
    )
    # All partitions in one tile: PARTITION = 512 keeps that to 128 x D floats at 64k tokens.
    w = tl.exp2(m - tl.max(m, axis=0))  # partition 0 always holds a key: the max is finite
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_p * w, axis=0)
    tl.store(out + seq * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty))


def prefill_kernel(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start, out,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_ss, stride_bt,
    sm_scale, group, tokens_per_block, first_seq,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr, DOT_TY: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq = first_seq + tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_start = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    tok = q_block * tokens_per_block + r // group
    heads = kv_head * group + r % group
    row_ok = (r < tokens_per_block * group) & (tok < q_len)
    q_pos = seq_len - q_len + tok  # the chunk is the context's tail
    rows = (q_start + tok).to(tl.int64)
    q_offs = rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    qt = tl.load(q + q_offs, mask=row_ok[:, None], other=0.0).to(DOT_TY)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys up to the block's last query position; none for blocks past the chunk (the grid is
    # sized for the longest chunk). Every row sees key 0, so no row's max stays -inf.
    last_tok = tl.minimum((q_block + 1) * tokens_per_block, q_len)
    kv_end = tl.where(q_block * tokens_per_block < q_len, seq_len - q_len + last_tok, 0)
    table_row = block_tables + seq.to(tl.int64) * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = (pos[None, :] <= q_pos[:, None]) & (pos < seq_len)[None, :]
        m_i, l_i, acc = _attend_tile(
            qt, m_i, l_i, acc, k_cache, v_cache, k_scale, v_scale, table_row, kv_head, pos,
            seq_len, valid, stride_cs, stride_ch, stride_ss, sm_scale,
            HEAD_DIM, PAGE, QUANT, DOT_TY, PRECISION,
        )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out + o_offs, o.to(out.dtype.element_ty), mask=row_ok[:, None])


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
        module[name] = triton.jit(module[name])
    _jitted = True


def dot_dtype(dtype: torch.dtype) -> Any:
    """The dtype tiles are multiplied in. Triton 3.9's interpreter multiplies bf16 tiles as
    their raw uint16 bits, so under it bf16 is widened to fp32 (exact: bf16 products fit)."""
    tl = globals()["tl"]  # bound by `jit_kernels`
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return getattr(tl, str(dtype).removeprefix("torch."))


def next_pow2(n: int) -> int:
    """Smallest power of two >= n: Triton's tile sizes."""
    return 1 << max(0, n - 1).bit_length()
