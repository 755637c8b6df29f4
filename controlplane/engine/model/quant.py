"""Weight-only quantized linears: INT8 per output channel (W8A16), INT4 group-wise (W4A16).

Weights are quantized once at load, from the float weights the loader produced, and stay packed;
activations stay in the model dtype. Each module picks its kernel once, at construction:

* CPU: `torch._weight_int8pack_mm` (int8 [N, K] + per-channel scales) and
  `torch._weight_int4pack_mm_for_cpu` on a weight packed by
  `torch._convert_weight_to_int4pack_for_cpu`. Both beat dequantize-then-matmul and the float
  linears at batch-1 decode here (benchmarks/quant_kernels.py; README "Quantization"). Int4
  steps of `Int4Linear.many_rows` rows or more (and of one row, `Int4Linear.one_row`, where it
  won) take our `int4_linear` (csrc/int4_linear.cpp) on the same packed weight: torch's results
  bit for bit, faster there. Where the CPU has AVX512-BF16, every int4 step takes our
  `int4_linear_bf16` instead (`Int4Linear.bf16_dot`, engine.bf16_dot): the int4 values
  times the bf16 activations in VDPBF16PS dot products, summed per group, then scaled; where
  it also has AMX tiles (Sapphire Rapids on), in TDPBF16PS tile products instead, again at
  every row count (`Int4Linear.amx`).
  Int8 steps take our `int8_linear` (csrc/int8_linear.cpp) where it built: the weight read
  once per call for all rows, float32 sums. With `engine.quantize_activations`, int4 linears
  and the int8 lm_head take our `w4a8_linear` / `w8a8_linear` instead
  (csrc/int8_activations.cpp): int8 activations, integer sums.
* CUDA: `torch._weight_int8pack_mm` and tinygemm's `torch._weight_int4pack_mm` (bf16
  activations): correct on an H100 (tests/engine/test_quant_gpu.py), slower than bf16 there
  (docs/models.md).
* Anywhere else, or where a kernel rejects the shape or dtype: dequantize, then `F.linear`.

INT4 uses tinygemm's convention on both devices: w = (q - 8) * scale + zero, q in [0, 15], one
(scale, zero) pair per `group_size` consecutive input features of an output row. Asymmetric
(min/max) groups: the zero point costs nothing in the kernel and halves the rounding error of
groups whose values are not centred on zero.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from controlplane.engine.kernels import cpu_ops
from controlplane.engine.model.linear import cpu_packing_supported, packed_matmul
from controlplane.engine.settings import QUANTIZATIONS
from controlplane.engine.types import MemoryUse

log = logging.getLogger(__name__)

_CPU_INT4_ROWS = 16  # _convert_weight_to_int4pack_for_cpu wants N % 16 == 0
_CUDA_INT4_ROWS = 8
_CUDA_INNER_K_TILES = 8  # tinygemm: K % (inner_k_tiles * 16) == 0
_TINY = 1e-12  # an all-zero row or group keeps a finite scale


@dataclass(frozen=True, slots=True)
class Int8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]: w ~= qweight * scales[:, None]

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None].float()


@dataclass(frozen=True, slots=True)
class Int4Weight:
    qvalues: torch.Tensor  # int32 [N, K], values in [0, 15]: one per weight, not yet packed
    scales_and_zeros: torch.Tensor  # float32 [K / group_size, N, 2] (tinygemm's layout)
    group_size: int

    def dequantize(self) -> torch.Tensor:
        k = self.qvalues.shape[1]
        scales = self.scales_and_zeros[..., 0].t().repeat_interleave(self.group_size, dim=1)
        zeros = self.scales_and_zeros[..., 1].t().repeat_interleave(self.group_size, dim=1)
        return (self.qvalues.float() - 8) * scales[:, :k] + zeros[:, :k]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per output channel, in [-127, 127] (so -128 is never used): each row rounded on
    the grid of its largest value (max |w| / 127), then twice: its scale refitted by least
    squares (<w, q> / <q, q>) and the row rounded again on it; the scale refitted at the end.

    Why: a row's scale from its maximum leaves the row's dequantized size off by a little, and
    a tied lm_head turns that straight into the logits' temperature. SmolLM2's int8 lm_head
    (and embedding) came out at +0.21% and +0.51% of the float head's perplexity in two runs
    whose int4 layers rounded differently (VDPBF16PS / AMX); refitted, +0.06% and +0.15%, for
    a few more passes over the weight at load (int8 linears: 39.308 -> 39.318, noise). Each
    step lowers the row's squared error."""
    w = weight.detach().float()
    q = torch.round(w / (w.abs().amax(dim=1, keepdim=True).clamp(min=_TINY) / 127))
    for _ in range(2):
        scales = _least_squares_scale(w, q)
        q = torch.round(w / scales).clamp_(-127, 127)
    return Int8Weight(q.to(torch.int8), _least_squares_scale(w, q)[:, 0])


