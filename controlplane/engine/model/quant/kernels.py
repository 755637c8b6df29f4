"""How a quantized linear picks its kernel: each format lists its kernel classes in order of
preference (int8.INT8_KERNELS, int4.INT4_KERNELS: vLLM's `_POSSIBLE_KERNELS`), each answers
whether it can serve a layer (`can_serve`: None, or the reason it cannot), the first that can
builds the layer, and `KernelChoices` puts what was chosen, and why the ones ahead of it were
passed over, into the start-up log: one line per kind of layer.

Also what the kernels share: the activation dtype they run fast in, their input rows, and
whether our int8-activation kernels serve on this CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from controlplane.engine.kernels import cpu_ops

# Input features per int8 activation scale in csrc/int8_activations.cpp (GGUF's Q8_1 block).
A8_GROUP = 32


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """One linear layer as a kernel sees it: its shape, where it runs, and what the settings
    ask of its kernel."""

    out_features: int
    in_features: int
    device: torch.device
    dtype: torch.dtype  # the model's activations
    group_size: int = 0  # int4's: input features per (scale, zero) pair
    int8_activations: bool = False  # engine.quantize_activations
    float_scales: bool = False  # the lm_head's: see Int8Linear
    dense: bool = False  # int4's bf16 copy for many-row steps (engine.int4_dense_copy)
    bf16_dot: bool = True  # engine.bf16_dot
    amx: bool = True  # engine.amx

    @classmethod
    def of(cls, linear: nn.Linear, **asked: object) -> LinearSpec:
        out_features, in_features = linear.weight.shape
        w = linear.weight
        return cls(out_features, in_features, w.device, w.dtype, **asked)  # type: ignore[arg-type]


class LinearKernel(ABC):
    """One way to run a quantized linear. `name` is the built module's `kernel`."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def can_serve(cls, spec: LinearSpec) -> str | None:
        """None when this kernel can run `spec`'s layer; else why not, for the log."""

    @classmethod
    @abstractmethod
    def build(cls, linear: nn.Linear, spec: LinearSpec) -> nn.Module:
        """The quantized replacement of `linear`, running this kernel."""


@dataclass(frozen=True, slots=True)
class Choice:
    kernel: type[LinearKernel]
    passed_over: tuple[tuple[str, str], ...]  # (name, why not) of each kernel ahead of it


def choose(kernels: Sequence[type[LinearKernel]], spec: LinearSpec) -> Choice:
    """The first of `kernels` that can serve `spec` (each format's last one serves anything)."""
    passed: list[tuple[str, str]] = []
    for kernel in kernels:
        why = kernel.can_serve(spec)
        if why is None:
            return Choice(kernel, tuple(passed))
        passed.append((kernel.name, why))
    raise ValueError("no kernel serves this layer: " + "; ".join(f"{n}: {w}" for n, w in passed))


class KernelChoices:
    """The choices made for one model, by kind of layer ("int4 linears", "int8 lm_head"), for
    the start-up log: one line per kind, however many layers."""

    def __init__(self) -> None:
        self._kinds: dict[str, list[tuple[Choice, str]]] = {}

    def add(self, kind: str, choice: Choice, module: nn.Module) -> None:
        detail = getattr(module, "kernel_detail", None)
        self._kinds.setdefault(kind, []).append((choice, detail() if detail else ""))

    def lines(self) -> list[str]:
        return [self._line(kind, made) for kind, made in self._kinds.items()]

    @staticmethod
    def _line(kind: str, made: list[tuple[Choice, str]]) -> str:
        n = len(made)

        def share(count: int) -> str:
            return "" if count == n else f" for {count} of {n}"

        served = Counter(
            choice.kernel.name + (f" ({detail})" if detail else "") for choice, detail in made
        )
        passed: dict[str, Counter[str]] = {}
        for choice, _ in made:
            for name, why in choice.passed_over:
                passed.setdefault(name, Counter())[why] += 1
        line = f"{kind} ({n}): " + ", ".join(f"{k}{share(c)}" for k, c in served.items())
        reasons = [
            f"{name}: {why}{share(count)}"
            for name, whys in passed.items()
            for why, count in whys.items()
        ]
        return line + ("; passed over " + "; ".join(reasons) if reasons else "; the first choice")


# -- what the kernels share --------------------------------------------------------------------


def not_a_cpu(device: torch.device) -> str | None:
    return None if device.type == "cpu" else f"the device is {device.type}, not a CPU"


def our_kernels_missing() -> str | None:
    """Why our C++ kernels (engine/kernels) cannot serve here, or None: they built."""
    if cpu_ops.available():
        return None
    error = cpu_ops.build_error().strip().splitlines()
    return "our CPU kernels did not build" + (f" ({error[0][:160]})" if error else "")


def int8_activations_unavailable() -> str | None:
    """Why our int8-activation kernels (engine.quantize_activations) cannot serve on this CPU,
    or None: they need our kernels built for AVX2 or AVX512 (their integer dot products are
    AVX2's; elsewhere they would run a scalar loop, slower than torch's kernels)."""
    isa = torch.backends.cpu.get_cpu_capability()
    if isa not in ("AVX2", "AVX512"):
        return f"the CPU's vector ISA is {isa}, not AVX2 or AVX512"
    return our_kernels_missing()


def int8_activations_available() -> bool:
    """Whether our int8-activation kernels (engine.quantize_activations) serve on this CPU."""
    return int8_activations_unavailable() is None


def a8_unavailable(spec: LinearSpec) -> str | None:
    """Why `spec`'s layer cannot take int8 activations (their groups: 32 input features)."""
    if not spec.int8_activations:
        return "int8 activations not asked for (engine.quantize_activations)"
    if spec.device.type != "cpu":
        return not_a_cpu(spec.device)
    if spec.in_features % A8_GROUP:
        return f"in_features {spec.in_features} is not a multiple of {A8_GROUP}"
    return int8_activations_unavailable()


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


def kernel_input(x: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the [rows, k] `dtype` rows a packed kernel reads."""
    x2 = x.reshape(-1, k)
    if x2.dtype != dtype:
        return x2.to(dtype)  # a fresh, aligned tensor
    # The CPU int8 kernel reads activation rows with aligned vector loads. (A compiled graph
    # cannot read pointers; its buffers come from the same 64-byte-aligned CPU allocator.)
    if not x2.is_contiguous() or (not torch.compiler.is_compiling() and x2.data_ptr() % 64):
        return x2.clone(memory_format=torch.contiguous_format)
    return x2
