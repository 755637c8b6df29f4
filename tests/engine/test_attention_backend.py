"""engine.attention_backend: which backend each setting gives, that the CPU daemon never imports
triton, and the Triton kernels (under the interpreter) serving whole engines: greedy outputs
token-identical to the torch backend for 16 concurrent mixed requests under chunked prefill,
recompute and swap preemption, prefix hits, speculation and an 8-bit cache. The kernels
themselves are tested in tests/engine/test_triton_attention.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.attention.cpu import CpuPagedAttention
from controlplane.engine.attention.torch_paged import TorchPagedAttention
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.kernels import cpu_ops
from controlplane.engine.kv_cache import KVCache, KVCacheSpec
from controlplane.engine.parts import make_backend
from tests.conftest import (
    BACKEND_CASES,
    engine_on_torch_tokens,
    run_to_end,
    speculation_prompts,
)

CPU = torch.device("cpu")


def test_setting_and_choice():
    with pytest.raises(InvalidSettingError, match="attention_backend"):
        Engine(model="unused", attention_backend="flash")
    kv = KVCache(KVCacheSpec(1, 1, 16, 16, torch.float32), 2, 0, CPU)
    # auto on a CPU: our kernel where it builds (tests/engine/test_cpu_attention.py covers the rest)
    expected = CpuPagedAttention if cpu_ops.available() else TorchPagedAttention
    assert type(make_backend("auto", kv, CPU)) is expected
    assert type(make_backend("torch", kv, CPU)) is TorchPagedAttention


def test_the_default_cpu_engine_never_loads_the_triton_backend(tiny_model_dir):
    # (torch itself imports the triton package when it is installed: what matters is that
    # the CPU engine neither needs it nor loads our kernels.)
    code = (
        "import sys; from controlplane.engine import Engine; "
        f"e = Engine(model={str(tiny_model_dir)!r}, kv_cache_memory_bytes=1 << 20); "
        "print(type(e.runner.backend).__name__); "
        "sys.exit('controlplane.engine.attention.triton' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"the engine loaded the kernels\n{result.stderr[-2000:]}"
    assert result.stdout.strip().endswith(
        "CpuPagedAttention" if cpu_ops.available() else "TorchPagedAttention"
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind, preemption, kv_dtype", BACKEND_CASES)
def test_triton_engine_gives_the_torch_tokens(kind, preemption, kv_dtype, hf_model_dirs):
    pytest.importorskip("triton")
    tri = engine_on_torch_tokens("triton", hf_model_dirs[kind], preemption, kv_dtype)
    assert type(tri.runner.backend).__name__ == "TritonPagedAttention"
    assert tri.scheduler.num_preemptions > 0
    assert tri.stats().prefix_cache_hits_total > 0


@pytest.mark.slow
def test_triton_engine_with_speculation(hf_model_dirs):
    pytest.importorskip("triton")
    kw = dict(model=str(hf_model_dirs["qwen2"]), dtype="float32", max_num_seqs=4)
    ref, tri = Engine(attention_backend="torch", **kw), Engine(attention_backend="triton", **kw)
    for eng in (ref, tri):
        eng.update_settings(
            speculative_method="ngram", speculative_num_tokens=3, speculative_ngram_min=1
        )
    prompts = speculation_prompts()
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 3
    assert run_to_end(tri, prompts, params) == run_to_end(ref, prompts, params)
    assert tri.stats().spec_decode_num_draft_tokens_total > 0
