"""FP8 weight linears (W8A16 in e4m3, or W8A8 where the GPU multiplies FP8): float8_e4m3fn
weights, one float32 scale per output channel (weights.quantize_fp8). Their kernels, in order
of preference (FP8_KERNELS):

* `scaled_mm`: torch's `_scaled_mm`, the FP8 tensor-core GEMM of NVIDIA GPUs of compute
  capability 8.9 and up (Ada, Hopper, Blackwell): the activations are quantized to e4m3 on the
  fly, each row (token) with its own scale, and the kernel applies both scales in its epilogue
  (`scale_a` [rows, 1], `scale_b` [1, N]: rowwise scaling). Rowwise, not one scale for the
  whole activation tensor: with one scale, a token's result depends on what shares its step
  (the step's largest activation sets everyone's grid), so a request's tokens would change
  with the batch; and a token with a large enough activation (an outlier channel, a prompt's
  first token) pushes the others down e4m3's range into its subnormals, then to zero (being
  floating point, e4m3 absorbs a gap of a few thousand first: test_fp8_weights.py). With a
  scale per token each row is quantized on its own grid, whatever shares its step; the price
  is a max over each row instead of one over the tensor. Where this torch's `_scaled_mm` has
  no rowwise scaling on the GPU (probed once per device at load: it has been missing on some
  architectures and builds), one scale for the tensor (`scale_a` a scalar, `scale_b` 1) and
  the weight's per-channel scales multiplying the output in float32; the start-up log says
  which. Its output is bfloat16 (the dtype rowwise scaling writes), converted to the model's
  dtype. It needs K and N multiples of 16. Calls of up to 16 rows (decode) skip it where
  triton imports: our Triton W8A16 kernel (triton_linear.py's int8 kernel, which widens an
  e4m3 weight to bf16 exactly) multiplies the bf16 activations by the e4m3 weight with no
  activation quantization. On the H200 `_scaled_mm` made fp8 decode no faster than bf16 while
  that kernel on int8 weights (the same bytes) was faster at few rows on the 8B's large shapes
  (docs/benchmarks.md#gpu-seeds); not yet measured on fp8 weights. So on a GPU a token's
  result depends on whether its step had more than 16 rows.
* `dequant`: the weight dequantized to the activations' dtype (e4m3 values times their
  float32 scale, rounded once), then `F.linear`: anywhere, the CPU included (the path the CPU
  suite covers). It saves memory, not time: each call converts the whole weight.

The lm_head and the embedding are not FP8: `quantize_lm_head` keeps the lm_head int8 per
output row as with the other formats (its precision matters most, int8 per row is the head
whose cost in perplexity was measured, docs/models.md, and our CPU kernels serve it), and the
embedding table stays in the model's dtype.

A GGUF file with `quantization = "fp8"` takes the loader's one path for every file, as `int8`
and `int4` do: its tensors are dequantized to float, then quantized to e4m3. Its blocks round a
second time (each weight within 2^-4 of its dequantized value, as for any float checkpoint);
refusing would make fp8 the one explicit format a GGUF file cannot be served in.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from controlplane.engine.model.quant import triton_linear
from controlplane.engine.model.quant.kernels import LinearKernel, LinearSpec, choose
from controlplane.engine.model.quant.weights import FP8_MAX, TINY, Fp8Weight, quantize_fp8

FP8_MIN_CAPABILITY = (8, 9)  # Ada: the first NVIDIA GPUs with FP8 tensor cores
_SCALED_MM_MULTIPLE = 16  # _scaled_mm's K and N on CUDA


class Fp8Linear(nn.Module):
    """float8_e4m3fn weights [N, K] with one float32 scale per output channel; activations
    in the model's dtype (`dequant`) or quantized to e4m3 per token (`scaled_mm`)."""

    def __init__(
        self,
        weight: Fp8Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        kernel: str = "",
        rowwise: bool | None = None,
        triton_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.qweight.shape
        device = weight.qweight.device
        self.dtype = dtype
        self.kernel = (
            kernel
            or choose(FP8_KERNELS, LinearSpec(*weight.qweight.shape, device, dtype)).kernel.name
        )
        # Calls of up to this many rows run the Triton W8A16 kernel (the module doc): with
        # scaled_mm where triton serves; any kernel when asked (tests, under the interpreter).
        if triton_rows is None:
            serves = self.kernel == "scaled_mm" and triton_linear.unavailable(device) is None
            triton_rows = triton_linear.SPLIT_K_MAX_ROWS if serves else 0
        self.triton_rows = triton_rows
        # scaled_mm: one activation scale per token where the GPU's _scaled_mm takes them.
        if self.kernel != "scaled_mm":
            rowwise = False
        elif rowwise is None:
            rowwise = rowwise_unavailable(device) is None
        self.rowwise = rowwise
        self.register_buffer("qweight", weight.qweight.contiguous())
        self.register_buffer("scales", weight.scales.float().contiguous())
        # One scale for the step's activations: `scale_b` is then the scalar 1 (the weight's
        # per-channel scales multiply the output).
        one = torch.ones((), device=device) if self.kernel == "scaled_mm" and not rowwise else None
        self.register_buffer("_one", one, persistent=False)
        self.bias = None if bias is None else bias.detach().to(dtype)

    def weight_dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight the `dequant` kernel multiplies: e4m3 values times their scales in
        float32, rounded once to `dtype`."""
        return (self.qweight.float() * self.scales[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if 0 < x2.shape[0] <= self.triton_rows:
            y = torch.ops.controlplane_triton.w8a16_linear(x2, self.qweight, self.scales)
            if self.bias is not None:
                y = y + self.bias
        elif self.kernel == "scaled_mm":
            # The bias added in float32 and the sum rounded once: the same bits eager and
            # compiled (inductor drops an intermediate rounding to a 16-bit dtype when it fuses).
            y = self._scaled_mm(x2).float()
            if self.bias is not None:
                y = y + self.bias.float()
            y = y.to(x.dtype)
        else:
            y = F.linear(x2, self.weight_dequantized(x.dtype), self.bias)
        return y.view(*lead, self.out_features)

    def _scaled_mm(self, x2: torch.Tensor) -> torch.Tensor:
        # [rows, 1]: one scale per token; else one for the step.
        amax = x2.abs().amax(dim=1, keepdim=True) if self.rowwise else x2.abs().amax()
        scale_a = amax.float().clamp(min=TINY) / FP8_MAX
        xq = (x2.float() / scale_a).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        w = self.qweight.t()  # [K, N], column-major: what _scaled_mm takes as its second
        if self.rowwise:
            return torch._scaled_mm(
                xq, w, scale_a, self.scales.view(1, -1), out_dtype=torch.bfloat16
            )
        y = torch._scaled_mm(xq, w, scale_a, self._one, out_dtype=torch.bfloat16)
        return y.float() * self.scales

    def kernel_detail(self) -> str:
        """For the start-up log: how scaled_mm scales its activations."""
        if self.kernel != "scaled_mm":
            return ""
        detail = "a scale per token" if self.rowwise else "one activation scale per step"
        if self.triton_rows:
            detail += f"; up to {self.triton_rows} rows our Triton W8A16 kernel"
        return detail

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"kernel={self.kernel}, dtype={self.dtype}"
            + (f", rowwise={self.rowwise}" if self.kernel == "scaled_mm" else "")
            + (f", triton_rows={self.triton_rows}" if self.triton_rows else "")
        )


@functools.cache
def _rowwise_probe(device_type: str, index: int | None) -> str | None:
    device = torch.device(device_type, index)
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(
            a,
            a.t(),
            torch.ones(16, 1, device=device),
            torch.ones(1, 16, device=device),
            out_dtype=torch.bfloat16,
        )
    except (RuntimeError, NotImplementedError) as e:
        lines = str(e).strip().splitlines()
        return "this torch's _scaled_mm has no rowwise scaling here" + (
            f" ({lines[0][:160]})" if lines else ""
        )
    return None


def rowwise_unavailable(device: torch.device) -> str | None:
    """Why `_scaled_mm` cannot take a scale per token on `device` (probed once), or None."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _rowwise_probe(device.type, device.index)


def scaled_mm_unavailable(spec: LinearSpec) -> str | None:
    """Why torch's FP8 GEMM cannot run `spec`'s layer, or None."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return "this torch has no _scaled_mm"
    if spec.device.type != "cuda":
        return f"the device is {spec.device.type}, not CUDA"
    capability = torch.cuda.get_device_capability(spec.device)
    if capability < FP8_MIN_CAPABILITY:
        return (
            f"compute capability {capability[0]}.{capability[1]} is below "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} (no FP8 tensor cores)"
        )
    if spec.in_features % _SCALED_MM_MULTIPLE or spec.out_features % _SCALED_MM_MULTIPLE:
        return (
            f"{spec.in_features} -> {spec.out_features} features: _scaled_mm needs multiples "
            f"of {_SCALED_MM_MULTIPLE}"
        )
    return None


class Fp8Kernel(LinearKernel):
    """An FP8 kernel: the layer it builds is an Fp8Linear running it."""

    @classmethod
    def build(cls, linear: nn.Linear, spec: LinearSpec) -> nn.Module:
        return Fp8Linear(quantize_fp8(linear.weight), linear.bias, spec.dtype, cls.name)


class Fp8ScaledMM(Fp8Kernel):
    name = "scaled_mm"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        return scaled_mm_unavailable(spec)


class Fp8Dequant(Fp8Kernel):
    name = "dequant"

    @classmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        return None  # F.linear runs anywhere


# In order of preference: the first that can serve a layer runs it.
FP8_KERNELS: tuple[type[Fp8Kernel], ...] = (Fp8ScaledMM, Fp8Dequant)
