"""INT8 weight-only linears (W8A16): int8 weights, one scale per output channel; and the int8
embedding table. Their kernels, in order of preference (INT8_KERNELS):

* `w8a8_cpu`: our `w8a8_linear` (csrc/int8_activations.cpp), int8 activations and integer
  sums, where engine.quantize_activations asks for them and they serve on this CPU;
* `int8_cpu`: our `int8_linear` (csrc/int8_linear.cpp) wherever our CPU kernels built: the
  weight read once per call for all rows, float32 sums; `int8_linear_bf16` (VDPBF16PS) for
  bf16 activations where the CPU has AVX512-BF16 (engine.bf16_dot);
* `int8_triton`: our Triton kernels on CUDA (triton_linear.py: split-K for a few rows, tiles
  for many, at every row count), bf16 or fp16 activations, float32 scales on float32 sums;
* `int8pack_mm`: torch's `_weight_int8pack_mm`, on a CPU or CUDA (correct on an H100,
  tests/engine/test_quant_gpu.py; slower than bf16 there, docs/models.md);
* `dequant`: the int8 weight converted to the activations' dtype, then `F.linear`: anywhere.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from controlplane.engine.kernels import cpu_ops
from controlplane.engine.model.quant import triton_linear
from controlplane.engine.model.quant.kernels import (
    LinearKernel,
    LinearSpec,
    a8_unavailable,
    choose,
    kernel_dtype,
    kernel_input,
    not_a_cpu,
    our_kernels_missing,
)
from controlplane.engine.model.quant.weights import Int8Weight, quantize_int8


class Int8Linear(nn.Module):
    """W8A16: int8 weights, one scale per output channel, 16-bit activations in the kernel
    (W8A8 with the `w8a8_cpu` kernel: engine.quantize_activations)."""

    # From this many rows (prefill chunks) on, dequantizing the weight once and running the
    # float GEMM beats the packed kernel, whose speed stays per row (docs/benchmarks.md#quantized-weights).
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
        self.kernel = (
            kernel
            or choose(INT8_KERNELS, LinearSpec(*weight.qweight.shape, device, dtype)).kernel.name
        )
        ours = self.kernel in ("int8_cpu", "w8a8_cpu")
        # Triton's takes float32 scales onto its float32 sums too, at every row count.
        triton = self.kernel == "int8_triton"
        if triton:
            self.dequant_min_rows = sys.maxsize
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
        scales_dtype = torch.float32 if float_scales or ours or triton else self.act_dtype
        self.register_buffer("scales", weight.scales.to(scales_dtype))
        unit = (
            torch.ones_like(self.scales, dtype=self.act_dtype)
            if float_scales and not (ours or triton)
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
        elif self.kernel == "int8_triton":
            x2 = kernel_input(x, self.in_features, self.act_dtype)
            y = torch.ops.controlplane_triton.w8a16_linear(x2, self.qweight, self.scales)
            y = y.to(x.dtype)
        elif self._unit is not None:
            x2 = kernel_input(x, self.in_features, self.act_dtype)
            y = torch._weight_int8pack_mm(x2, self.qweight, self._unit).float() * self.scales
            y = y.to(x.dtype)
        else:
            x2 = kernel_input(x, self.in_features, self.act_dtype)
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def kernel_detail(self) -> str:
        """For the start-up log: whether our kernel multiplies in bf16 dot products."""
        return "bf16 dot products" if self.bf16_dot else ""

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


class Int8Kernel(LinearKernel):
    """An int8 kernel: the layer it builds is an Int8Linear running it."""

    @classmethod
    def build(cls, linear: nn.Linear, spec: LinearSpec) -> nn.Module:
        return Int8Linear(
            quantize_int8(linear.weight),
            linear.bias,
            spec.dtype,
            cls.name,
            float_scales=spec.float_scales,
            bf16_dot=spec.bf16_dot,
        )


class W8A8Cpu(Int8Kernel):
    name = "w8a8_cpu"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        return a8_unavailable(spec)


class Int8Cpu(Int8Kernel):
    name = "int8_cpu"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        return not_a_cpu(spec.device) or our_kernels_missing()


class Int8Triton(Int8Kernel):
    name = "int8_triton"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        return triton_linear.unavailable(spec.device)


class Int8PackMM(Int8Kernel):
    name = "int8pack_mm"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        if not hasattr(torch, "_weight_int8pack_mm"):
            return "this torch has no _weight_int8pack_mm"
        if spec.device.type not in ("cpu", "cuda"):
            return f"torch's kernel runs on a CPU or CUDA, not {spec.device.type}"
        # The CPU kernel's bf16 path reads rows with aligned 16-element loads: with K % 16 != 0
        # it crashes the process (SIGSEGV, torch 2.13).
        if spec.device.type == "cpu" and spec.in_features % 16:
            return f"in_features {spec.in_features} is not a multiple of 16 (torch's CPU kernel)"
        return None


class Int8Dequant(Int8Kernel):
    name = "dequant"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        return None  # F.linear runs anywhere


# In order of preference: the first that can serve a layer runs it.
INT8_KERNELS: tuple[type[Int8Kernel], ...] = (
    W8A8Cpu,
    Int8Cpu,
    Int8Triton,
    Int8PackMM,
    Int8Dequant,
)
