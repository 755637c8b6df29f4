"""CPU linear layers with weights pre-packed for oneDNN, or for our bf16 kernel.

`nn.Linear` on CPU re-reads the weight in its plain row-major layout every call. Packing it once
into oneDNN's blocked layout made bf16 matmuls 1.3-2x faster here at batch 1-16 (bit-identical
results) and moves the weights off file-backed 4 KiB pages. On a CPU with AVX512-BF16 and no
AMX tiles (Zen 4), bf16 weights are packed for our own kernel instead (csrc/bf16_linear.cpp,
`engine.bf16_dot`): one user's 1.1B Llama decode reads its weights 1.2-1.7x faster than through
oneDNN. This is a module swap, the same seam weight-only quantized linears use.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from controlplane.engine.kernels import cpu_ops

log = logging.getLogger(__name__)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX).

    Without it bf16 matmuls are emulated: on an AVX2-only CPU here a 2048^3 bf16 matmul ran at
    0.3 GFLOP/s and the daemon 2.2x slower than in float32. oneDNN's own
    `_is_mkldnn_bf16_supported` says yes on any AVX512 CPU, bf16 instructions or not.
    """
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


_CHECKPOINT_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def auto_dtype(
    checkpoint_dtype: str, device: torch.device, quantized: bool = False
) -> tuple[torch.dtype, str]:
    """What `dtype = "auto"` runs in on `device`, and why (for the log).

    Never rounds the checkpoint further than the hardware asks: a float32 checkpoint (or one
    naming a dtype we do not run, such as a block-quantized GGUF) stays float32; a 16-bit one
    runs in bfloat16 on a CPU with native bf16, in float32 on any other CPU (emulated bf16 is
    many times slower there), and as stored on a GPU.

    With `quantized` linears on a CPU with native bf16 the activations are bfloat16 anyway
    inside every quantized kernel (model/quant/kernels.kernel_dtype), so the whole layer runs in it:
    no conversion to bf16 and back around each of the 120 matmuls of a SmolLM2 token. Measured
    here (SmolLM2 Q4_1, 2 cores): batch-1 decode 53.7 -> 60.8 tok/s, 16 sequences 265 -> 292;
    perplexity +0.2% over float32 activations.
    """
    if quantized and device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16, "quantized linears, whose CPU kernels take bf16; native bf16 CPU"
    stored = _CHECKPOINT_DTYPES.get(checkpoint_dtype)
    if stored is None or stored == torch.float32:
        return torch.float32, f"the checkpoint's dtype is {checkpoint_dtype}"
    if device.type != "cpu":
        return stored, f"the checkpoint's dtype on {device.type}"
    if cpu_has_native_bf16():
        return torch.bfloat16, f"{checkpoint_dtype} checkpoint, CPU with native bf16"
    return torch.float32, (
        f"{checkpoint_dtype} checkpoint, but this CPU has no native bf16 (AVX512-BF16 or AMX): "
        "bf16 would be emulated, many times slower"
    )


