"""INT4 weight-only linears (W4A16): 4-bit weights, a (scale, zero) pair per group of input
features (weights.py's convention). Their kernels, in order of preference (INT4_KERNELS):

* `w4a8_cpu`: our `w4a8_linear` (csrc/int8_activations.cpp), int8 activations and integer
  sums, where engine.quantize_activations asks for them and they serve on this CPU;
* `int4pack_mm_cpu`: torch's `_weight_int4pack_mm_for_cpu` on a weight packed by
  `_convert_weight_to_int4pack_for_cpu`, which beats dequantize-then-matmul and the float
  linears at batch-1 decode (benchmarks/quant_kernels.py). On the same packed weight our own
  kernels take over where they serve (int4_cpu.py checks them): `int4_linear_bf16` at every
  row count where the CPU has AVX512-BF16 (engine.bf16_dot), in AMX tiles where it has those
  (engine.amx); else `int4_linear` (torch's results bit for bit) from `many_rows` rows (and
  at one row where it won). With engine.int4_dense_copy, a bf16 copy for many-row steps;
* `int4_triton`: our Triton kernels on CUDA (triton_linear.py: gemv or split-K for few rows,
  the weight dequantized for one matmul for many), the weight in nibble planes, bf16 or fp16
  activations;
* `int4pack_mm_cuda`: tinygemm's `_weight_int4pack_mm` (bf16 activations): correct on an
  H100 (tests/engine/test_quant_gpu.py), slower than bf16 there (docs/models.md);
* `dequant`: the weight dequantized, then `F.linear`: anywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from controlplane.engine.kernels import cpu_ops
from controlplane.engine.model.linear import cpu_packing_supported, packed_matmul
from controlplane.engine.model.quant import triton_linear
from controlplane.engine.model.quant.int4_cpu import (
    DEFAULT_MANY_ROWS,
    int4_amx_available,
    int4_bf16_dot_available,
    int4_layout,
    int4_many_rows,
    int4_one_row,
)
from controlplane.engine.model.quant.kernels import (
    A8_GROUP,
    LinearKernel,
    LinearSpec,
    a8_unavailable,
    choose,
    kernel_dtype,
    kernel_input,
    not_a_cpu,
)
from controlplane.engine.model.quant.weights import Int4Weight, quantize_int4

_CPU_INT4_ROWS = 16  # _convert_weight_to_int4pack_for_cpu wants N % 16 == 0
_CUDA_INT4_ROWS = 8
_CUDA_INNER_K_TILES = 8  # tinygemm: K % (inner_k_tiles * 16) == 0


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


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
    many_rows = DEFAULT_MANY_ROWS
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
        self.kernel = (
            kernel
            or choose(
                INT4_KERNELS, LinearSpec(*weight.shape, device, dtype, group_size=group_size)
            ).kernel.name
        )
        if self.kernel == "w4a8_cpu" and group_size % A8_GROUP:
            self.kernel = "int4pack_mm_cpu"
        self.act_dtype = kernel_dtype(device, dtype) if self.kernel != "dequant" else dtype
        if self.kernel == "int4pack_mm_cuda":
            # tinygemm takes bf16 only: a float16 model's activations failed in it (H100).
            self.act_dtype = torch.bfloat16
        rows = {"int4pack_mm_cpu": _CPU_INT4_ROWS, "int4pack_mm_cuda": _CUDA_INT4_ROWS}
        cols = {
            "int4pack_mm_cuda": _CUDA_INNER_K_TILES * 16,
            "int4_triton": triton_linear.PERIOD,  # whole periods of nibble planes
        }.get(self.kernel, group_size)
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
        self.register_buffer("packed", pack_int4(q.qvalues, self.kernel))
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
        self.layout = int4_layout() if torch_cpu and self.dense is None else None
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
        x2 = kernel_input(x, self.in_features, x.dtype if w4a8 else self.act_dtype)
        # (The Triton kernel masks the activations past in_features: no copy.)
        if self.padded_in != self.in_features and self.kernel != "int4_triton":
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
        elif self.kernel == "int4_triton":
            y = torch.ops.controlplane_triton.int4_linear(
                x2, self.packed, self.scales_and_zeros, self.group_size
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
        elif self.kernel == "int4_triton":
            q = triton_linear.unpack_int4(self.packed)
        else:
            raise RuntimeError(f"kernel {self.kernel} keeps an opaque layout")
        return self._dequantize(q.int())

    def _dequantize(self, q: torch.Tensor) -> torch.Tensor:
        if self.kernel == "w4a8_cpu":
            scales = self.scales.float().repeat_interleave(A8_GROUP, dim=1)
            return q.float() * scales + self.mins.float().repeat_interleave(A8_GROUP, dim=1)
        return Int4Weight(q, self.scales_and_zeros.float(), self.group_size).dequantize()

    def kernel_detail(self) -> str:
        """Which of our CPU kernels take over on torch's packed weight, for the start-up log."""
        paths = []
        if self.amx:
            paths.append("bf16 dot products in AMX tiles")
        elif self.bf16_dot:
            paths.append("bf16 dot products")
        elif self.layout is not None:
            one = " and at one row" if self.one_row else ""
            paths.append(f"ours from {self.many_rows} rows{one}")
        if self.dense is not None:
            paths.append(f"a bf16 copy from {self.dense_min_rows} rows")
        return ", ".join(paths)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, kernel={self.kernel}, act_dtype={self.act_dtype}"
        )


