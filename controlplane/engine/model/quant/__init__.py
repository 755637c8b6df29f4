"""Weight-only quantized linears: INT8 per output channel (W8A16, int8.py), INT4 group-wise
(W4A16, int4.py), FP8 e4m3 per output channel (fp8.py), from the float weights the loader
produced, quantized once at load (weights.py) and kept packed; activations stay in the model
dtype (or int8, with engine.quantize_activations, where our kernels for them serve; or e4m3
per token, inside the FP8 GEMM of a GPU that has one).

Each format lists its kernels in order of preference (`POSSIBLE_KERNELS`); each kernel says
whether it can serve a layer's shape on its device and why not (kernels.py), the first that can
builds the layer, and the start-up log says, per kind of layer, which served and why the ones
ahead of it were passed over. Which kernels those are and where each wins: int8.py, int4.py
and fp8.py; the measurements: docs/benchmarks.md#quantized-weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from controlplane.engine.model.llama import VocabParallelEmbedding
from controlplane.engine.model.quant.fp8 import FP8_KERNELS, Fp8Linear
from controlplane.engine.model.quant.int4 import INT4_KERNELS, Int4Linear, pack_int4
from controlplane.engine.model.quant.int4_cpu import (
    MANY_ROWS_CHOICES,
    int4_amx_available,
    int4_bf16_dot_available,
    int4_layout,
    int4_many_rows,
    int4_one_row,
    int4_probe,
    pick_many_rows,
)
from controlplane.engine.model.quant.int8 import INT8_KERNELS, Int8Embedding, Int8Linear
from controlplane.engine.model.quant.kernels import (
    A8_GROUP,
    KernelChoices,
    LinearKernel,
    LinearSpec,
    choose,
    int8_activations_available,
    kernel_dtype,
)
from controlplane.engine.model.quant.weights import (
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from controlplane.engine.settings import QUANTIZATIONS
from controlplane.engine.types import MemoryUse

__all__ = [
    "A8_GROUP",
    "FP8_KERNELS",
    "INT4_KERNELS",
    "INT8_KERNELS",
    "MANY_ROWS_CHOICES",
    "POSSIBLE_KERNELS",
    "Fp8Linear",
    "Fp8Weight",
    "Int4Linear",
    "Int4Weight",
    "Int8Embedding",
    "Int8Linear",
    "Int8Weight",
    "KernelChoices",
    "QuantConfig",
    "int4_amx_available",
    "int4_bf16_dot_available",
    "int4_layout",
    "int4_many_rows",
    "int4_one_row",
    "int4_probe",
    "int8_activations_available",
    "kernel_dtype",
    "memory_use",
    "pack_int4",
    "pick_many_rows",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
    "quantize_linear",
    "quantize_linears",
    "quantize_model",
    "weight_bytes",
]

log = logging.getLogger(__name__)

# Each format's kernels, in order of preference: the first that can serve a layer runs it.
POSSIBLE_KERNELS: dict[str, tuple[type[LinearKernel], ...]] = {
    "int8": INT8_KERNELS,
    "int4": INT4_KERNELS,
    "fp8": FP8_KERNELS,
}


def quantize_linear(
    linear: nn.Linear,
    kind: str,
    group_size: int,
    dense: bool = False,
    int8_activations: bool = False,
    bf16_dot: bool = True,
    amx: bool = True,
    choices: KernelChoices | None = None,
    float_scales: bool = False,
) -> nn.Module:
    """The quantized replacement of `linear` (weights on its device, activations in its dtype;
    `dense`: an int4 linear's bf16 copy for many-row steps, see Int4Linear;
    `int8_activations`: where our kernels for them run, see int8_activations_available;
    `float_scales`: an int8 lm_head's, see Int8Linear), by the first of its format's kernels
    that can serve it; `choices` records which, for the start-up log."""
    kernels = POSSIBLE_KERNELS.get(kind)
    if kernels is None:
        raise ValueError(f"unknown quantization {kind!r}; known: {', '.join(QUANTIZATIONS)}")
    spec = LinearSpec.of(
        linear,
        group_size=group_size,
        int8_activations=int8_activations,
        float_scales=float_scales,
        dense=dense,
        bf16_dot=bf16_dot,
        amx=amx,
    )
    choice = choose(kernels, spec)
    module = choice.kernel.build(linear, spec)
    if choices is not None:
        kind_of_layer = f"{kind} lm_head" if float_scales else f"{kind} linears"
        choices.add(kind_of_layer, choice, module)
    return module


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """What `engine.quantization`, `quantization_group_size` and `quantize_lm_head` ask for."""

    kind: str = "none"  # none | int8 | int4 | fp8: the transformer's linear layers
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
    embedding stays float, as `quantize_lm_head` always did for float checkpoints. The same
    holds with fp8 linears (fp8.py says why the lm_head is not FP8).
    """
    before = weight_bytes(model)
    count = 0
    choices = KernelChoices()
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
            choices=choices,
        )
    lm_head = getattr(model, "lm_head", None)
    embed = model.model.embed_tokens
    tied = isinstance(lm_head, nn.Linear) and lm_head.weight is getattr(embed, "weight", None)
    dtype = embed.weight.dtype
    if quant.lm_head and isinstance(lm_head, nn.Linear):
        head = quantize_linear(
            lm_head,
            "int8",
            0,
            int8_activations=quant.int8_activations,
            bf16_dot=quant.bf16_dot,
            choices=choices,
            float_scales=True,
        )
        model.lm_head = head
        count += 1
        if tied and quant.embedding:
            _set_int8_embedding(model, Int8Embedding(head.qweight, head.scales, dtype))
    float_table = _float_embedding(model)
    if quant.embedding and float_table is not None:
        q = quantize_int8(float_table)
        _set_int8_embedding(model, Int8Embedding(q.qweight, q.scales, dtype))
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
    for line in choices.lines():
        log.info("kernels: %s", line)
    return count


def _float_embedding(model: nn.Module) -> torch.Tensor | None:
    """The token embedding's float table, None once it is int8."""
    embed = model.model.embed_tokens
    if isinstance(embed, nn.Embedding):
        return embed.weight
    if isinstance(embed, VocabParallelEmbedding) and embed.table is None:
        return embed.weight
    return None


def _set_int8_embedding(model: nn.Module, table: Int8Embedding) -> None:
    """Make `table` the token embedding's. A tensor-parallel rank's embedding keeps its module
    (ids outside its vocabulary rows masked, then the all-reduce) and looks its rows up in the
    table: the same rows as its lm_head's shard, so a tied pair shares one int8 table, and the
    padded vocabulary's zero rows quantize to zeros (scale TINY, no division by zero)."""
    embed = model.model.embed_tokens
    if isinstance(embed, VocabParallelEmbedding):
        embed.use_table(table)
    else:
        model.model.embed_tokens = table


def _int8_activated(module: nn.Module) -> bool:
    return getattr(module, "kernel", "") in ("w4a8_cpu", "w8a8_cpu")


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
    choices: KernelChoices | None = None,
) -> int:
    """Swap every nn.Linear (except names in `skip`) for its quantized version; returns how many.

    One layer at a time, so the float weight of a layer can be freed as soon as it is replaced.
    """
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and full not in skip:
                module = quantize_linear(
                    child, kind, group_size, dense, int8_activations, bf16_dot, amx, choices
                )
                setattr(parent, name, module)
                count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held in memory (tied tensors once; computed buffers excluded)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        if isinstance(module, Int8Linear | Int4Linear | Int8Embedding | Fp8Linear):
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
