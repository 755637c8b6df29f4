"""The KV cache in 8 bits (engine.kv_cache_dtype = int8 / fp8_e4m3), on the torch backend.

The number format (a scale per token and KV head, written with the row), what a block costs,
that swap and recompute preemption, prefix-cache hits, chunked prefill and speculation give
the very tokens of an unpreempted, unchunked run on the same 8-bit cache, and its fidelity on
real text: SmolLM2's perplexity within 1% of the model-dtype cache, greedy outputs close.
"""

from __future__ import annotations

import math

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.kv_cache import KVCache, KVCacheSpec, dequantize_kv, quantize_kv
from tests.conftest import (
    MIXED_ENGINE,
    mixed_workload,
    require_smollm2,
    run_to_end,
    speculation_prompts,
)
from tests.engine.test_quant import TEXT, _perplexity, _prefill_logits

EIGHT_BIT = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


@pytest.mark.parametrize("name", sorted(EIGHT_BIT))
def test_quantize_round_trip_error(name):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-3, 2, 50).view(50, 1, 1)
    x[7, 1] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_kv(x, EIGHT_BIT[name])
    assert q.dtype == EIGHT_BIT[name] and scale.shape == (50, 3) and scale.dtype == torch.float32
    back = dequantize_kv(q, scale, torch.float32)
    assert torch.equal(back[7, 1], torch.zeros(64))
    amax = x.abs().amax(-1, keepdim=True)
    err = ((back - x).abs() / amax.clamp_min(1e-30)).amax().item()
    # int8: half a step of amax / 127; e4m3: 3 mantissa bits, half an ulp = 1/16 relative.
    assert err <= {"int8": 0.5 / 127 + 1e-6, "fp8_e4m3": 1 / 16}[name]
    assert err > 0  # it is lossy: the comparison above measured something