def pack_int4(qvalues: torch.Tensor, kernel: str) -> torch.Tensor:
    if kernel == "int4pack_mm_cpu":
        return torch._convert_weight_to_int4pack_for_cpu(qvalues, 2)
    if kernel == "int4_triton":  # int32 words [K / 8, N] in nibble planes
        return triton_linear.pack_int4(qvalues)
    if kernel == "int4pack_mm_cuda":
        # tinygemm's CUDA packer takes two values a byte, the even-indexed one high.
        pairs = (qvalues[:, ::2] << 4 | qvalues[:, 1::2]).to(torch.uint8)
        return torch._convert_weight_to_int4pack(pairs, _CUDA_INNER_K_TILES)
    if kernel == "w4a8_cpu":  # per 32 values: k = j low nibble, k = 16 + j high (GGUF's Q4_1)
        halves = qvalues.to(torch.uint8).view(qvalues.shape[0], -1, 2, A8_GROUP // 2)
        return (halves[:, :, 0] | halves[:, :, 1] << 4).flatten(1).contiguous()
    # The fallback keeps two values a byte too (low nibble first): memory is the point.
    return (qvalues[:, ::2] | qvalues[:, 1::2] << 4).to(torch.uint8)


class Int4Kernel(LinearKernel):
    """An int4 kernel: the layer it builds is an Int4Linear running it."""

    @classmethod
    def build(cls, linear: nn.Linear, spec: LinearSpec) -> nn.Module:
        return Int4Linear(
            linear.weight,
            linear.bias,
            spec.group_size,
            spec.dtype,
            cls.name,
            dense=spec.dense,
            bf16_dot=spec.bf16_dot,
            amx=spec.amx,
        )


class W4A8Cpu(Int4Kernel):
    name = "w4a8_cpu"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        why = a8_unavailable(spec)
        if why is None and spec.group_size % A8_GROUP:
            why = f"group size {spec.group_size} is not a multiple of {A8_GROUP}"
        return why


class Int4PackCpu(Int4Kernel):
    name = "int4pack_mm_cpu"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            return "this torch has no _weight_int4pack_mm_for_cpu"
        return not_a_cpu(spec.device)


class Int4Triton(Int4Kernel):
    name = "int4_triton"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        return triton_linear.int4_unavailable(spec.device, spec.group_size)


class Int4PackCuda(Int4Kernel):
    name = "int4pack_mm_cuda"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        if not hasattr(torch, "_weight_int4pack_mm"):
            return "this torch has no _weight_int4pack_mm"
        return None if spec.device.type == "cuda" else f"the device is {spec.device.type}"


class Int4Dequant(Int4Kernel):
    name = "dequant"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        return None  # F.linear runs anywhere


# In order of preference: the first that can serve a layer runs it.
INT4_KERNELS: tuple[type[Int4Kernel], ...] = (
    W4A8Cpu,
    Int4PackCpu,
    Int4Triton,
    Int4PackCuda,
    Int4Dequant,
)
