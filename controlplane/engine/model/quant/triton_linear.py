"""Weight-only quantized linears in Triton, for NVIDIA GPUs: W4A16 (int4 groups, `int4_triton`)
and W8A16 (int8 rows, `int8_triton`), bf16 or fp16 activations, float32 sums, output in the
activations' dtype. torch's kernels for these formats read fewer bytes than bf16 but ran slower
than it on an H100 (docs/models.md); these exist to make the quantized weights pay there.

What is here: the int4 packing (`pack_int4` / `unpack_int4`: nibble planes, see
triton_linear_kernels.py), the choice of variant (`plan`), the launches (`run_int4`,
`run_int8`), the same as custom ops a compiled graph calls as is (`int4_linear`, `w8a16_linear`:
torch.compile does not trace into the launch, and the grid may differ per row count without
splitting the graph), and whether they can serve (`unavailable`, `int4_unavailable`).

The variants (`plan` picks one per call, by row count, format and device):

* `gemv`, int4 only, for up to GEMV_MAX_ROWS rows (one user's decode, a few): split-K's work
  split, one row a program, float32 products on the CUDA cores instead of `tl.dot`
  (`int4_gemv_kernel`): at one row the tl.dot variant was slower than bf16 where torch's
  tinygemm was faster (H200, docs/benchmarks.md#gpu-seeds);
* `split_k`, for up to SPLIT_K_MAX_ROWS rows (decode): all rows in one 16-row tile (tl.dot's
  smallest), K cut into splits so that about four programs per SM stream the weight, each
  writing float32 partial sums, which a second pass adds in a fixed order (deterministic,
  unlike atomics) and rounds once. At a few rows a linear is the time to read its weight once:
  a grid of output tiles alone (64 programs for 4096 outputs) would leave half of an H100's
  132 SMs idle, each streaming all of K.
* `tiles`, for more rows (int8's prompt chunks and large batches): a GEMM of 32- to 128-row
  tiles, each weight tile widened once for all their rows; K is split only while the tiles
  alone would not fill the SMs once (the partials' bytes grow with the rows, the weight's do
  not);
* `dequant`, int4 from SPLIT_K_MAX_ROWS + 1 rows: the weight written out in the activations'
  dtype by one kernel, then one dense matmul (cuBLAS). int4 tiles ran well below bf16 at 32
  and 64 rows and made a 2K prompt's TTFT many times bf16's (same run); writing the weight
  moves 2.5 bytes a weight, about one more bf16 read, so a decode step of many rows should
  take about twice bf16's time and a prompt about bf16's (not yet measured on a device).

Triton is imported lazily (on the first launch), so the package imports without it; on a CPU
(tests) the kernels run under Triton's interpreter, with CPU tensors.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from controlplane.engine.attention.triton_kernels import ensure_interpreter_on_cpu
from controlplane.engine.model.quant import triton_linear_kernels as tk
from controlplane.engine.model.quant.triton_linear_kernels import PERIOD, PLANE

__all__ = [
    "GEMV_MAX_ROWS",
    "INT8_BLOCK_K",
    "PERIOD",
    "PLANE",
    "SPLIT_K_MAX_ROWS",
    "Launch",
    "dequantize_int4",
    "int4_linear",
    "int4_unavailable",
    "pack_int4",
    "plan",
    "run_int4",
    "run_int8",
    "unavailable",
    "unpack_int4",
    "w8a16_linear",
]

# Rows up to which a call takes the split-K variant: one 16-row tile holds them all, so the
# weight is read once; beyond, a second row tile would read it again (see the module doc).
SPLIT_K_MAX_ROWS = 16
# Rows up to which an int4 call takes `gemv`: its CUDA-core products grow with every row,
# tl.dot's do not until 16.
GEMV_MAX_ROWS = 4
GEMV_BLOCK_N = 128
DEQUANT_BLOCK_N = 128
INT8_BLOCK_K = 128  # int8 input features per step: 128 bytes of a weight row
# Programs one "wave" stands for under the interpreter (no SMs): small, so that the tests'
# small shapes still split K.
_INTERPRETER_SMS = 4


@dataclass(frozen=True, slots=True)
class Launch:
    """How one call runs: its variant, tile sizes and how K is split (in K steps: int4
    periods of PERIOD features, int8 blocks of INT8_BLOCK_K)."""

    variant: str  # gemv | split_k | tiles | dequant
    block_m: int
    block_n: int
    splits: int
    steps_per_split: int
    num_warps: int = 4
    num_stages: int = 3


def plan(
    rows: int, out_features: int, k_steps: int, device: torch.device, int4: bool = False
) -> Launch:
    """The variant and tiles for `rows` rows of a linear with `out_features` outputs and
    `k_steps` K steps on `device` (the module doc says why): for int4, gemv up to
    GEMV_MAX_ROWS rows and dequant beyond SPLIT_K_MAX_ROWS; split-K up to SPLIT_K_MAX_ROWS
    rows, about four programs per SM; tiles beyond, K split only to fill the SMs once."""
    sms = _sm_count(device)
    if int4 and rows > SPLIT_K_MAX_ROWS:
        return Launch("dequant", 0, DEQUANT_BLOCK_N, 1, k_steps)
    if rows <= SPLIT_K_MAX_ROWS:  # gemv shares split-K's work split, one row a program
        gemv = int4 and rows <= GEMV_MAX_ROWS
        variant, block_m, block_n = ("gemv", 1, GEMV_BLOCK_N) if gemv else ("split_k", 16, 64)
        warps = 4
        tiles = _cdiv(out_features, block_n)
        splits = _cdiv(4 * sms, tiles)
    else:
        variant = "tiles"
        block_m = 32 if rows <= 32 else 64 if rows <= 64 else 128
        # 64 columns: an int4 tile holds two float32 [block_m, block_n] sums (the group's and
        # the total), which at 128 x 128 would not fit in registers.
        block_n = 64
        warps = 8 if block_m == 128 else 4
        tiles = _cdiv(rows, block_m) * _cdiv(out_features, block_n)
        splits = sms // tiles
    splits = max(1, min(splits, k_steps))
    per_split = _cdiv(k_steps, splits)
    return Launch(variant, block_m, block_n, _cdiv(k_steps, per_split), per_split, warps)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return _INTERPRETER_SMS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- can they serve --------------------------------------------------------------------------


def unavailable(device: torch.device) -> str | None:
    """Why the Triton linears cannot serve on `device`, or None. Off CUDA triton is never
    imported (importing it would fix interpreter-or-not for the process)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    return _triton_missing()


