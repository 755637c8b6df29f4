"""Model hyper-parameters parsed from a Hugging Face `config.json` or a GGUF file's metadata."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from controlplane.engine.gguf.file import GGUFFile

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    torch_dtype: str
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    # What `quantization = "auto"` keeps: the engine layout nearest to how the checkpoint stores
    # its linear weights ("none" for float checkpoints; see gguf_stored_quantization).
    stored_quantization: str = "none"
    # Whether the checkpoint stores the token embedding table / the lm_head block-quantized
    # (a tied lm_head is the embedding table): `quantization = "auto"` then serves them int8.
    stored_quantized_embedding: bool = False
    stored_quantized_lm_head: bool = False

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs for one token: 2 x matmul params (lm_head included) + attention."""
        embed_rows = self.vocab_size * self.hidden_size
        matmul_params = self.num_params - embed_rows * (0 if self.tie_word_embeddings else 1)
        attn = 4 * self.num_layers * self.num_heads * self.head_dim * context_len
        return 2.0 * matmul_params + attn


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """From a model directory's config.json, or from a `.gguf` file's metadata."""
    if str(model_dir).lower().endswith(".gguf"):
        return config_from_gguf(model_dir)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (a model directory needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: unsupported architecture {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        if key not in raw:
            raise ModelLoadError(f"{path}: missing key {key!r}")
        return raw[key]

    num_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    # transformers < 5 writes rope_theta + rope_scaling; 5.x writes one rope_parameters dict.
    rope_params = raw.get("rope_parameters") or {}
    rope_scaling = raw.get("rope_scaling") or (
        rope_params if rope_params.get("rope_type", "default") != "default" else None
    )
    rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind not in ("default", "llama3", "linear"):
            raise ModelLoadError(f"{path}: rope_scaling type {kind!r} is not supported")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    return ModelConfig(
        architecture=arch,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias; Llama/Mistral only with attention_bias.
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        sliding_window=sliding if isinstance(sliding, int) else None,
        eos_token_ids=eos_ids,
    )


# GGUF `general.architecture` -> the transformers class whose layout it holds. llama.cpp writes
# Mistral (7B-style) checkpoints as "llama", Q/K rows permuted like Llama's.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# general.file_type (llama_ftype) of files whose weights are all 16-bit floats.
_GGUF_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def config_from_gguf(path: str | Path) -> ModelConfig:
    """Hyper-parameters from GGUF metadata (`<arch>.*` keys, as llama.cpp writes them)."""
    from controlplane.engine.gguf.file import open_gguf

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
