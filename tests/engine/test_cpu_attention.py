"""Our CPU decode-attention kernel (csrc/cpu_ops.cpp, the `cpu` attention backend): against
the torch backend's SDPA over gathered blocks for every cache dtype, query dtype and GQA shape
we serve, the fused K/V write, batch invariance, whole engines giving the torch backend's
tokens, and the fallback when the kernels cannot be built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from controlplane.engine.attention.backend import SeqSpan
from controlplane.engine.attention.cpu import CpuPagedAttention
from controlplane.engine.attention.torch_paged import TorchPagedAttention
from controlplane.engine.kernels import cpu_ops
from controlplane.engine.kv_cache import KVCache, KVCacheSpec
from tests.conftest import BACKEND_CASES, engine_on_torch_tokens
from tests.kernels import require_kernels

CPU = torch.device("cpu")
BS = 16

# Skipped where the kernels cannot build; under CI a failed build fails instead.
require_kernels()


def _filled_cache(kv_dtype: torch.dtype, kv_heads: int, dim: int, blocks: int) -> KVCache:
    kv = KVCache(KVCacheSpec(2, kv_heads, dim, BS, kv_dtype), blocks, 0, CPU)
    g = torch.Generator().manual_seed(1)
    for layer in range(2):
        k, v = (torch.randn(blocks * BS, kv_heads, dim, generator=g) for _ in range(2))
        kv.write(layer, torch.arange(blocks * BS), k, v)
    return kv


def _spans(lens: list[int], blocks: int) -> list[SeqSpan]:
    """Decode spans, longest first (the runner's order), on scattered blocks."""
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(2)).tolist()
    spans, used = [], 0
    for n in sorted(lens, reverse=True):
        need = -(-n // BS)
        spans.append(SeqSpan(1, n, perm[used : used + need]))
        used += need
    return spans


def _decode(backend_cls, kv, spans, q, layer=1):
    backend = backend_cls(kv)
    meta = backend.prepare(spans, CPU)
    return torch.cat([backend._decode(layer, q[d.start : d.end], d) for d in meta.decodes])


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]
)
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 2, 128), (4, 4, 32), (8, 2, 24)])
def test_kernel_matches_the_torch_backend(q_dtype, kv_dtype, heads, kv_heads, dim):
    # Lengths on and off block boundaries, one token, and longer ones cut into three and six
    # partitions of 128 tokens (the torch backend buckets them apart).
    lens = [1, 15, 16, 17, 100, 300, 700]
    kv = _filled_cache(kv_dtype, kv_heads, dim, blocks=96)
    spans = _spans(lens, 96)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(3))
    q = q.to(q_dtype)
    ours = _decode(CpuPagedAttention, kv, spans, q)
    ref = _decode(TorchPagedAttention, kv, spans, q)
    assert ours.dtype == q_dtype and ours.shape == q.shape
    # float32 agrees to rounding; a bf16 query's output is rounded to bf16 by both (one ulp).
    tol = 2e-6 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    kv = _filled_cache(torch.bfloat16, 3, 64, blocks=96)
    lens = [250, 7, 64, 129, 33, 1, 90, 600]
    spans = _spans(lens, 96)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    together = _decode(CpuPagedAttention, kv, spans, q)
    for i, span in enumerate(spans):
        alone = _decode(CpuPagedAttention, kv, [span], q[i : i + 1])
        assert torch.equal(alone[0], together[i]), f"row {i} differs alone"


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (32, 4, 64), (16, 2, 128)])
def test_bf16_attention_stays_within_bf16_rounding_of_the_exact_result(heads, kv_heads, dim):
    # bf16 queries on a bf16 cache (with AVX512-BF16: scores and the weighted sum of V by bf16
    # dot products, the probabilities rounded to bf16 for the latter; 8 query heads a KV head
    # take the register-sized runs of 6 + 2 and 3 + 3 + 2 heads): against float64 on the same
    # stored values, off by at most the output's rounding and each probability's (2^-9
    # relative each), for lengths odd and even, one token, and split into partitions.
    lens = [1, 2, 15, 33, 256, 257, 700]
    kv = _filled_cache(torch.bfloat16, kv_heads, dim, blocks=96)
    spans = _spans(lens, 96)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(7)).bfloat16()
    ours = _decode(CpuPagedAttention, kv, spans, q).double()
    group = heads // kv_heads
    for i, span in enumerate(spans):
        blocks = torch.tensor(span.block_table)
        slots = (blocks[:, None] * BS + torch.arange(BS)).flatten()[: span.context_len]
        k = kv.k[1][slots].double().repeat_interleave(group, dim=1)  # [tokens, heads, dim]
        v = kv.v[1][slots].double().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[i].double(), k) / dim**0.5, dim=-1)
        exact = torch.einsum("ht,thd->hd", p, v)
        bound = 1.5 * 2**-9 * (exact.abs() + torch.einsum("ht,thd->hd", p, v.abs())) + 1e-6
        err = (ours[i] - exact).abs()
        assert (err <= bound).all(), f"row {i}: {(err / bound).max():.2f}x the bound"