def _least_squares_scale(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The per-row scale s minimizing |w - s q|^2 ([rows, 1]; tiny for all-zero rows)."""
    return ((w * q).sum(1, keepdim=True) / (q * q).sum(1, keepdim=True).clamp(min=1)).clamp(
        min=_TINY
    )


def quantize_int4(weight: torch.Tensor, group_size: int, symmetric: bool = False) -> Int4Weight:
    """Group-wise over input features. K must be a multiple of `group_size` (pad first)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    if symmetric:
        scales = w.abs().amax(dim=-1).clamp(min=_TINY) / 7
        q = torch.round(w / scales[..., None]).clamp_(-8, 7) + 8
        zeros = torch.zeros_like(scales)
    else:
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scales = (hi - lo).clamp(min=_TINY) / 15
        q = torch.round((w - lo[..., None]) / scales[..., None]).clamp_(0, 15)
        zeros = lo + 8 * scales  # (q - 8) * scale + zero == q * scale + lo
    qvalues = q.to(torch.int32).reshape(n, k)
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
    return Int4Weight(qvalues, scales_and_zeros, group_size)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def kernel_dtype(device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the packed kernels run fast in on `device`.

    On x86 CPUs torch vectorizes `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` (AVX2
    and AVX512) only for bfloat16 activations, converting them to float32 in registers, so
    they need no native bf16: measured here, W8 with float32 activations ran 10-16x slower
    than with bf16 ones, in both the AVX512 and the AVX2 builds of the kernels. Elsewhere
    (other CPUs, the fallback) the model dtype is kept. On CUDA torch's int8 kernel takes
    float16 and bfloat16; tinygemm (int4) takes bfloat16 only (Int4Linear asks for it).
    """
    if device.type == "cuda":
        return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if device.type == "cpu" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return torch.bfloat16
    return model_dtype


def _kernel_input(x: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    if x2.dtype != dtype:
        return x2.to(dtype)  # a fresh, aligned tensor
    # The CPU int8 kernel reads activation rows with aligned vector loads. (A compiled graph
    # cannot read pointers; its buffers come from the same 64-byte-aligned CPU allocator.)
    if not x2.is_contiguous() or (not torch.compiler.is_compiling() and x2.data_ptr() % 64):
        return x2.clone(memory_format=torch.contiguous_format)
    return x2


class Int8Linear(nn.Module):
    """W8A16: int8 weights, one scale per output channel, 16-bit activations in the kernel
    (W8A8 with the `w8a8_cpu` kernel: engine.quantize_activations)."""

    # From this many rows (prefill chunks) on, dequantizing the weight once and running the
    # float GEMM beats the packed kernel, whose speed stays per row (README "Quantization").
    dequant_min_rows = 64

    def __init__(
        self,
        weight: Int8Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        kernel: str = "",
        float_scales: bool = False,
        bf16_dot: bool = True,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.qweight.shape
        device = weight.qweight.device
        self.kernel = kernel or _int8_kernel(device, self.in_features)
        ours = self.kernel in ("int8_cpu", "w8a8_cpu")
        # bf16 activations through VDPBF16PS where the CPU has it (int8_linear_bf16).
        self.bf16_dot = bf16_dot and self.kernel == "int8_cpu" and cpu_ops.bf16_dot_available()
        # Ours takes the model's activations as they are (float32 sums either way).
        keep = ours or self.kernel == "dequant"
        self.act_dtype = dtype if keep else kernel_dtype(device, dtype)
        self.register_buffer("qweight", weight.qweight)
        # float_scales (the lm_head): torch's kernel runs with unit scales and the float32 ones
        # multiply its output (ours takes float32 scales always). Rounded to bf16 (8 mantissa
        # bits) a row's scale is off by up to 0.4%, the same for every logit of that token: on
        # SmolLM2 perplexity rose 0.59% with bf16 scales, 0.44-0.49% with float32 ones through
        # torch's kernel, 0.47% through ours (tests/data/perplexity.txt).
        scales_dtype = torch.float32 if float_scales or ours else self.act_dtype
        self.register_buffer("scales", weight.scales.to(scales_dtype))
        unit = (
            torch.ones_like(self.scales, dtype=self.act_dtype)
            if float_scales and not ours
            else None
        )
        self.register_buffer("_unit", unit, persistent=False)
        self.bias = None if bias is None else bias.detach().to(dtype)
        if ours and float_scales:
            # A wide lm_head makes the dequantized GEMM costly (its 28M weights converted and
            # a [rows, 49152] output scaled): ours wins up to ~200 rows. Measured (SmolLM2's,
            # 2 threads, Xeon; ms, ours / dequantized): 32 rows 10.4 / 24.9, 128 rows 33.0 /
            # 40.7, 256 rows 77.6 / 62.7. So every prompt chunk of up to 128 rows (the default
            # chunk) gets its logits from one kernel, however it was split.
            self.dequant_min_rows = 256

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.numel() // self.in_features
        if self.kernel == "dequant" or rows >= self.dequant_min_rows:
            # The int8 values are exact in any float dtype; the scales multiply the output in
            # float32, never rounded to a 16-bit dtype (see float_scales above).
            y = F.linear(x.reshape(rows, self.in_features), self.qweight.to(x.dtype))
            y = (y.float() * self.scales.float()).to(x.dtype)
        elif self.kernel == "int8_cpu":
            x2 = x.reshape(rows, self.in_features)
            op = torch.ops.controlplane_cpu.int8_linear
            if self.bf16_dot and x2.dtype == torch.bfloat16:
                op = torch.ops.controlplane_cpu.int8_linear_bf16
            y = op(x2, self.qweight, self.scales).to(x.dtype)
        elif self.kernel == "w8a8_cpu":
            x2 = x.reshape(rows, self.in_features)
            y = torch.ops.controlplane_cpu.w8a8_linear(x2, self.qweight, self.scales).to(x.dtype)
        elif self._unit is not None:
            x2 = _kernel_input(x, self.in_features, self.act_dtype)
            y = torch._weight_int8pack_mm(x2, self.qweight, self._unit).float() * self.scales
            y = y.to(x.dtype)
        else:
            x2 = _kernel_input(x, self.in_features, self.act_dtype)
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"kernel={self.kernel}, act_dtype={self.act_dtype}"
        )


class Int8Embedding(nn.Module):
    """An embedding table held as int8 rows with one scale each; a lookup dequantizes only the
    rows it gathers. A tied embedding shares the lm_head's Int8Linear table (no float copy)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.dtype = dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids].float() * self.scales[ids].float().unsqueeze(-1)
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8, dtype={self.dtype}"


def _int8_kernel(device: torch.device, k: int) -> str:
    if device.type == "cpu" and cpu_ops.available():  # ours (csrc/int8_linear.cpp)
        return "int8_cpu"
    if not hasattr(torch, "_weight_int8pack_mm") or device.type not in ("cpu", "cuda"):
        return "dequant"
    # The CPU kernel's bf16 path reads rows with aligned 16-element loads: with K % 16 != 0
    # it crashes the process (SIGSEGV, torch 2.13).
    if device.type == "cpu" and k % 16:
        return "dequant"
    return "int8pack_mm"


class Int4Linear(nn.Module):
    """W4A16: 4-bit weights, a (scale, zero) pair per group of input features (W4A8 with the
    `w4a8_cpu` kernel: engine.quantize_activations, csrc/int8_activations.cpp).

    With `dense`, on a CPU that packs bf16 for oneDNN, the module also keeps its dequantized
    weights (the int4 values times their scales, in bf16) packed for oneDNN, for steps of
    `dense_min_rows` rows or more: torch's int4 CPU kernel dequantizes its weight again for
    every few rows, so its cost grows with each row, while a bf16 GEMM's barely does. Measured
    here (2 cores, AVX512-BF16, 30 distinct weights in turn so that none stays in cache), us a
    call, int4 / bf16 copy: 576 -> 3072 at 1 row 32 / 78, 8 rows 102 / 96, 16 rows 196 / 132,
    32 rows 369 / 190; 576 -> 960 at 8 rows 29 / 36, 16 rows 55 / 45; a 512-token prompt
    chunk ran 1.7x faster end to end. The copy costs 2 bytes a weight (4x the int4 bytes).
    """

    # 16: at 8 rows the int4 kernel still wins on three of SmolLM2's four shapes, at 16 the
    # copy wins on all four (above).
    dense_min_rows = 16
    # From this many rows on, our `int4_linear` (csrc/int4_linear.cpp: the same results bit
    # for bit, each weight panel dequantized once per call instead of once per 4 rows) takes
    # the step. Where it pays depends on the CPU, so each process measures it once
    # (int4_many_rows; this is the default where it cannot): on a Xeon (2 threads; us a
    # call, torch's kernel / ours) 576 -> 3072 at 16 rows 489 / 337, 33 rows 1096 / 667, 512
    # rows 15517 / 7340; on an AMD EPYC ours was 0.82-0.97x torch's at 16 rows, 0.88-1.01x at
    # 32, 1.02-1.18x from 128 (benchmarks/int4_linear.py).
    many_rows = 16
    # Whether a one-row step (one user's decode) takes ours too: on an AVX2 EPYC its one-row
    # path dequantizes in registers, 0.99-1.14x torch's on SmolLM2's shapes (1.06x summed over
    # them, weights from memory); elsewhere it has none and loses (measured per process,
    # int4_one_row).
    one_row = False

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
        dtype: torch.dtype,
        kernel: str = "",
        dense: bool = False,
        bf16_dot: bool = True,
        amx: bool = True,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        device = weight.device
        self.kernel = kernel or _int4_kernel(device)
        if self.kernel == "w4a8_cpu" and group_size % A8_GROUP:
            self.kernel = "int4pack_mm_cpu"
        self.act_dtype = kernel_dtype(device, dtype) if self.kernel != "dequant" else dtype
        if self.kernel == "int4pack_mm_cuda":
            # tinygemm takes bf16 only: a float16 model's activations failed in it (H100).
            self.act_dtype = torch.bfloat16
        rows = {"int4pack_mm_cpu": _CPU_INT4_ROWS, "int4pack_mm_cuda": _CUDA_INT4_ROWS}
        cols = _CUDA_INNER_K_TILES * 16 if self.kernel == "int4pack_mm_cuda" else group_size
        # Zero rows / columns pad the weight to the shapes the kernels accept; padded columns
        # meet zero-padded activations, padded rows are sliced off the output.
        self.padded_out = _round_up(self.out_features, rows.get(self.kernel, 1))
        self.padded_in = _round_up(self.in_features, max(cols, group_size))
        w = F.pad(
            weight.detach().float(),
            (0, self.padded_in - self.in_features, 0, self.padded_out - self.out_features),
        )
        q = quantize_int4(w, group_size)
        if self.kernel == "w4a8_cpu":
            # A (scale, min) pair per 32 input features, float16 (GGUF Q4_1's own numbers).
            repeat = group_size // A8_GROUP
            scales = q.scales_and_zeros[..., 0].t().repeat_interleave(repeat, dim=1)
            zeros = q.scales_and_zeros[..., 1].t().repeat_interleave(repeat, dim=1)
            self.register_buffer("scales", scales.half().contiguous())
            # q * scale + min == (q - 8) * scale + zero
            self.register_buffer("mins", (zeros - 8 * scales).half().contiguous())
        else:
            self.register_buffer("scales_and_zeros", q.scales_and_zeros.to(self.act_dtype))
        self.register_buffer("packed", _pack_int4(q.qvalues, self.kernel))
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.dense: torch.Tensor | None = None  # oneDNN's opaque layout (see the class doc)
        self.dense_native = False  # packed_matmul's `native`
        bf16 = torch.bfloat16
        cpu_bf16 = self.kernel in ("int4pack_mm_cpu", "w4a8_cpu") and self.act_dtype == bf16
        if dense and cpu_bf16 and cpu_packing_supported(bf16):
            # The kernel's own weights: its scales and zeros applied to the int4 values.
            self.dense = torch.ops.mkldnn._reorder_linear_weight(
                self._dequantize(q.qvalues).to(bf16), None
            )
            self.dense_native = cpu_ops.available()
        # (block_n, split) of torch's packed layout, for our many-row kernel; None: torch's.
        torch_cpu = self.kernel == "int4pack_mm_cpu" and self.act_dtype == bf16
        self.layout = _int4_layout() if torch_cpu and self.dense is None else None
        # Every row count through AVX512-BF16 dot products, or none (batch invariance).
        self.bf16_dot = bf16_dot and self.layout is not None and int4_bf16_dot_available()
        # and through AMX tiles where the CPU has them, again for every row count.
        self.amx = amx and self.bf16_dot and int4_amx_available()
        if self.layout is not None and not self.bf16_dot:
            self.many_rows = int4_many_rows()
            self.one_row = int4_one_row()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.numel() // self.in_features
        w4a8 = self.kernel == "w4a8_cpu" and (self.dense is None or rows < self.dense_min_rows)
        # W4A8 takes the model's dtype (it quantizes the activations itself).
        x2 = _kernel_input(x, self.in_features, x.dtype if w4a8 else self.act_dtype)
        if self.padded_in != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in - self.in_features))
        if w4a8:
            y = torch.ops.controlplane_cpu.w4a8_linear(x2, self.packed, self.scales, self.mins)
        elif self.dense is not None and rows >= self.dense_min_rows:
            y = packed_matmul(x2, self.dense, None, self.padded_out, self.dense_native)
        elif self.bf16_dot:
            y = torch.ops.controlplane_cpu.int4_linear_bf16(
                x2, self.packed, self.scales_and_zeros, self.group_size, *self.layout, self.amx
            )
        elif self.layout is not None and (rows >= self.many_rows or (rows == 1 and self.one_row)):
            y = torch.ops.controlplane_cpu.int4_linear(
                x2, self.packed, self.scales_and_zeros, self.group_size, *self.layout
            )
        elif self.kernel == "int4pack_mm_cpu":
            y = torch._weight_int4pack_mm_for_cpu(
                x2, self.packed, self.group_size, self.scales_and_zeros
            )
        elif self.kernel == "int4pack_mm_cuda":
            y = torch._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = F.linear(x2, self.dequantize().to(x2.dtype))
        y = y.to(x.dtype)
        if self.padded_out != self.out_features:
            y = y[:, : self.out_features].contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The padded float32 weight; torch's kernels' layouts are opaque."""
        if self.kernel == "w4a8_cpu":
            groups = self.packed.view(self.padded_out, -1, 1, A8_GROUP // 2)
            q = torch.cat((groups & 15, groups >> 4), dim=2).view(self.padded_out, -1)
        elif self.kernel == "dequant":
            q = torch.stack((self.packed & 15, self.packed >> 4), dim=-1).view(self.padded_out, -1)
        else:
            raise RuntimeError(f"kernel {self.kernel} keeps an opaque layout")
        return self._dequantize(q.int())

    def _dequantize(self, q: torch.Tensor) -> torch.Tensor:
        if self.kernel == "w4a8_cpu":
            scales = self.scales.float().repeat_interleave(A8_GROUP, dim=1)
            return q.float() * scales + self.mins.float().repeat_interleave(A8_GROUP, dim=1)
        return Int4Weight(q, self.scales_and_zeros.float(), self.group_size).dequantize()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, kernel={self.kernel}, act_dtype={self.act_dtype}"
        )


@functools.cache
def _int4_layout() -> tuple[int, bool] | None:
    """The (block_n, split) arguments of `int4_linear` for the layout this torch packs int4
    weights in on this CPU (csrc/int4_linear.cpp), or None where our kernels are not built or
    do not return torch's kernel's results bit for bit: checked once per process on a weight
    of one full and one partial block, so another torch or CPU keeps torch's kernel."""
    if not cpu_ops.available():
        return None
    # torch's BLOCK_N is 4 float vectors; its AVX512 and AVX2 kernels split full blocks.
    layout = {"AVX512": (64, True), "AVX2": (32, True)}.get(
        torch.backends.cpu.get_cpu_capability(), (32, False)
    )
    x, packed, scales, group = _int4_probe(layout[0])
    ours = torch.ops.controlplane_cpu.int4_linear(x, packed, scales, group, *layout)
    if not torch.equal(ours, torch._weight_int4pack_mm_for_cpu(x, packed, group, scales)):
        log.warning("our int4 kernel does not match torch's on this CPU; keeping torch's")
        return None
    return layout


