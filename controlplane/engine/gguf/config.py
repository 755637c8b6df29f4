"""Model hyper-parameters from a GGUF file's metadata (`<arch>.*` keys, as llama.cpp writes
them), and the engine layout its weights are stored nearest to."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from controlplane.engine.errors import ModelLoadError
from controlplane.engine.gguf.file import GGUFFile, open_gguf
from controlplane.engine.model.config import ModelConfig

# GGUF `general.architecture` -> the transformers class whose layout it holds. llama.cpp writes
# Mistral (7B-style) checkpoints as "llama", Q/K rows permuted like Llama's.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# general.file_type (llama_ftype) of files whose weights are all 16-bit floats.
_GGUF_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def config_from_gguf(path: str | Path) -> ModelConfig:
    """Hyper-parameters from GGUF metadata (`<arch>.*` keys, as llama.cpp writes them)."""
    f = open_gguf(path)
    arch = f.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{f.path}: unsupported architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    missing = object()

    def value(key: str, default: Any, kind: type) -> Any:
        """`<arch>.<key>` checked against `kind` (ints must be positive); default if absent."""
        raw = f.get(f"{arch}.{key}", default)
        if raw is missing:
            raise ModelLoadError(f"{f.path}: metadata key '{arch}.{key}' is missing")
        if kind is int and isinstance(raw, list) and raw and len(set(raw)) == 1:
            raw = raw[0]  # a per-layer array with one value throughout
        ok = isinstance(raw, kind) and not isinstance(raw, bool)
        if kind is float:
            ok = isinstance(raw, int | float) and not isinstance(raw, bool) and raw > 0
        elif kind is int:
            ok = ok and raw > 0
        if not ok:
            raise ModelLoadError(
                f"{f.path}: metadata '{arch}.{key}' = {raw!r} is not a positive {kind.__name__}"
            )
        return kind(raw)

    hidden = value("embedding_length", missing, int)
    num_heads = value("attention.head_count", missing, int)
    head_dim = value("attention.key_length", max(hidden // num_heads, 1), int)
    rotary = value("rope.dimension_count", head_dim, int)
    if rotary != head_dim:
        raise ModelLoadError(
            f"{f.path}: partial rotary embeddings (rope.dimension_count {rotary} < head_dim "
            f"{head_dim}) are not supported"
        )
    num_kv_heads = value("attention.head_count_kv", num_heads, int)
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{f.path}: {num_heads} attention heads do not share {num_kv_heads} KV heads evenly"
        )
    embed = f.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelLoadError(f"{f.path}: tensor 'token_embd.weight' is missing or not 2-D")
    if "rope_freqs.weight" in f.tensors:
        raise ModelLoadError(
            f"{f.path}: tensor 'rope_freqs.weight' (Llama 3.1-style RoPE frequency factors) is "
            "not supported"
        )
    rope_scaling = None
    kind = f.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        rope_scaling = {
            "rope_type": "linear",
            "factor": value("rope.scaling.factor", missing, float),
        }
    elif kind not in ("none", ""):
        raise ModelLoadError(f"{f.path}: rope scaling type {kind!r} is not supported")
    sliding = f.get(f"{arch}.attention.sliding_window")
    eos_ids = tuple(
        dict.fromkeys(
            i
            for i in (f.get("tokenizer.ggml.eos_token_id"), f.get("tokenizer.ggml.eot_token_id"))
            if isinstance(i, int) and not isinstance(i, bool)
        )
    )
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(embed.shape[0]),
        hidden_size=hidden,
        intermediate_size=value("feed_forward_length", missing, int),
        num_layers=value("block_count", missing, int),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=value("attention.layer_norm_rms_epsilon", 1e-6, float),
        rope_theta=value("rope.freq_base", 10000.0, float),
        rope_scaling=rope_scaling,
        max_position_embeddings=value("context_length", 2048, int),
        tie_word_embeddings="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        # Quantized weights are dequantized to float32 unless a dtype is asked for.
        torch_dtype=_GGUF_FILE_DTYPES.get(f.get("general.file_type"), "float32"),
        sliding_window=sliding if isinstance(sliding, int) and sliding > 0 else None,
        eos_token_ids=eos_ids,
        stored_quantization=gguf_stored_quantization(f),
        stored_quantized_embedding=embed.type_name in _GGUF_LAYOUTS,
        stored_quantized_lm_head=f.tensors.get("output.weight", embed).type_name in _GGUF_LAYOUTS,
    )


# GGUF block types -> the engine layout that holds them: 4-bit blocks of 32 weights (Q4_K's
# sub-blocks too) land on int4 groups of 32; 5-, 6- and 8-bit blocks go to int8, which loses
# less of their precision than 4 bits would.
_GGUF_LAYOUTS = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4"}
_GGUF_LAYOUTS |= {"Q5_K": "int8", "Q6_K": "int8", "Q8_0": "int8"}
_LINEAR_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gguf_stored_quantization(f: GGUFFile) -> str:
    """The engine layout that most of the file's transformer linear weights are stored nearest
    to, weighted by element count: mixed files (llama.cpp's Q4_K_M keeps some tensors in Q6_K)
    take the majority's layout, since the engine quantizes every linear layer one way."""
    counts: dict[str, int] = {}
    for t in f.tensors.values():
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEAR_TENSORS:
            layout = _GGUF_LAYOUTS.get(t.type_name, "none")
            counts[layout] = counts.get(layout, 0) + math.prod(t.shape)
    return max(counts, key=counts.__getitem__) if counts else "none"
