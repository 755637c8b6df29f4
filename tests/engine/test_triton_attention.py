"""The Triton paged-attention backend against the PyTorch one: under Triton's interpreter on a
CPU, compiled for the GPU where one is (the same cases, the same tolerances).

Random ragged batches (decode rows of 1 to ~3k context, on and off block and partition
boundaries; prefill chunks with and without cached context; both mixed) for GQA ratios 1, 3,
4 and 8, head dims 64 and 128, fp32/bf16/fp16 and 8-bit (int8, fp8 e4m3) caches. A 16/32-bit
cache is checked against `TorchPagedAttention` in the same dtype; an 8-bit one against
`TorchPagedAttention` in fp32 over the dequantized cache. The measured errors are printed at
the end of the module. Kernels run in Python under the interpreter: tensors stay small.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

pytest.importorskip("triton")

from controlplane.engine.attention.backend import SeqSpan
from controlplane.engine.attention.torch_paged import TorchPagedAttention
from controlplane.engine.attention.triton import (
    PARTITION,
    TritonPagedAttention,
    ensure_interpreter_on_cpu,
)
from controlplane.engine.kv_cache import KVCache, KVCacheSpec, dequantize_kv, quantize_kv

CPU = torch.device("cpu")
# Where the kernels run: natively on a GPU, else interpreted on the CPU.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Max |triton - reference| / max |reference|, per case label. 16/32-bit: both sides round to
# the dtype (bf16 keeps 8 mantissa bits: ~4e-3 per rounding near the max). 8-bit: the
# reference is fp32 over the same dequantized codes, so only the query dtype's rounding counts.
TOLERANCE = {
    "float32": 1e-5,
    "float16": 4e-3,
    "bfloat16": 3e-2,
    "int8 kv, bf16 q": 2e-2,
    "fp8_e4m3 kv, fp16 q": 4e-3,
    # Against TorchPagedAttention over an 8-bit KVCache, which rounds dequantized K/V to q's
    # dtype before its attention: one more rounding of the query dtype than the kernels.
    "int8 kv, bf16 q (torch)": 3e-2,
    "fp8_e4m3 kv, fp16 q (torch)": 4e-3,
}
MEASURED: dict[str, float] = {}

# (context length, new rows): decode rows first, longest first, as the runner orders them.
# 600 splits into two partitions, 512 fills one exactly, 48 ends on a block boundary, 1 is a
# one-token context; the chunks: a whole prompt, a chunk on cached context, a chunk whose
# cached part ends mid-block.
MIXED = [(600, 1), (512, 1), (48, 1), (17, 1), (1, 1), (37, 37), (150, 20), (70, 64)]


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not MEASURED:
        return
    lines = ["", "triton attention: max |error| / max |reference| (tolerance)"]
    lines += [f"  {k:28s} {e:.2e}  ({TOLERANCE[k]:.0e})" for k, e in sorted(MEASURED.items())]
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(lines))


@dataclass
class QuantKV:
    """Random 8-bit cache content with KVCache's attributes (codes plus one fp32 scale per
    slot and kv head, what the Triton backend reads), filled without writing every slot."""

    spec: KVCacheSpec
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scale: list[torch.Tensor]
    v_scale: list[torch.Tensor]

    @classmethod
    def random(cls, spec: KVCacheSpec, num_blocks: int, gen: torch.Generator) -> QuantKV:
        shape = (num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        k, ks = quantize_kv(torch.randn(shape, generator=gen).to(DEV), spec.dtype)
        v, vs = quantize_kv(torch.randn(shape, generator=gen).to(DEV), spec.dtype)
        return cls(spec, [k], [v], [ks], [vs])


def _spans(ctx_rows: list[tuple[int, int]], bs: int, gen: torch.Generator) -> list[SeqSpan]:
    """Spans over shuffled blocks 1.. (block 0 is the tables' padding, never a sequence's)."""
    need = [-(-ctx // bs) for ctx, _ in ctx_rows]
    blocks = (torch.randperm(sum(need) + 3, generator=gen) + 1).tolist()
    spans, used = [], 0
    for (ctx, rows), n in zip(ctx_rows, need, strict=True):
        spans.append(SeqSpan(rows, ctx, blocks[used : used + n]))
        used += n
    return spans


def _qkv(
    rows: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q [rows, heads, dim], k and v [rows, kv_heads, dim]; `fused`: as views of one
    [rows, heads + 2 * kv_heads, dim] tensor (a fused QKV projection's split: row-strided)."""
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen).to(DEV, dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return (q, k, v) if fused else (q.contiguous(), k.contiguous(), v.contiguous())


def _record(label: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and torch.isfinite(out).all()
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    MEASURED[label] = max(MEASURED.get(label, 0.0), err)
    assert err <= TOLERANCE[label], f"{label}: {err:.2e} > {TOLERANCE[label]:.0e}"


def _check_16bit(
    ctx_rows: list[tuple[int, int]],
    *,
    dtype: torch.dtype,
    group: int,
    kv_heads: int,
    dim: int,
    bs: int,
    seed: int = 0,
    max_blocks_per_seq: int | None = None,
    fused: bool = False,
) -> TritonPagedAttention:
    gen = torch.Generator().manual_seed(seed)
    spans = _spans(ctx_rows, bs, gen)
    num_blocks = max(max(s.block_table) for s in spans) + 1
    caches = [KVCache(KVCacheSpec(1, kv_heads, dim, bs, dtype), num_blocks, 0, DEV) for _ in "ab"]
    k0 = torch.randn(caches[0].k[0].shape, generator=gen).to(DEV, dtype)
    v0 = torch.randn(caches[0].v[0].shape, generator=gen).to(DEV, dtype)
    k0[:bs] = v0[:bs] = 5.0  # padding block: any unmasked read of it shows in the output
    for c in caches:
        c.k[0].copy_(k0)
        c.v[0].copy_(v0)
    rows = sum(r for _, r in ctx_rows)
    q, k, v = _qkv(rows, group * kv_heads, kv_heads, dim, dtype, gen, fused)
    ref_backend = TorchPagedAttention(caches[0])
    backend = TritonPagedAttention(caches[1], max_blocks_per_seq)
    ref = ref_backend.forward(0, q, k, v, ref_backend.prepare(spans, DEV))
    out = backend.forward(0, q, k, v, backend.prepare(spans, DEV))
    assert out.dtype == dtype
    assert torch.equal(caches[0].k[0], caches[1].k[0])
    assert torch.equal(caches[0].v[0], caches[1].v[0])
    _record(str(dtype).removeprefix("torch."), out, ref)
    return backend


# group -> (kv heads, block size): H = group * kv heads <= 8; block sizes 8, 16, 32 all used.
LAYOUTS = {1: (2, 16), 3: (2, 8), 4: (2, 32), 8: (1, 16)}


@pytest.mark.parametrize("group", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_batch_matches_torch_backend(dtype: torch.dtype, group: int) -> None:
    kv_heads, bs = LAYOUTS[group]
    # Head dims alternate so that every dtype meets both 64 and 128.
    dim = 128 if (group in (3, 8)) != (dtype == torch.float16) else 64
    _check_16bit(MIXED, dtype=dtype, group=group, kv_heads=kv_heads, dim=dim, bs=bs, seed=group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_one_partition(dtype: torch.dtype) -> None:
    """Short contexts: one partition, the decode kernel writes the output itself. Inputs are
    row-strided views, as a fused QKV projection gives them."""
    rows = [(PARTITION, 1), (200, 1), (64, 1), (9, 1), (2, 1)]
    backend = _check_16bit(rows, dtype=dtype, group=4, kv_heads=2, dim=64, bs=16, fused=True)
    assert backend.prepare(_spans(rows, 16, torch.Generator()), DEV).num_partitions == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_only(dtype: torch.dtype) -> None:
    rows = [(100, 100), (33, 1 + 32), (300, 7), (129, 128)]
    _check_16bit(rows, dtype=dtype, group=3, kv_heads=2, dim=64, bs=16, seed=5, fused=True)


def test_fixed_block_table_width() -> None:
    """`max_blocks_per_seq` (the CUDA-graph shape): tables padded to it, the decode grid sized
    from it (3 partitions for 1536 tokens, two of them empty for these rows)."""
    rows = [(300, 1), (16, 1), (50, 10)]
    backend = _check_16bit(rows, dtype=torch.float32, group=4, kv_heads=2, dim=64, bs=16,
                           max_blocks_per_seq=96)  # fmt: skip
    meta = backend.prepare(_spans(rows, 16, torch.Generator()), DEV)
    assert meta.block_tables.shape == (3, 96) and meta.num_partitions == 3


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts(dtype: torch.dtype) -> None:
    rows = [(3001, 1), (2048, 1), (2500, 64)]
    _check_16bit(rows, dtype=dtype, group=4, kv_heads=1, dim=128, bs=16, seed=7)


# -- 8-bit cache -------------------------------------------------------------------------------

QUANT_CASES = {
    "int8 kv, bf16 q": (torch.int8, torch.bfloat16),
    "fp8_e4m3 kv, fp16 q": (torch.float8_e4m3fn, torch.float16),
}


def _check_8bit(label: str, ctx_rows: list[tuple[int, int]], group: int, dim: int) -> None:
    kv_dtype, q_dtype = QUANT_CASES[label]
    gen = torch.Generator().manual_seed(group * dim)
    bs, kv_heads = 16, 2
    spans = _spans(ctx_rows, bs, gen)
    num_blocks = max(max(s.block_table) for s in spans) + 1
    kv = QuantKV.random(KVCacheSpec(1, kv_heads, dim, bs, kv_dtype), num_blocks, gen)
    q, k, v = _qkv(sum(r for _, r in ctx_rows), group * kv_heads, kv_heads, dim, q_dtype, gen)
    backend = TritonPagedAttention(kv)  # type: ignore[arg-type]
    meta = backend.prepare(spans, DEV)
    out = backend.forward(0, q, k, v, meta)
    assert out.dtype == q_dtype
    # Reference: fp32 attention over the dequantized cache (the new rows as the kernel stored
    # them, which test_write_8bit checks against quantize_kv).
    ref_kv = KVCache(KVCacheSpec(1, kv_heads, dim, bs, torch.float32), num_blocks, 0, DEV)
    ref_kv.k[0].copy_(dequantize_kv(kv.k[0], kv.k_scale[0], torch.float32))
    ref_kv.v[0].copy_(dequantize_kv(kv.v[0], kv.v_scale[0], torch.float32))
    ref_backend = TorchPagedAttention(ref_kv)
    slots = meta.slot_mapping
    ref = ref_backend.forward(
        0, q.float(), ref_kv.k[0][slots], ref_kv.v[0][slots], ref_backend.prepare(spans, DEV)
    )
    _record(label, out, ref)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("label", sorted(QUANT_CASES))
def test_8bit_cache_matches_dequantized_reference(label: str, group: int, dim: int) -> None:
    _check_8bit(label, MIXED, group, dim)


@pytest.mark.slow
def test_8bit_long_context() -> None:
    _check_8bit("int8 kv, bf16 q", [(2900, 1), (1200, 40)], group=3, dim=64)


# -- the write kernel and the quantize contract --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_16bit_touches_only_its_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    kv = KVCache(KVCacheSpec(2, 3, 64, 8, dtype), 6, 0, DEV)
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in (*kv.k, *kv.v)]
    slots = torch.tensor([5, 40, -1, 17, 0, 47], device=DEV)  # -1: a padding row, written nowhere
    _, k, v = _qkv(6, 3, 3, 64, dtype, gen)
    TritonPagedAttention(kv).write_kv(1, k, v, slots)
    keep = slots >= 0
    for i, (new, old) in enumerate(zip((*kv.k, *kv.v), before, strict=True)):
        expected = old.clone()
        if i % 2:  # layer 1 of k (index 1) and of v (index 3)
            expected[slots[keep]] = (k if i == 1 else v)[keep]
        assert torch.equal(new, expected)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_write_8bit_is_quantize_kv(kv_dtype: torch.dtype, x_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    spec = KVCacheSpec(1, 3, 128, 16, kv_dtype)
    kv = QuantKV.random(spec, 4, gen)
    before = [t.clone() for t in (kv.k[0], kv.v[0], kv.k_scale[0], kv.v_scale[0])]
    slots = torch.tensor([3, 63, 20, -1, 21], device=DEV)
    _, k, v = _qkv(5, 3, 3, 128, x_dtype, gen)
    k = k * torch.logspace(-3, 3, 5).to(DEV, x_dtype)[:, None, None]  # scales over 6 decades
    k[2, 1] = 0  # all-zero head: codes 0 (scale FLT_MIN)
    TritonPagedAttention(kv).write_kv(0, k, v, slots)  # type: ignore[arg-type]
    keep = slots >= 0
    for x, codes, scales, old_codes, old_scales in (
        (k, kv.k[0], kv.k_scale[0], before[0], before[2]),
        (v, kv.v[0], kv.v_scale[0], before[1], before[3]),
    ):
        want_codes, want_scales = quantize_kv(x[keep], kv_dtype)
        assert torch.equal(codes[slots[keep]].view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(scales[slots[keep]], want_scales)
        untouched = torch.ones(codes.shape[0], dtype=torch.bool, device=DEV)
        untouched[slots[keep]] = False
        assert torch.equal(
            codes[untouched].view(torch.uint8), old_codes[untouched].view(torch.uint8)
        )
        assert torch.equal(scales[untouched], old_scales[untouched])
    assert not kv.k[0][20, 1].float().any()


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_codes_round_like_torch(kv_dtype: torch.dtype) -> None:
    """Ties and edge values through the kernel's rounding. Each row's max is qmax, so the scale
    is 1 and the codes must be torch's own rounding of the inputs. int8: every integer and
    every half in range. fp8: every e4m3 value, the values just under each, the midpoints
    between neighbours (ties go to even) and values around the smallest subnormal."""
    if kv_dtype == torch.int8:
        qmax, values = 127.0, torch.arange(-254, 255) / 2
    else:
        grid = torch.arange(127, dtype=torch.uint8).view(kv_dtype).float()  # +0 .. 448
        mids = (grid[:-1] + grid[1:]) / 2
        tiny = torch.tensor([2.0**-10, 2.0**-10 * 1.01, 2.0**-11, 3 * 2.0**-10])
        values = torch.cat([grid, mids, tiny, grid.nextafter(torch.tensor(0.0))[1:]])
        qmax, values = 448.0, torch.cat([values, -values])
    rows = -(-values.numel() // 127)
    x = torch.zeros(rows * 127)
    x[: values.numel()] = values
    x = torch.cat([torch.full((rows, 1), qmax), x.view(rows, 127)], 1).view(rows, 1, 128).to(DEV)
    kv = QuantKV.random(KVCacheSpec(1, 1, 128, 8, kv_dtype), -(-rows // 8), torch.Generator())
    slots = torch.arange(rows, device=DEV)
    TritonPagedAttention(kv).write_kv(0, x, x, slots)  # type: ignore[arg-type]
    assert torch.equal(kv.k_scale[0][:rows], torch.ones(rows, 1, device=DEV))
    want = (x.round() if kv_dtype == torch.int8 else x).to(kv_dtype)
    assert torch.equal(kv.k[0][:rows].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantize_round_trip_bound(kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-4, 4, 64)[:, None, None]
    x[0] = 0
    codes, scale = quantize_kv(x, kv_dtype)
    err = (dequantize_kv(codes, scale, torch.float32) - x).abs()
    s = scale.unsqueeze(-1)
    if kv_dtype == torch.int8:
        # Half a step, plus the float error of x / scale and of the product back.
        bound = s * 0.5 * (1 + 1e-5)
    else:
        # e4m3: 3 mantissa bits (half-ulp 2^-4 relative); subnormals step by 2^-9 * scale.
        bound = x.abs() * 2**-4 + s * 2**-10
    assert (err <= bound).all()
    assert codes.float().abs().amax(-1)[1:].min() >= (127 if kv_dtype == torch.int8 else 448)
    assert not codes[0].float().any() and not dequantize_kv(codes, scale, torch.float32)[0].any()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """8-bit tensors as bytes (CPU copies and comparisons lack float8); others as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("label", sorted(QUANT_CASES))
def test_8bit_kvcache_matches_torch_backend(label: str) -> None:
    """Both backends over a real 8-bit KVCache: the same bytes written, outputs within the
    query dtype's rounding (torch dequantizes K/V to it; the kernels scale in fp32)."""
    kv_dtype, q_dtype = QUANT_CASES[label]
    gen = torch.Generator().manual_seed(8)
    spans = _spans(MIXED, 16, gen)
    num_blocks = max(max(s.block_table) for s in spans) + 1
    spec = KVCacheSpec(1, 2, 64, 16, kv_dtype)
    caches = [KVCache(spec, num_blocks, 0, DEV) for _ in "ab"]
    init = QuantKV.random(spec, num_blocks, gen)
    for c in caches:
        for name in ("k", "v", "k_scale", "v_scale"):
            _raw(getattr(c, name)[0]).copy_(_raw(getattr(init, name)[0]))
    q, k, v = _qkv(sum(r for _, r in MIXED), 8, 2, 64, q_dtype, gen)
    ref_backend, backend = TorchPagedAttention(caches[0]), TritonPagedAttention(caches[1])
    ref = ref_backend.forward(0, q, k, v, ref_backend.prepare(spans, DEV))
    out = backend.forward(0, q, k, v, backend.prepare(spans, DEV))
    for name in ("k", "v", "k_scale", "v_scale"):
        assert torch.equal(_raw(getattr(caches[0], name)[0]), _raw(getattr(caches[1], name)[0]))
    _record(f"{label} (torch)", out, ref)


@pytest.mark.skipif(DEV.type == "cuda", reason="the interpreter is for a CPU")
def test_ensure_interpreter_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    ensure_interpreter_on_cpu(CPU)  # already on: nothing to do
    monkeypatch.delenv("TRITON_INTERPRET")
    ensure_interpreter_on_cpu(torch.device("cuda"))  # a GPU compiles the kernels
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ensure_interpreter_on_cpu(CPU)  # too late: triton is imported


def test_prepare_builds_the_step_tensors() -> None:
    bs = 16
    spans = _spans(MIXED, bs, torch.Generator().manual_seed(4))
    kv = KVCache(KVCacheSpec(1, 2, 64, bs, torch.float32), 64, 0, DEV)
    meta = TritonPagedAttention(kv).prepare(spans, DEV)
    torch_meta = TorchPagedAttention(kv).prepare(spans, DEV)
    assert torch.equal(meta.slot_mapping, torch_meta.slot_mapping)
    assert meta.num_decodes == 5 and meta.num_partitions == 2 and meta.max_query_len == 64
    assert meta.query_start.tolist() == [0, 1, 2, 3, 4, 5, 42, 62, 126]
    assert meta.seq_lens.tolist() == [c for c, _ in MIXED]
    assert meta.block_tables.shape == (len(MIXED), 600 // bs + 1)
    for row, span in zip(meta.block_tables.tolist(), spans, strict=True):
        n = -(-span.context_len // bs)
        assert row[:n] == span.block_table[:n] and not any(row[n:])
    assert [(p.start, p.end, p.context_len) for p in meta.prefills] == [
        (p.start, p.end, p.context_len) for p in torch_meta.prefills
    ]