def test_bf16_dot_off_gives_the_float_kernels_results():
    # engine.bf16_dot = false: bf16 queries on a bf16 cache in float32 scores and sums, as a
    # float32 query of the same values (exact in float32) gets them, rounded to bf16 at the end.
    kv = _filled_cache(torch.bfloat16, 3, 64, blocks=96)
    spans = _spans([1, 17, 100, 300], 96)
    q = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    backend = CpuPagedAttention(kv, bf16_dot=False)
    meta = backend.prepare(spans, CPU)
    off = torch.cat([backend._decode(1, q[d.start : d.end], d) for d in meta.decodes])
    as_float = _decode(CpuPagedAttention, kv, spans, q.float())
    assert torch.equal(off, as_float.bfloat16())
    on = _decode(CpuPagedAttention, kv, spans, q)
    # With AVX512-BF16 the default takes other (bf16-rounded probability) sums: not the same bits.
    assert torch.equal(on, off) != torch.ops.controlplane_cpu.bf16_dot_supported()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_the_fused_write_stores_what_kv_cache_write_stores(kv_dtype):
    spans = _spans([40, 17, 1], 16)
    ours, ref = _filled_cache(kv_dtype, 2, 32, 16), _filled_cache(kv_dtype, 2, 32, 16)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, n, 32, generator=g) for n in (4, 2, 2))
    a, b = CpuPagedAttention(ours), TorchPagedAttention(ref)
    out = a.forward(0, q, k, v, a.prepare(spans, CPU))
    expected = b.forward(0, q, k, v, b.prepare(spans, CPU))
    assert torch.equal(ours.k[0], ref.k[0]) and torch.equal(ours.v[0], ref.v[0])
    assert not torch.equal(ours.k[0], _filled_cache(kv_dtype, 2, 32, 16).k[0])  # it wrote
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_step_attention_is_the_backends_forward_for_the_step_it_was_given(kv_dtype):
    # The op a compiled step calls (graph_op): the step's metadata set in C++ by begin_step,
    # one layer's attention by index, the new rows' K/V written as forward writes them.
    spans = _spans([40, 17, 1], 16)
    ours, ref = _filled_cache(kv_dtype, 2, 32, 16), _filled_cache(kv_dtype, 2, 32, 16)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, n, 32, generator=g).bfloat16() for n in (4, 2, 2))
    a, b = CpuPagedAttention(ours), CpuPagedAttention(ref)
    op = a.graph_op()
    assert op is torch.ops.controlplane_cpu.step_attention
    meta = a.prepare(spans, CPU)
    a.begin_step(meta)
    try:
        out = op(q, k, v, 1)
        with pytest.raises(RuntimeError, match="layer 2 of 2"):
            op(q, k, v, 2)
    finally:
        a.end_step()
    expected = b.forward(1, q, k, v, b.prepare(spans, CPU))
    assert torch.equal(out, expected)
    assert torch.equal(ours.k[1], ref.k[1]) and torch.equal(ours.v[1], ref.v[1])
    assert torch.equal(ours.k[0], ref.k[0])  # layer 0 untouched
    with pytest.raises(RuntimeError, match="outside a decode step"):
        op(q, k, v, 1)  # end_step let go of the step