def _int4_probe(block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(x, packed, scales, group) for the start-up checks of our int4 kernels: 7 rows against
    a weight of one full and one partial block of `block_n` rows, group 64, bf16 scales."""
    gen = torch.Generator().manual_seed(0)
    n, k, group = block_n + 48, 256, 64
    q = quantize_int4(torch.randn(n, k, generator=gen), group)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.qvalues, 2)
    scales = q.scales_and_zeros.to(torch.bfloat16)
    x = torch.randn(7, k, generator=gen).to(torch.bfloat16)
    return x, packed, scales, group


@functools.cache
def int4_bf16_dot_available() -> bool:
    """Whether `int4_linear_bf16` serves here: our kernels built for AVX512, on a CPU with
    AVX512-BF16, and its results within bf16 rounding of torch's kernel (checked once per
    process, on the weight `_int4_layout` checks)."""
    layout = _int4_layout()
    if layout is None or layout[0] != 64 or not cpu_ops.bf16_dot_available():
        return False
    return _int4_bf16_agrees_with_torch(layout, amx=False)


@functools.cache
def int4_amx_available() -> bool:
    """Whether `int4_linear_bf16` can take its AMX tiles here (`amx=True`): a CPU with
    AMX-BF16 whose kernel lets this process use them, and the tiles' results within bf16
    rounding of torch's kernel (checked once per process, as `int4_bf16_dot_available`)."""
    if not int4_bf16_dot_available() or not torch.ops.controlplane_cpu.amx_supported():
        return False
    return _int4_bf16_agrees_with_torch(_int4_layout(), amx=True)