def test_an_8bit_block_costs_about_half_a_16bit_one():
    spec16 = KVCacheSpec(
        num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16
    )
    spec8 = KVCacheSpec(30, 3, 64, 16, torch.int8)
    # 64 bytes of values + a 4-byte scale per token and head, against 128 bytes.
    assert spec8.bytes_per_block * 128 == spec16.bytes_per_block * 68
    budget = 64 << 20
    ratio = (budget // spec8.bytes_per_block) / (budget // spec16.bytes_per_block)
    assert 1.85 < ratio < 1.9


@pytest.mark.parametrize("name", sorted(EIGHT_BIT))
def test_swap_and_copy_move_values_and_scales(name):
    spec = KVCacheSpec(2, 2, 16, 4, EIGHT_BIT[name])
    kv = KVCache(spec, num_blocks=6, num_swap_blocks=3, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 8, 2, 16, generator=gen)
    slots = torch.arange(4, 12)  # blocks 1 and 2
    for layer in range(2):
        kv.write(layer, slots, k * (layer + 1), v)
    before = [kv.read_blocks(layer, torch.tensor([1, 2]), torch.float32) for layer in range(2)]
    kv.swap_out([1, 2], [0, 2])
    kv.swap_in([0, 2], [4, 3])
    kv.copy([4], [5])
    for layer in range(2):
        got = kv.read_blocks(layer, torch.tensor([5, 3]), torch.float32)
        assert torch.equal(got[0], before[layer][0]) and torch.equal(got[1], before[layer][1])
        x = k * (layer + 1)
        assert ((got[0] - x).abs() <= x.abs().amax(-1, keepdim=True) / 16).all()


@pytest.mark.parametrize("name", sorted(EIGHT_BIT))
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_chunking_and_prefix_hits_do_not_change_8bit_outputs(
    name, preemption, hf_model_dirs
):
    common = dict(model=str(hf_model_dirs["llama"]), dtype="float32", kv_cache_dtype=name)
    # Reference: one sequence at a time, whole prompts in one step, no prefix cache, room to spare.
    ref = Engine(**common, max_num_seqs=1, num_kv_blocks=400, enable_prefix_caching=False)
    tight = Engine(
        **common,
        **MIXED_ENGINE,
        preemption_mode=preemption,
    )
    prompts, params = mixed_workload(ref.model_config.vocab_size, 7, 12)
    assert run_to_end(tight, prompts, params) == run_to_end(ref, prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert tight.stats().prefix_cache_hits_total > 0
    assert tight.kv_cache.k[0].dtype == EIGHT_BIT[name]
    assert tight.memory.kv_cache_dtype == str(EIGHT_BIT[name]).removeprefix("torch.")


def test_speculation_on_an_8bit_cache_gives_the_plain_tokens(hf_model_dirs):
    kw = dict(model=str(hf_model_dirs["qwen2"]), dtype="float32", kv_cache_dtype="int8")
    plain, spec = Engine(**kw), Engine(**kw)
    spec.update_settings(
        speculative_method="ngram", speculative_num_tokens=3, speculative_ngram_min=1
    )
    prompts = speculation_prompts()
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 3
    assert run_to_end(spec, prompts, params) == run_to_end(plain, prompts, params)
    assert spec.stats().spec_decode_num_draft_tokens_total > 0


def test_kv_cache_dtype_setting_and_block_count(tiny_model_dir):
    with pytest.raises(InvalidSettingError, match="kv_cache_dtype"):
        Engine(model=str(tiny_model_dir), kv_cache_dtype="int4")
    # kv_cache_memory_bytes is the CPU's budget (a GPU's is gpu_memory_utilization).
    kw = dict(
        model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20
    )
    budget = kw["kv_cache_memory_bytes"]
    full = Engine(**kw)
    eight = Engine(kv_cache_dtype="int8", **kw)
    d = full.model_config.head_dim
    assert eight.block_pool.num_blocks == budget // eight.kv_cache.spec.bytes_per_block
    # float32 values (4 bytes) against int8 values plus a float32 scale per head.
    expected = (4 * d) / (d + 4)
    assert abs(eight.block_pool.num_blocks / full.block_pool.num_blocks - expected) < 0.05
    assert "int8" in eight.memory.describe()
    kv = eight.kv_cache
    tensors = (*kv.k, *kv.v, *kv.k_scale, *kv.v_scale)
    assert eight.memory.kv_cache_bytes == sum(t.numel() * t.element_size() for t in tensors)


# -- fidelity on real text (SmolLM2) --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EIGHT_BIT))
def test_smollm2_8bit_kv_perplexity_and_greedy_outputs(name):
    path = require_smollm2()
    # float32 activations pin the baseline (a float32 cache) on every CPU.
    kw = dict(model=str(path), dtype="float32", kv_cache_memory_bytes=64 << 20, max_num_seqs=4)
    base, eight = Engine(**kw), Engine(kv_cache_dtype=name, **kw)
    ids = base.tokenizer.encode(TEXT.read_text())
    # Chunks of 64: all but each chunk's own rows attend to keys read back from the cache
    # (and those are rounded as stored too: KVCache.as_stored).
    for eng in (base, eight):
        eng.update_settings(prefill_chunk_size=64, max_num_batched_tokens=64)
    ppl = [_perplexity(_prefill_logits(eng, [ids])[0], ids) for eng in (base, eight)]
    print(f"SmolLM2 perplexity, KV {base.memory.kv_cache_dtype} {ppl[0]:.4f}, {name} {ppl[1]:.4f}")
    assert abs(ppl[1] / ppl[0] - 1) < 0.01

    # Greedy continuations of a few prompts: where they first differ, each side's token is
    # among the other's 5 most likely.
    prompts = [ids[i : i + 24] for i in range(0, 240, 40)]
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)]
    runs = []
    for eng in (base, eight):
        rids = [eng.add_request(p, params[0]) for p in prompts]
        tops: dict[str, list[set[int]]] = {r: [] for r in rids}  # each position's top 5
        tokens: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                tops[o.request_id] += [{t for t, _ in lp.top} for lp in o.logprobs]
                if o.finished:
                    tokens[o.request_id] = list(o.token_ids)
        runs.append([(tokens[r], tops[r]) for r in rids])
    same = 0
    for (a, a_top), (b, b_top) in zip(*runs, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if first is None:
            same += 1
            continue
        assert a[first] in b_top[first] and b[first] in a_top[first]
    print(f"{name}: {same} of {len(prompts)} greedy continuations identical over 32 tokens")
    assert math.isfinite(ppl[1])