@functools.cache
def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # not installed, or installed but broken
        return f"triton does not import ({type(exc).__name__}: {str(exc)[:120]})"
    return None


def int4_unavailable(device: torch.device, group_size: int) -> str | None:
    """`unavailable`, and whether int4 groups of `group_size` fit the nibble planes: whole
    planes of PLANE features, and periods of PERIOD features that a group divides or fills
    (0: not known yet, not checked)."""
    why = unavailable(device)
    tiles = not group_size or not (
        group_size % PLANE or (PERIOD % group_size and group_size % PERIOD)
    )
    if why is None and not tiles:
        why = f"group size {group_size} does not tile {PERIOD}-feature periods of {PLANE}"
    return why


# -- int4 packing ----------------------------------------------------------------------------


def pack_int4(qvalues: torch.Tensor) -> torch.Tensor:
    """int4 values [N, K] (0..15; K a multiple of PERIOD) -> int32 words [K / 8, N] in nibble
    planes: word t * PLANE + j of column n holds, in nibble i, the value of input feature
    t * PERIOD + i * PLANE + j."""
    n, k = qvalues.shape
    if k % PERIOD:
        raise ValueError(f"in_features {k} is not a multiple of {PERIOD} (pad first)")
    q = qvalues.to(torch.int64).view(n, k // PERIOD, 8, PLANE)
    shifts = (4 * torch.arange(8, device=q.device)).view(1, 1, 8, 1)
    words = (q << shifts).sum(dim=2)  # [n, periods, PLANE], in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.view(n, k // 8).t().contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: int32 values [N, K]."""
    k8, n = packed.shape
    words = packed.t().reshape(n, k8 // PLANE, 1, PLANE)
    shifts = (4 * torch.arange(8, device=packed.device, dtype=torch.int32)).view(1, 1, 8, 1)
    return ((words >> shifts) & 15).reshape(n, k8 * 8)


# -- launches --------------------------------------------------------------------------------


def _prepare(x: torch.Tensor) -> dict[str, object]:
    """Triton ready for `x`'s device; the kernels' dot dtype, precision and rounding."""
    ensure_interpreter_on_cpu(x.device)
    tk.jit_kernels()
    tl = tk.tl  # bound by jit_kernels
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter multiplies bf16 tiles as raw bits (and numpy's fp16 products may
        # round): float32 there, exact for 16-bit inputs; and it truncates float32 to bf16,
        # so the kernels round the bits themselves (RNE) as a GPU's conversion does.
        return dict(DOT_TY=tl.float32, PRECISION="ieee", RNE=True)
    if x.dtype == torch.float32:  # IEEE float32 products, not tf32
        return dict(DOT_TY=tl.float32, PRECISION="ieee", RNE=False)
    return dict(
        DOT_TY=getattr(tl, str(x.dtype).removeprefix("torch.")), PRECISION="tf32", RNE=False
    )


def _check(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] > k:
        raise ValueError(f"x must be [rows, <= {k}] (got {list(x.shape)})")
    return x if x.stride(1) == 1 else x.contiguous()


def _reduce(
    partial: torch.Tensor,
    scale: torch.Tensor | None,
    out: torch.Tensor,
    launch: Launch,
    how: dict[str, object],
) -> None:
    m, n = out.shape
    grid = (_cdiv(m, 16), _cdiv(n, 128))
    tk.splitk_reduce_kernel[grid](
        partial, out if scale is None else scale, out, m, n, launch.splits, out.stride(0),
        HAS_SCALE=scale is not None, BLOCK_M=16, BLOCK_N=128, RNE=how["RNE"],
    )  # fmt: skip


def run_int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    launch: Launch | None = None,
) -> torch.Tensor:
    """x [rows, K] @ the int4 weight ([N, K'] packed by `pack_int4`, K <= K': the weight's
    padding meets masked zeros), scales_and_zeros [K' / group_size, N, 2] (weights.py's
    layout) -> [rows, N] in x's dtype. `launch`: `plan`'s choice unless given (tests)."""
    periods, n = packed.shape[0] // PLANE, packed.shape[1]
    x = _check(x, periods * PERIOD)
    rows, k = x.shape
    if not rows:
        return x.new_empty(rows, n)
    launch = launch or plan(rows, n, periods, x.device, int4=True)
    if launch.variant == "dequant":
        # The weight's rows past K meet no activation: the matmul takes the first K.
        return x @ dequantize_int4(packed, scales_and_zeros, group_size, x.dtype)[:k]
    out = x.new_empty(rows, n)
    split = launch.splits > 1
    partial = x.new_empty(launch.splits, rows, n, dtype=torch.float32) if split else out
    how = _prepare(x)
    grid = (_cdiv(rows, launch.block_m), _cdiv(n, launch.block_n), launch.splits)
    args = (
        x, packed, scales_and_zeros, out, partial, rows, n, k, periods, launch.steps_per_split,
        x.stride(0), packed.stride(0), scales_and_zeros.stride(0), scales_and_zeros.stride(1),
        out.stride(0),
    )  # fmt: skip
    shape = dict(
        GROUP=group_size, GROUP_PLANES=min(group_size, PERIOD) // PLANE, PLANE=PLANE,
        BLOCK_N=launch.block_n, SPLIT=split, num_warps=launch.num_warps,
        num_stages=launch.num_stages, RNE=how["RNE"],
    )  # fmt: skip
    if launch.variant == "gemv":  # one row a program (block_m 1)
        tk.int4_gemv_kernel[grid](*args, **shape)
    else:
        tk.int4_kernel[grid](
            *args, BLOCK_M=launch.block_m, DOT_TY=how["DOT_TY"], PRECISION=how["PRECISION"],
            **shape,
        )  # fmt: skip
    if split:
        _reduce(partial, None, out, launch, how)
    return out


def dequantize_int4(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The int4 weight packed by `pack_int4` as [K', N] in `dtype` (the transpose of the
    [N, K'] linear weight): w = (q - 8) * scale + zero in float32, rounded once."""
    periods, n = packed.shape[0] // PLANE, packed.shape[1]
    out = torch.empty(periods * PERIOD, n, dtype=dtype, device=packed.device)
    how = _prepare(out)
    grid = (periods, _cdiv(n, DEQUANT_BLOCK_N))
    tk.int4_dequant_kernel[grid](
        packed, scales_and_zeros, out, n, packed.stride(0), scales_and_zeros.stride(0),
        scales_and_zeros.stride(1), out.stride(0), GROUP=group_size, PLANE=PLANE,
        BLOCK_N=DEQUANT_BLOCK_N, RNE=how["RNE"],
    )  # fmt: skip
    return out


def run_int8(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, launch: Launch | None = None
) -> torch.Tensor:
    """x [rows, K] @ (qweight [N, K] int8 or float8_e4m3fn * scales [N] float32, per row)^T
    -> [rows, N] in x's dtype. `launch`: `plan`'s choice unless given (tests)."""
    n, k_full = qweight.shape
    x = _check(x, k_full)
    rows, k = x.shape
    if k != k_full or qweight.stride(1) != 1:
        raise ValueError(f"x must have the weight's {k_full} columns, the weight K-contiguous")
    out = x.new_empty(rows, n)
    if not rows:
        return out
    k_steps = _cdiv(k, INT8_BLOCK_K)
    launch = launch or plan(rows, n, k_steps, x.device)
    split = launch.splits > 1
    partial = x.new_empty(launch.splits, rows, n, dtype=torch.float32) if split else out
    scales = scales if scales.dtype == torch.float32 else scales.float()
    how = _prepare(x)
    grid = (_cdiv(rows, launch.block_m), _cdiv(n, launch.block_n), launch.splits)
    tk.int8_kernel[grid](
        x, qweight, scales, out, partial, rows, n, k, launch.steps_per_split * INT8_BLOCK_K,
        x.stride(0), qweight.stride(0), out.stride(0), BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n, BLOCK_K=INT8_BLOCK_K, SPLIT=split,
        W_ZERO=0.0 if qweight.is_floating_point() else 0, num_warps=launch.num_warps,
        num_stages=launch.num_stages, **how,
    )  # fmt: skip
    if split:
        _reduce(partial, scales, out, launch, how)
    return out


# -- as ops a compiled graph calls as they are --------------------------------------------------


@torch.library.custom_op("controlplane_triton::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`run_int4` as one op (Int4Linear's `int4_triton` kernel)."""
    return run_int4(x, packed, scales_and_zeros, group_size)


@int4_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int):
    return x.new_empty(x.shape[0], packed.shape[1])


@torch.library.custom_op("controlplane_triton::w8a16_linear", mutates_args=())
def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`run_int8` as one op: Int8Linear's `int8_triton` kernel, and Fp8Linear's few-row
    calls (an e4m3 weight widens to bf16 or fp16 exactly, as int8's does)."""
    return run_int8(x, qweight, scales)


@w8a16_linear.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor):
    return x.new_empty(x.shape[0], qweight.shape[0])
