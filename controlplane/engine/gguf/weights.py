"""GGUF tensors -> `CausalLM` parameters: names, llama.cpp's Q/K row permutation, dequantization.

llama.cpp's converter reorders the rows of Llama's q_proj / k_proj within each head so that its
RoPE kernel can rotate adjacent pairs (x0, x1), (x2, x3), ...; transformers and this engine
rotate halves (x_i, x_{i+d/2}). Undoing it is a pure row permutation, so it is applied to the
raw rows (block-quantized data is laid out per row) as they are read, before anything is
dequantized: the raw blocks a quantized linear receives are already in this engine's row order,
and a tensor-parallel rank reads only its heads' rows (gguf/slices.py). Qwen2 files are
converted without the permutation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from gguf import GGMLQuantizationType

from controlplane.engine.errors import ModelLoadError
from controlplane.engine.gguf.file import GGUFFile, GGUFTensor
from controlplane.engine.gguf.slices import TensorPart, byte_rows, read
from controlplane.engine.model.config import ModelConfig

Q = GGMLQuantizationType
# What this loader reads (dequantized to float at load for now).
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
# Architectures whose GGUF q/k rows llama.cpp permuted (Qwen2 uses NeoX-style RoPE there).
_PERMUTED_ARCHS = ("llama",)


def parameter_name(gguf_name: str) -> str | None:
    """The `CausalLM` parameter a GGUF tensor holds, or None for a name we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rows(rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's per-head (half, 2) -> (2, half) interleave."""
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of even size")
    return np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).swapaxes(1, 2).reshape(-1)


def raw_blocks(t: GGUFTensor) -> torch.Tensor:
    """The stored bytes as a uint8 tensor [rows, bytes_per_row] in this engine's row order (a
    copy, off the file map)."""
    data = byte_rows(t)
    return torch.from_numpy(np.array(data if t.rows is None else data[t.rows], copy=True))


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """The tensor as float32 in its logical shape (always a fresh tensor, never the file map).

    gguf's own vectorized numpy code: 0.5 s for all of SmolLM2 here. A torch version of the
    Q4_1 / Q8_0 formulas measured 3-6x slower on this 2-core machine (its uint8 shifts and
    narrow strided copies), so numpy it is.
    """
    return read(t)


def engine_tensors(f: GGUFFile, cfg: ModelConfig) -> dict[str, GGUFTensor]:
    """Every tensor under its parameter name, q/k rows in this engine's order, types checked."""
    out: dict[str, GGUFTensor] = {}
    permuted = f.architecture in _PERMUTED_ARCHS
    for name, t in f.tensors.items():
        param = parameter_name(name)
        if param is None:
            raise ModelLoadError(f"{f.path}: tensor {name!r} is not part of a supported model")
        if t.type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{f.path}: tensor {name!r} has type {t.type.name}, which is not supported "
                f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
            )
        heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(param.split(".")[-2])
        if permuted and heads is not None:
            try:
                order = unpermute_rows(t.shape[0], heads)
            except ValueError as exc:
                raise ModelLoadError(f"{f.path}: tensor {name!r}: {exc}") from None
            t = replace(t, rows=order)  # applied as rows are read
        out[param] = replace(t, name=name)
    return out


def load_state_dict(
    f: GGUFFile,
    cfg: ModelConfig,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
    take: Callable[[str, TensorPart], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Dequantized parameters for `expected` (name -> shape); missing or misshapen tensors are
    errors naming the file and the tensor. `take(name, part)`: the part of each a
    tensor-parallel rank holds (`take_shard`), only that part dequantized."""
    tensors = engine_tensors(f, cfg)
    state: dict[str, torch.Tensor] = {}
    for param, shape in expected.items():
        t = tensors.get(param)
        if t is None:
            raise ModelLoadError(f"{f.path}: tensor for {param!r} is missing from the file")
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(
                f"{f.path}: tensor {t.name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}"
            )
        tensor = dequantize(t) if take is None else take(param, TensorPart(t))
        state[param] = tensor.to(device=device, dtype=dtype)
    return state
