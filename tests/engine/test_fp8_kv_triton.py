"""An FP8 e4m3 KV cache (engine.kv_cache_dtype = fp8_e4m3) read by the Triton attention
kernels inside a whole engine (under the interpreter on a CPU), against the torch backend.

The kernels themselves over an fp8 cache are checked in tests/engine/test_triton_attention.py
(test_8bit_kvcache_matches_torch_backend, test_8bit_cache_matches_dequantized_reference); the
slow whole-engine cases of test_attention_backend.py run int8 caches only. This is the small
engine-level fp8 case: the engine writes its cache through the Triton write kernel and reads
it through the Triton attention kernels, and its greedy tokens are the torch backend's.
"""

from __future__ import annotations

import pytest

from controlplane.engine import Engine, SamplingParams
from tests.conftest import run_to_end

pytest.importorskip("triton")


def test_fp8_kv_cache_through_the_triton_kernels_gives_the_torch_tokens(tiny_model_dir):
    kw = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        kv_cache_dtype="fp8_e4m3",
        block_size=16,
        num_kv_blocks=24,
        max_num_seqs=4,
        prefill_chunk_size=32,
        max_num_batched_tokens=48,
        compile="off",
    )
    ref = Engine(attention_backend="torch", **kw)
    tri = Engine(attention_backend="triton", **kw)
    assert type(tri.runner.backend).__name__ == "TritonPagedAttention"
    assert str(tri.kv_cache.k[0].dtype) == "torch.float8_e4m3fn"
    # Prompts across block boundaries and a chunk boundary (40 > prefill_chunk_size).
    prompts = [[(11 * i + 5 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 17, 40))]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * len(prompts)
    want = run_to_end(ref, prompts, params)
    got = run_to_end(tri, prompts, params)
    assert all(len(tokens) == 8 for tokens in want)
    # Sensitive enough: the same engine on a float32 cache gives the 40-token prompt other
    # tokens from its third on, so a code the kernels decode wrongly would show here.
    assert got == want
    assert tri.block_pool.num_used == 0