def _int4_bf16_agrees_with_torch(layout: tuple[int, bool], amx: bool) -> bool:
    """Whether `int4_linear_bf16` (its tiles with `amx`) gives torch's kernel's results within
    bf16 rounding on the start-up probe weight; warns when it does not."""
    x, packed, scales, group = _int4_probe(layout[0])
    ours = torch.ops.controlplane_cpu.int4_linear_bf16(x, packed, scales, group, *layout, amx)
    ref = torch._weight_int4pack_mm_for_cpu(x, packed, group, scales).float()
    if not torch.allclose(ours.float(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item()):
        kind = "AMX" if amx else "bf16-dot"
        log.warning("our %s int4 kernel disagrees with torch's on this CPU; not using it", kind)
        return False
    return True


# Where our int4 kernel may take over: at 16 or 32 rows (decode batches; a compiled decode
# graph splits there), else from 64 (prompt chunks only).
MANY_ROWS_CHOICES = (16, 32, 64)


def pick_many_rows(timings: dict[int, tuple[float, float]]) -> int:
    """The fewest rows, of MANY_ROWS_CHOICES, from which ours is faster: `timings` maps a row
    count to (torch's time, ours) at it; the last choice when ours never wins."""
    for rows in MANY_ROWS_CHOICES[:-1]:
        torch_s, ours_s = timings[rows]
        if ours_s < torch_s:
            return rows
    return MANY_ROWS_CHOICES[-1]


@functools.cache
def _int4_timings() -> dict[int, tuple[float, float]]:
    """Both kernels timed once per process (~10 ms) on a SmolLM2-sized weight (576 -> 1536,
    group 32), best of 10 calls at 1, 16 and 32 rows: {rows: (torch's seconds, ours)}; empty
    where ours does not serve."""
    layout = _int4_layout()
    if layout is None:
        return {}
    gen = torch.Generator().manual_seed(0)
    n, k, group = 1536, 576, 32
    q = quantize_int4(torch.randn(n, k, generator=gen), group)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.qvalues, 2)
    scales = q.scales_and_zeros.to(torch.bfloat16)

    def best(fn, x) -> float:
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
        return min(times)

    timings = {}
    for rows in (1, *MANY_ROWS_CHOICES[:-1]):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        timings[rows] = (
            best(lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, group, scales), x),
            best(
                lambda x: torch.ops.controlplane_cpu.int4_linear(x, packed, scales, group, *layout),
                x,
            ),
        )
    log.info(
        "int4: torch's kernel / ours, us: %s",
        ", ".join(f"{r} rows {a * 1e6:.0f} / {b * 1e6:.0f}" for r, (a, b) in timings.items()),
    )
    return timings