def cpu_packing_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU packs `dtype` linears for oneDNN: the one capability check, used by the
    loader and the tests alike.

    float32 packs wherever oneDNN is built in. bfloat16 packs only where the CPU has native
    bf16 (cpu_has_native_bf16) and oneDNN agrees (which honours ONEDNN_MAX_CPU_ISA, so capping
    it at AVX2 shows an AVX2-only CPU); elsewhere the documented fallback is the plain
    `nn.Linear`s, with the same results. (torch.backends.cpu.get_cpu_capability() says "AVX512"
    with or without bf16 instructions: it cannot tell.)
    """
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    ):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return cpu_has_native_bf16() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def padded_rows(t: int) -> int:
    """The row bucket of a packed matmul: powers of two up to 16 (decode batches), then
    multiples of 16 up to 256, then of 64: at most ~15% padding past 16 rows, and a few dozen
    shapes per weight for a 2048-token step budget. (The C++ op's `packed_rows` is the same
    rule; a test holds them equal.)"""
    if t <= 16:
        return 1 << max(t - 1, 0).bit_length()
    step = 16 if t <= 256 else 64
    return -(-t // step) * step


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # x: [T, in_features] -> [T, out_features]. oneDNN builds (JIT-compiles) and caches a
    # kernel per row count; ragged batches have hundreds of row counts, so unpadded the
    # cache churned (a tiny model ran 3.5x slower than unpacked) and the process grew by
    # ~265 MB over 4000 requests. Padding T to a few buckets bounds both.
    t = x.shape[0]
    padded = padded_rows(t)
    if padded != t:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - t))
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y[:t] if padded != t else y


@torch.library.custom_op("controlplane::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """PackedLinear's matmul as one op a compiled graph calls as is."""
    return _packed_linear(x, packed, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    return x.new_empty(x.shape[0], out_features)


def packed_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    native: bool,
) -> torch.Tensor:
    """x [T, in] @ a weight packed by `mkldnn._reorder_linear_weight`, as one opaque op
    (inductor cannot lower the oneDNN call on a weight it did not pack itself, and the row
    padding would specialize a compiled graph on T).

    `native` (cpu_ops.available(), asked once when the layer is built): our C++ op
    (csrc/packed_linear.cpp); as a Python custom op the call cost ~43 us in wrappers, 2.8 ms
    of the 1.1B Llama's 90 ms token. Without our kernels, the Python op in a compiled graph and
    the plain call outside one."""
    if native:
        return torch.ops.controlplane_cpu.packed_linear(x, packed, bias, out_features)
    if torch.compiler.is_compiling():
        return torch.ops.controlplane.packed_linear(x, packed, bias, out_features)
    return _packed_linear(x, packed, bias)


def bf16_linear_available() -> bool:
    """Whether bf16 linears can take our VDPBF16PS kernel (csrc/bf16_linear.cpp) here: our
    kernels built, a CPU with AVX512-BF16, and no AMX tiles. Where the CPU has tiles oneDNN's
    bf16 matmul multiplies in them (prompts many times VDPBF16PS's rate), and one user's 1.1B
    decode already read 85% of the memory's bandwidth through it (a 2-core Xeon)."""
    return cpu_ops.bf16_dot_available() and not torch.cpu._is_amx_tile_supported()


class PackedLinear(nn.Module):
    """A linear layer whose weight is packed once: for oneDNN, or with `bf16_dot` (a bf16
    weight of even in_features, where bf16_linear_available()) for our kernel (`kernel` says
    which).

    Our kernel's layout is 64 outputs a block, all of K's bf16 pairs in turn: one sequential
    stream a block (on 2 MB pages once model/arena.py has placed it). Each output is one
    VDPBF16PS chain over K from zero, whatever
    the rows beside it (batch invariant, as oneDNN is not promised to be), within bf16 rounding
    of oneDNN's: a 1.1B Llama's linears measured 1.18-1.67x oneDNN's speed at one row, 1.01-1.10x
    at 4, 1.08-1.20x at 16-64 and 1.00-1.03x at 512 rows (2-core Zen 4, weights from memory)."""

    def __init__(self, linear: nn.Linear, bf16_dot: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        ours = weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0
        if bf16_dot and ours and bf16_linear_available():
            self.kernel = "bf16_dot"
            self.packed = torch.ops.controlplane_cpu.bf16_pack_weight(weight)
        else:
            self.kernel = "onednn"
            # An opaque oneDNN tensor, not a Parameter: nothing trains or re-saves it.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.native = cpu_ops.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "bf16_dot":
            return torch.ops.controlplane_cpu.bf16_linear(
                x, self.packed, self.bias, self.out_features
            )
        return packed_matmul(x, self.packed, self.bias, self.out_features, self.native)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, kernel={self.kernel}"
        )


def pack_linears(model: nn.Module, skip: tuple[str, ...] = (), bf16_dot: bool = False) -> int:
    """Swap every nn.Linear (except names in `skip`) for a PackedLinear; returns how many."""
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and full not in skip:
                setattr(parent, name, PackedLinear(child, bf16_dot))
                count += 1
    return count
