"""Model hyper-parameters, and how a Hugging Face `config.json` gives them (a GGUF file's
metadata: controlplane.engine.gguf.config)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.engine.errors import ModelLoadError

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
    # its linear weights ("none" for float checkpoints; see gguf.config.gguf_stored_quantization).
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


def config_from_hf_dir(model_dir: str | Path) -> ModelConfig:
    """From a Hugging Face model directory's config.json."""
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