def int4_many_rows() -> int:
    """Int4Linear.many_rows on this machine (from _int4_timings)."""
    timings = _int4_timings()
    return pick_many_rows(timings) if timings else Int4Linear.many_rows


def int4_one_row() -> bool:
    """Int4Linear.one_row on this machine: whether ours beat torch's at one row (it does where
    it has a one-row path, csrc/int4_linear.cpp's AVX2 build)."""
    torch_s, ours_s = _int4_timings().get(1, (0.0, 0.0))
    return ours_s < torch_s


# Input features per int8 activation scale in csrc/int8_activations.cpp (GGUF's Q8_1 block).
A8_GROUP = 32


def int8_activations_available() -> bool:
    """Whether our int8-activation kernels (engine.quantize_activations) serve on this CPU:
    where our kernels are built for AVX2 or AVX512 (their integer dot products are AVX2's;
    elsewhere they would run a scalar loop, slower than torch's kernels)."""
    simd = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return simd and cpu_ops.available()


def _a8(weight: torch.Tensor, wanted: bool) -> bool:
    """Whether a linear of `weight` takes int8 activations (their groups: 32 input features)."""
    cpu = weight.device.type == "cpu" and weight.shape[1] % A8_GROUP == 0
    return wanted and cpu and int8_activations_available()


