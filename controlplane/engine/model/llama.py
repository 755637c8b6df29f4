"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat ragged batch.

The forward takes every scheduled token of every sequence as one flat [T] batch (no padding
between sequences): prompt chunks and single decode tokens side by side. Attention reads and
writes K/V through the paged cache via an `AttentionBackend`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from controlplane.engine.attention.backend import AttentionBackend, AttentionMetadata
from controlplane.engine.model.config import ModelConfig

if TYPE_CHECKING:
    from controlplane.engine.parallel.tensor_parallel import ShardPlan, TensorParallel


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position; a step gathers its rows once for all layers."""

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim], HF's rotate_half layout
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, head_dim]: broadcasts over heads.
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(
            1
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then scale in the model dtype.
        # The mean of squares is summed in float64: the one reduction of a compiled step, and
        # inductor sums in another order than eager's kernel, so in float32 a row's scale could
        # differ by an ulp and flip bf16 roundings downstream (SmolLM2, 296 decode rows: 7
        # differed from eager in bf16, 47 in float32; 0 and 0 in float64). Each float32 square
        # is exact in float64, so the order no longer shows once the result is rounded back.
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True, dtype=torch.float64)
        xf = xf * torch.rsqrt(var + self.eps).float()
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False)
        self.qkv_sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        self.qkv_proj: nn.Module | None = None  # set by fuse_projections
        # What a compiled step calls for attention: the backend's graph_op (set_graph_attention)
        self.graph_op = torch.ops.controlplane.paged_attention

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend | None,
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if backend is None:  # compiled: the opaque op of the current attention_step
            out = self.graph_op(q, k, v, self.layer_idx)
        else:
            out = backend.forward(self.layer_idx, q, k, v, meta)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by fuse_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


def _concat(linears: list[nn.Linear]) -> nn.Linear:
    """One linear computing every one of `linears` (outputs side by side)."""
    first = linears[0]
    fused = nn.Linear(first.in_features, sum(x.out_features for x in linears), bias=False)
    fused.weight = nn.Parameter(torch.cat([x.weight.detach() for x in linears]), False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([x.bias.detach() for x in linears]), False)
    return fused


def fuse_projections(model: nn.Module) -> int:
    """q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`, in every layer; returns
    how many fused linears were made.

    Done on the float weights, before quantization or packing, so every later kernel sees one
    wider matmul instead of three (two) that each re-read the same activations: 210 -> 120
    quantized matmuls a token on SmolLM2. Each output row keeps its own weights, scales and
    groups, so the results are those of the separate projections. The concatenation copies the
    weights (a memory-mapped checkpoint's pages of those tensors are then left to the OS).
    """
    count = 0
    for module in list(model.modules()):  # a list: the loop replaces children
        if isinstance(module, Attention) and module.qkv_proj is None:
            module.qkv_proj = _concat([module.q_proj, module.k_proj, module.v_proj])
            del module.q_proj, module.k_proj, module.v_proj
            count += 1
        elif isinstance(module, MLP) and module.gate_up_proj is None:
            module.gate_up_proj = _concat([module.gate_proj, module.up_proj])
            del module.gate_proj, module.up_proj
            count += 1
    return count


def set_graph_attention(model: nn.Module, op: object) -> None:
    """Make `op` (an AttentionBackend.graph_op) what every layer of a compiled step calls."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.graph_op = op


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tensor parallel: o_proj and down_proj multiply this rank's slice of their inputs;
        # the sum over ranks is the layer's output.
        self.reduce = _identity if tp is None else tp.all_reduce

    def forward(self, x, cos, sin, backend, meta):
        x = x + self.reduce(self.self_attn(self.input_layernorm(x), cos, sin, backend, meta))
        return x + self.reduce(self.mlp(self.post_attention_layernorm(x)))


class VocabParallelEmbedding(nn.Module):
    """One rank's rows [start, start + num) of the embedding table: ids outside them look up
    zeros, and the sum over ranks is the full lookup.

    The rows are looked up in `weight`, or in `table` once `use_table` swaps one in (an int8
    table of the same rows, quant.quantize_model): the masking and the all-reduce stay here."""

    def __init__(self, num: int, dim: int, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim))
        self.table: nn.Module | None = None
        self.start, self.num, self.tp = start, num, tp

    def use_table(self, table: nn.Module) -> None:
        """Look rows up in `table` (this rank's rows, ids local to them) from now on; the
        float `weight` is dropped (a tied lm_head keeps its own reference)."""
        self.table = table
        del self.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num)
        local = local.masked_fill(outside, 0)
        out = F.embedding(local, self.weight) if self.table is None else self.table(local)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class Backbone(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TensorParallel | None = None, vocab_start: int = 0
    ) -> None:
        super().__init__()
        if tp is None:
            self.embed_tokens: nn.Module = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, vocab_start, tp
            )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names match transformers' *ForCausalLM, so checkpoints load by name.

    Tensor parallel (`shards`: this rank's plan, `cfg` its local configuration, see
    engine/parallel): the same modules over this rank's heads, MLP rows and vocabulary slice,
    with the all-reduces and the logits' gather the split needs; every rank returns the whole
    logits."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_len: int,
        tp: TensorParallel | None = None,
        shards: ShardPlan | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.vocab_size = cfg.vocab_size if shards is None else shards.vocab_size
        self.model = Backbone(cfg, tp, 0 if shards is None else shards.vocab.start)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg, max_len)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        backend: AttentionBackend | None,  # None: attention through attention_step's op
        meta: AttentionMetadata | None,
        logits_indices: torch.Tensor,  # [N] rows of the flat batch whose next token we sample
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, backend, meta)
        # Only rows we sample from need the final norm and the (large) vocabulary projection.
        x = self.model.norm(x[logits_indices])
        logits = self.lm_head(x).float()  # [N, vocab] (tensor parallel: this rank's slice)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.vocab_size)
        return logits