def test_an_8_bit_cache_keeps_the_python_graph_op():
    # step_attention has the kernel write K/V as it is; 8-bit caches are quantized by
    # KVCache.write, which the Python custom op's forward calls.
    kv = _filled_cache(torch.int8, 2, 32, 4)
    assert CpuPagedAttention(kv).graph_op() is torch.ops.controlplane.paged_attention


def test_errors_name_the_argument():
    kv = _filled_cache(torch.float32, 2, 32, 4)
    op = torch.ops.controlplane_cpu.paged_decode_attention
    q = torch.randn(1, 4, 32)
    lens = torch.tensor([5])
    with pytest.raises(RuntimeError, match="block_table"):
        op(q, kv.k[0], kv.v[0], None, None, torch.zeros(1, 1, dtype=torch.int32), lens, BS, 1.0)
    with pytest.raises(RuntimeError, match="unsupported query dtype"):
        op(q.to(torch.int32), kv.k[0], kv.v[0], None, None, torch.zeros(1, 1).long(), lens, BS, 1.0)


@pytest.mark.parametrize("kind, preemption, kv_dtype", BACKEND_CASES)
def test_engine_gives_the_torch_backends_tokens(kind, preemption, kv_dtype, hf_model_dirs):
    ours = engine_on_torch_tokens("cpu", hf_model_dirs[kind], preemption, kv_dtype)
    assert type(ours.runner.backend) is CpuPagedAttention
    assert ours.scheduler.num_preemptions > 0
    assert ours.stats().prefix_cache_hits_total > 0


def test_without_a_compiler_auto_keeps_torch_and_cpu_says_why(tiny_model_dir, tmp_path):
    # A real failed build: no C++ compiler (CXX=false) and an empty extensions directory.
    code = (
        "from controlplane.engine import Engine\n"
        "from controlplane.engine.errors import InvalidSettingError\n"
        f"e = Engine(model={str(tiny_model_dir)!r}, kv_cache_memory_bytes=1 << 20)\n"
        "print(type(e.runner.backend).__name__)\n"
        "try:\n"
        f"    Engine(model={str(tiny_model_dir)!r}, kv_cache_memory_bytes=1 << 20, "
        "attention_backend='cpu')\n"
        "except InvalidSettingError as exc:\n"
        "    print('refused:', exc)\n"
    )
    env = dict(os.environ, CXX="false", TORCH_EXTENSIONS_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "TorchPagedAttention"
    assert lines[1].startswith("refused:") and "attention_backend" in lines[1]
    assert "Compiler" in lines[1] or "Error building extension" in lines[1]


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_start(tmp_path):
    # A process killed mid-build leaves torch's lock file, which torch alone waits on forever.
    # torch takes that lock before every load, built or not: so the build this process already
    # has is copied in first, and the start below finds it up to date (a build from scratch
    # made this test 45 s of CI's two cores; it still builds when there is nothing to copy).
    from torch.utils.cpp_extension import _get_build_directory

    if cpu_ops.available():
        name = cpu_ops.build_spec()[0]
        built = _get_build_directory(name, False)
        shutil.copytree(built, tmp_path / name, ignore=shutil.ignore_patterns("lock"))
    code = (
        "import os, time\n"
        "from torch.utils.cpp_extension import _get_build_directory\n"
        "from controlplane.engine.kernels import cpu_ops\n"
        "d = _get_build_directory(cpu_ops.build_spec()[0], False)\n"
        "os.makedirs(d, exist_ok=True)\n"
        "lock = os.path.join(d, 'lock')\n"
        "open(lock, 'w').close()\n"
        "os.utime(lock, (time.time() - 3600, time.time() - 3600))\n"
        "print(cpu_ops.available(), cpu_ops.build_error())\n"
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True", result.stdout
    assert "never finished" in result.stderr
