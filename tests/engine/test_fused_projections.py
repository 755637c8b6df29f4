"""Fused q/k/v and gate/up projections against the separate ones, on the same weights.

The loader fuses at load (engine/model/llama.fuse_projections); here an engine runs once with
its model as loaded and once with the same checkpoint loaded unfused, and greedy outputs must
match token for token, under chunked prefill and preemption, for every architecture the engine
loads (Llama, Mistral, Qwen2 with q/k/v biases, and a GGUF file) and every weight format.
"""

from __future__ import annotations

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.gguf.known import resolve_model_path
from controlplane.engine.loader import load_model
from controlplane.engine.model.llama import MLP, Attention
from controlplane.engine.parts import quant_config
from tests.conftest import require_smollm2, run_to_end


def _unfused(eng: Engine, quantization: str) -> None:
    """Swap the engine's model for the same checkpoint loaded without fusion."""
    model = load_model(
        resolve_model_path(eng.settings.model),
        eng.model_config,
        eng.dtype,
        eng.device,
        eng.max_model_len,
        eng.settings.cpu_weight_packing,
        quant_config(quantization, eng.settings, eng.model_config),
        fuse=False,
    )
    eng.model = eng.runner.model = model


def _greedy(eng: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return run_to_end(eng, prompts, [params] * len(prompts))


def _prompts(vocab: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    # Lengths from 3 to ~100 tokens: several prefill chunks of 32, mixed with decodes.
    return [torch.randint(3, vocab - 8, (3 + 7 * i,), generator=gen).tolist() for i in range(count)]


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_fused_and_separate_projections_give_the_same_tokens(kind, quantization, hf_model_dirs):
    kw = dict(
        model=str(hf_model_dirs[kind]),
        dtype="float32",
        quantization=quantization,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        prefill_chunk_size=32,
        num_kv_blocks=12,  # 192 slots for 8 sequences of up to ~100 tokens: preemption
        block_size=16,
    )
    fused = Engine(**kw)
    layer = fused.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
    separate = Engine(**kw)
    _unfused(separate, quantization)
    assert separate.model.model.layers[0].self_attn.qkv_proj is None
    prompts = _prompts(fused.model_config.vocab_size, 12)
    a, b = _greedy(fused, prompts, 16), _greedy(separate, prompts, 16)
    assert a == b
    assert fused.scheduler.num_preemptions > 0


def test_fused_projections_on_the_gguf_path():
    path = require_smollm2()
    kw = dict(model=str(path), kv_cache_memory_bytes=64 << 20, max_num_seqs=4)
    fused, separate = Engine(**kw), Engine(**kw)
    _unfused(separate, "auto")
    modules = list(fused.model.modules())
    assert sum(isinstance(m, Attention) and m.qkv_proj is not None for m in modules) == 30
    assert sum(isinstance(m, MLP) and m.gate_up_proj is not None for m in modules) == 30
    ids = fused.tokenizer.encode("The three primary colours are red, yellow and")
    prompts = [ids, ids[:5], ids[3:]]
    assert _greedy(fused, prompts, 24) == _greedy(separate, prompts, 24)