def _int8_activated(module: nn.Module) -> bool:
    return getattr(module, "kernel", "") in ("w4a8_cpu", "w8a8_cpu")


def _int4_kernel(device: torch.device) -> str:
    if device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return "int4pack_mm_cpu"
    if device.type == "cuda" and hasattr(torch, "_weight_int4pack_mm"):
        return "int4pack_mm_cuda"
    return "dequant"


def _pack_int4(qvalues: torch.Tensor, kernel: str) -> torch.Tensor:
    if kernel == "int4pack_mm_cpu":
        return torch._convert_weight_to_int4pack_for_cpu(qvalues, 2)
    if kernel == "int4pack_mm_cuda":
        # tinygemm's CUDA packer takes two values a byte, the even-indexed one high.
        pairs = (qvalues[:, ::2] << 4 | qvalues[:, 1::2]).to(torch.uint8)
        return torch._convert_weight_to_int4pack(pairs, _CUDA_INNER_K_TILES)
    if kernel == "w4a8_cpu":  # per 32 values: k = j low nibble, k = 16 + j high (GGUF's Q4_1)
        halves = qvalues.to(torch.uint8).view(qvalues.shape[0], -1, 2, A8_GROUP // 2)
        return (halves[:, :, 0] | halves[:, :, 1] << 4).flatten(1).contiguous()
    # The fallback keeps two values a byte too (low nibble first): memory is the point.
    return (qvalues[:, ::2] | qvalues[:, 1::2] << 4).to(torch.uint8)


def quantize_linear(
    linear: nn.Linear,
    kind: str,
    group_size: int,
    dense: bool = False,
    int8_activations: bool = False,
    bf16_dot: bool = True,
    amx: bool = True,
) -> nn.Module:
    """The quantized replacement of `linear` (weights on its device, activations in its dtype;
    `dense`: an int4 linear's bf16 copy for many-row steps, see Int4Linear;
    `int8_activations`: where our kernels for them run, see int8_activations_available)."""
    dtype = linear.weight.dtype
    a8 = _a8(linear.weight, int8_activations)
    if kind == "int8":
        kernel = "w8a8_cpu" if a8 else ""
        return Int8Linear(
            quantize_int8(linear.weight), linear.bias, dtype, kernel, bf16_dot=bf16_dot
        )
    if kind == "int4":
        kernel = "w4a8_cpu" if a8 else ""
        return Int4Linear(
            linear.weight,
            linear.bias,
            group_size,
            dtype,
            kernel,
            dense=dense,
            bf16_dot=bf16_dot,
            amx=amx,
        )
    raise ValueError(f"unknown quantization {kind!r}; known: {', '.join(QUANTIZATIONS)}")


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """What `engine.quantization`, `quantization_group_size` and `quantize_lm_head` ask for."""

    kind: str = "none"  # none | int8 | int4: the transformer's linear layers
    group_size: int = 32
    lm_head: bool = False  # lm_head in int8
    embedding: bool = False  # the token embedding table in int8 (shared with a tied lm_head)
    dense: bool = False  # int4 linears keep a bf16 copy for many-row steps (Int4Linear)
    # Quantized linears round their activations to int8 (engine.quantize_activations).
    int8_activations: bool = False
    bf16_dot: bool = True  # int4 and int8 kernels in bf16 dot products where the CPU has them
    amx: bool = True  # and the int4 ones in AMX tiles where it has those (engine.amx)


def quantize_model(model: nn.Module, quant: QuantConfig) -> int:
    """Quantize every linear of `model` (lm_head and embedding as configured); returns how many
    linears.

    lm_head, when quantized, is always int8 per output row: its precision matters most
    (llama.cpp keeps it at 6-8 bits too); on SmolLM2 a 4-bit lm_head cost +7% perplexity, an
    8-bit one +0.44%. A tied lm_head with `embedding` on shares one int8 table with the
    embedding (rows dequantized on gather); without it, the lm_head is an int8 copy and the
    embedding stays float, as `quantize_lm_head` always did for float checkpoints.
    """
    before = weight_bytes(model)
    count = 0
    if quant.kind != "none":
        count = quantize_linears(
            model,
            quant.kind,
            quant.group_size,
            skip=("lm_head",),
            dense=quant.dense,
            bf16_dot=quant.bf16_dot,
            amx=quant.amx,
            int8_activations=quant.int8_activations,
        )
    lm_head = getattr(model, "lm_head", None)
    embed = model.model.embed_tokens
    tied = isinstance(lm_head, nn.Linear) and lm_head.weight is getattr(embed, "weight", None)
    dtype = embed.weight.dtype
    if quant.lm_head and isinstance(lm_head, nn.Linear):
        kernel = "w8a8_cpu" if _a8(lm_head.weight, quant.int8_activations) else ""
        q = quantize_int8(lm_head.weight)
        head = Int8Linear(
            q, lm_head.bias, dtype, kernel, float_scales=True, bf16_dot=quant.bf16_dot
        )
        model.lm_head = head
        count += 1
        if tied and quant.embedding:
            model.model.embed_tokens = Int8Embedding(head.qweight, head.scales, dtype)
    if quant.embedding and isinstance(model.model.embed_tokens, nn.Embedding):
        q = quantize_int8(model.model.embed_tokens.weight)
        model.model.embed_tokens = Int8Embedding(q.qweight, q.scales, dtype)
    log.info(
        "quantized %d linear layers to %s%s (lm_head %s, embedding %s%s%s): weights %.1f MiB -> "
        "%.1f MiB",
        count,
        quant.kind,
        f" (group size {quant.group_size})" if quant.kind == "int4" else "",
        "int8" if quant.lm_head else "kept float",
        "int8" if quant.embedding else "kept float",
        ", activations int8" if any(_int8_activated(m) for m in model.modules()) else "",
        _dot_products(model),
        before / 2**20,
        weight_bytes(model) / 2**20,
    )
    return count


def _dot_products(model: nn.Module) -> str:
    """How the quantized kernels multiply, for the start-up log line."""
    modules = list(model.modules())
    if any(getattr(m, "amx", False) for m in modules):
        return ", bf16 dot products (int4 in AMX tiles)"
    return ", bf16 dot products" if any(getattr(m, "bf16_dot", False) for m in modules) else ""


def quantize_linears(
    model: nn.Module,
    kind: str,
    group_size: int,
    skip: tuple[str, ...] = (),
    dense: bool = False,
    int8_activations: bool = False,
    bf16_dot: bool = True,
    amx: bool = True,
) -> int:
    """Swap every nn.Linear (except names in `skip`) for its quantized version; returns how many.

    One layer at a time, so the float weight of a layer can be freed as soon as it is replaced.
    """
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and full not in skip:
                setattr(
                    parent,
                    name,
                    quantize_linear(
                        child, kind, group_size, dense, int8_activations, bf16_dot, amx
                    ),
                )
                count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held in memory (tied tensors once; computed buffers excluded)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        if isinstance(module, Int8Linear | Int4Linear | Int8Embedding):
            tensors += list(module.buffers(recurse=False))
        packed = getattr(module, "packed", None)  # PackedLinear's opaque oneDNN weight
        if isinstance(packed, torch.Tensor) and not isinstance(module, Int4Linear):
            total += packed.numel() * packed.element_size()
        dense = getattr(module, "dense", None)  # Int4Linear's bf16 copy (oneDNN, opaque)
        if isinstance(dense, torch.Tensor):
            total += dense.numel() * dense.element_size()
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and not isinstance(bias, nn.Parameter):
            tensors.append(bias)
        for t in tensors:
            key = t.data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def memory_use(
    model: nn.Module, spec: Any, num_blocks: int, quantization: str, dtype: torch.dtype
) -> MemoryUse:
    """The model's MemoryUse (a torch-free record, controlplane.engine.types) once loaded."""
    return MemoryUse(
        weight_bytes(model),
        num_blocks * spec.bytes_per_block,
        num_blocks,
        quantization,
        str(dtype).removeprefix("torch."),
        str(spec.dtype).removeprefix("torch."),
    )
