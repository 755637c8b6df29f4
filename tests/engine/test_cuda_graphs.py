"""CUDA graphs of the decode step (controlplane/engine/cuda_graphs.py).

On a CPU (Triton's interpreter, set up by conftest) everything but the graph itself: the
static metadata the Triton backend refills in place gives the kernels' unpadded results
(padding rows write nothing, contexts across partitions, stale table columns), the static
buffers hold the right padding at capture and replay, and an engine whose decode steps go
through `CallAgain` (the CPU stand-in for a graph) gives the plain engine's greedy tokens for
16 concurrent mixed requests, and captures through the compiled step never fall back to eager
(no recompile on the static buffers). Marked `gpu` (skipped without CUDA): capture at start, replay
against compile-without-graphs, and live knob changes that never capture again.
"""

from __future__ import annotations

import bisect

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.attention.backend import SeqSpan
from controlplane.engine.attention.torch_paged import TorchPagedAttention
from controlplane.engine.attention.triton import PARTITION, TritonPagedAttention
from controlplane.engine.cuda_graphs import (
    CallAgain,
    CudaGraphDecode,
    capture_sizes,
    graphs_enabled,
)
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.kv_cache import KVCache, KVCacheSpec
from controlplane.engine.settings import EngineSettings, check, decode_row_ceilings
from tests.conftest import MIXED_ENGINE, mixed_workload, run_to_end

pytest.importorskip("triton")

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _spans(contexts: list[int], bs: int, gen: torch.Generator) -> list[SeqSpan]:
    """Decode spans over shuffled blocks 1.. (block 0 is the padding rows' block)."""
    need = [-(-c // bs) for c in contexts]
    blocks = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    spans, used = [], 0
    for ctx, n in zip(contexts, need, strict=True):
        spans.append(SeqSpan(1, ctx, blocks[used : used + n]))
        used += n
    return spans


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_static_metadata_gives_the_unpadded_decode(kv_dtype):
    """Batches of 8, 5, 3 and 1 rows padded to 8, 8, 4 and 1 in one set of static tensors
    sized for 2048 tokens (4 partitions), refilled one after the other (longest first, so the
    later, shorter batches leave stale table columns behind), against `prepare`'s tight
    metadata: the same outputs and the same cache bytes (padding rows write nothing)."""
    bs, kv_heads, heads, dim = 16, 2, 4, 32
    gen = torch.Generator().manual_seed(1)
    caches = [KVCache(KVCacheSpec(1, kv_heads, dim, bs, kv_dtype), 256, 0, CPU) for _ in "ab"]
    for name in ("k", "v"):
        fill = torch.randn(getattr(caches[0], name)[0].shape, generator=gen).to(kv_dtype)
        for c in caches:
            getattr(c, name)[0].copy_(fill)
    if kv_dtype == torch.int8:
        for name in ("k_scale", "v_scale"):
            fill = torch.rand(getattr(caches[0], name)[0].shape, generator=gen) / 50
            for c in caches:
                getattr(c, name)[0].copy_(fill)
    plain, static = TritonPagedAttention(caches[0]), TritonPagedAttention(caches[1])
    metas = static.static_decode_metadata([1, 4, 8], 2048 // bs, CPU)
    assert metas[8].num_partitions == 2048 // PARTITION
    for contexts, size in (
        ([1500, 600, 513, 512, 100, 47, 16, 1], 8),
        ([1030, 3, 200, 17, 33], 8),
        ([700, 64, 2], 4),
        ([9], 1),
    ):
        spans = _spans(contexts, bs, gen)
        n = len(spans)
        q = torch.randn(size, heads, dim, generator=gen)
        k = torch.randn(size, kv_heads, dim, generator=gen)
        v = torch.randn(size, kv_heads, dim, generator=gen)
        q[n:] = k[n:] = v[n:] = 0.0  # the padding rows' inputs, as token 0 would give
        ref = plain.forward(0, q[:n], k[:n], v[:n], plain.prepare(spans, CPU))
        meta = metas[size]
        static.prepare_into(meta, spans)
        assert meta.slot_mapping[n:].eq(-1).all() and meta.seq_lens[n:].eq(1).all()
        assert meta.block_tables[n:, 0].eq(0).all()
        out = static.forward(0, q, k, v, meta)
        torch.testing.assert_close(out[:n], ref, rtol=1e-5, atol=1e-5)
        for name in ("k", "v", "k_scale", "v_scale") if kv_dtype == torch.int8 else ("k", "v"):
            assert torch.equal(getattr(caches[0], name)[0], getattr(caches[1], name)[0]), name


def test_static_buffers_at_capture_and_replay():
    """A fake step records what the static buffers hold: padding only at capture (largest
    size first), then the step's rows followed by padding at the smallest size that fits."""
    kv = KVCache(KVCacheSpec(1, 1, 16, 16, torch.float32), 8, 0, CPU)
    seen: list[tuple[list[int], ...]] = []

    def step(ids, positions, rows, backend, meta):
        tables = meta.block_tables[:, :2].flatten().tolist()
        seen.append((ids.tolist(), positions.tolist(), meta.slot_mapping.tolist(),
                     meta.seq_lens.tolist(), tables))  # fmt: skip
        return (ids * 100 + positions).float()[rows].unsqueeze(1)  # "logits" [rows, 1]

    graphs = CudaGraphDecode(step, TritonPagedAttention(kv), 20, 4, CPU, CallAgain)
    assert graphs.sizes == [1, 2, 4, 8, 16, 20]
    graphs.capture()
    assert graphs.captures == 6 and [len(s[0]) for s in seen] == [20, 16, 8, 4, 2, 1]
    assert seen[0] == ([0] * 20, [0] * 20, [-1] * 20, [1] * 20, [0] * 40)
    spans = [SeqSpan(1, 18, [3, 5]), SeqSpan(1, 3, [7]), SeqSpan(1, 1, [2])]
    with torch.inference_mode():  # the buffers are inference tensors, as in the runner
        logits = graphs([11, 12, 13], [17, 2, 0], spans, [0, 1, 2])
        assert seen[-1] == (
            [11, 12, 13, 0],
            [17, 2, 0, 0],
            [5 * 16 + 1, 7 * 16 + 2, 2 * 16, -1],
            [18, 3, 1, 1],
            [3, 5, 7, 0, 2, 0, 0, 0],
        )
        assert graphs([21, 22, 23], [1, 1, 1], spans, [0, 2]).flatten().tolist() == [2101, 2301]
        assert logits.flatten().tolist() == [1117, 1202, 1300]  # a copy: the replay left it
        many = [SeqSpan(1, 1, [1]) for _ in range(17)]
        assert len(graphs([4] * 17, [0] * 17, many, list(range(17)))) == 17
    assert len(seen[-1][0]) == 20 and graphs.replays == 3
    assert graphs.applies(many) and not graphs.applies(many * 2)
    assert not graphs.applies([SeqSpan(1, 5, [1]), SeqSpan(2, 9, [2])])  # a prefill chunk


def test_settings_and_when_auto_captures(tiny_model_dir):
    for bad in (dict(cuda_graphs="on"), dict(cuda_graph_max_rows=-1),
                dict(cuda_graph_max_rows=513), dict(cuda_graph_max_rows=True),
                dict(compile_max_rows=513), dict(compile_max_rows=1.5)):  # fmt: skip
        with pytest.raises(InvalidSettingError, match=next(iter(bad))):
            Engine(model="unused", **bad)
    # A graph replays the compiled step: no higher ceiling than the step's.
    with pytest.raises(
        InvalidSettingError, match=r"cuda_graph_max_rows.*<= compile_max_rows \(16\)"
    ):
        Engine(model="unused", compile_max_rows=16, cuda_graph_max_rows=24)
    kv = KVCache(KVCacheSpec(1, 1, 16, 16, torch.float32), 2, 0, CPU)
    triton, cuda = TritonPagedAttention(kv), torch.device("cuda")
    assert graphs_enabled("auto", cuda, triton, True)
    assert not graphs_enabled("off", cuda, triton, True)
    assert not graphs_enabled("auto", CPU, triton, True)
    assert not graphs_enabled("auto", cuda, TorchPagedAttention(kv), True)
    assert not graphs_enabled("auto", cuda, triton, False)  # compile off
    assert Engine(model=str(tiny_model_dir), kv_cache_memory_bytes=1 << 20).runner.graphs is None


def test_decode_row_ceilings_follow_max_num_seqs():
    """0 follows max_num_seqs at start (at least 32, at most 512), the graphs the compiled
    step; the padded sizes stop at the ceiling, which is captured itself."""

    def ceilings(**kw) -> tuple[int, int]:
        return decode_row_ceilings(check(EngineSettings(**kw)))

    assert ceilings() == (32, 32)
    assert ceilings(max_num_seqs=8) == (32, 32)
    assert ceilings(max_num_seqs=64, max_num_batched_tokens=2048) == (64, 64)
    assert ceilings(max_num_seqs=4096, max_num_batched_tokens=8192) == (512, 512)
    assert ceilings(max_num_seqs=64, cuda_graph_max_rows=16) == (64, 16)
    assert ceilings(cuda_graph_max_rows=100) == (100, 100)  # graphs imply a compiled step
    assert ceilings(max_num_seqs=200, compile_max_rows=48) == (48, 48)
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_sizes(200)[-4:] == [128, 160, 192, 200]
    sizes = capture_sizes(512)
    assert len(sizes) == 21 and sizes[-1] == 512
    # From 16 rows up a step pads by at most half its rows, from 64 by a quarter.
    for n in range(16, 513):
        padded = sizes[bisect.bisect_left(sizes, n)]
        assert padded <= n * (1.25 if n >= 64 else 1.5), n


MIXED = dict(
    dtype="float32", attention_backend="triton", preemption_mode="recompute", **MIXED_ENGINE
)


@pytest.mark.slow
def test_replayed_decode_gives_the_plain_engine_tokens(hf_model_dirs):
    """Ceiling 8: decode steps of up to 8 rows replay (padded to 1, 2, 4, 8), larger ones and
    prefill steps run as before."""
    kw = dict(model=str(hf_model_dirs["llama"]), cuda_graph_max_rows=8, **MIXED)
    plain, graphed = Engine(**kw), Engine(graph_replayers=CallAgain, **kw)
    assert plain.runner.graphs is None and graphed.runner.graphs.sizes == [1, 2, 4, 8]
    prompts, params = mixed_workload(plain.model_config.vocab_size, 7, 10)
    assert run_to_end(graphed, prompts, params) == run_to_end(plain, prompts, params)
    assert graphed.runner.graphs.replays > 0
    assert graphed.scheduler.num_preemptions > 0
    assert graphed.stats().prefix_cache_hits_total > 0


@pytest.mark.slow
def test_captures_run_the_compiled_step(hf_model_dirs):
    """The compiled step's graphs (1 row, 2..32 rows) take the static buffers' views as they
    are: no capture or replay falls back to eager (a recompile there would)."""
    kw = dict(model=str(hf_model_dirs["qwen2"]), dtype="float32", attention_backend="triton")
    plain = Engine(**kw)
    graphed = Engine(compile="on", graph_replayers=CallAgain, **kw)
    compiled = graphed.runner.compiled
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14], [15, 16, 17, 18, 19]]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * len(prompts)
    assert run_to_end(graphed, prompts, params) == run_to_end(plain, prompts, params)
    assert graphed.runner.graphs.replays > 0 and compiled.steps > 0
    assert not compiled._eager_rows
    # The graphs cover every decode step up to the compiled step's ceiling: the warm-up ran
    # their sizes only.
    assert compiled.max_rows == 32 and compiled.warm_rows == (1, 2, 32, 4, 8, 16, 24)


# -- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_gpu_capture_at_start_and_replay_gives_the_compiled_tokens(hf_model_dirs):
    kw = dict(model=str(hf_model_dirs["llama"]), device="cuda", compile="on", **MIXED)
    plain, graphed = Engine(cuda_graphs="off", **kw), Engine(cuda_graphs="auto", **kw)
    graphs = graphed.runner.graphs
    assert plain.runner.graphs is None and graphs is not None
    assert graphs.sizes == [1, 2, 4, 8, 16, 24, 32] and graphs.captures == 7
    assert graphs.capture_s > 0
    prompts, params = mixed_workload(plain.model_config.vocab_size, 7, 10)
    assert run_to_end(graphed, prompts, params) == run_to_end(plain, prompts, params)
    assert graphs.replays > 0 and graphs.captures == 7
    assert not graphed.runner.compiled._eager_rows  # the captures ran the compiled graphs
    assert graphed.scheduler.num_preemptions > 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_live_max_num_seqs_never_captures_again(hf_model_dirs):
    eng = Engine(
        model=str(hf_model_dirs["qwen2"]),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        compile="on",
        cuda_graph_max_rows=8,
        max_num_seqs=4,
    )
    graphs, compiled = eng.runner.graphs, eng.runner.compiled
    assert graphs.sizes == [1, 2, 4, 8] and graphs.captures == 4
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with torch.compiler.set_stance("fail_on_recompile"):  # a recompile would raise here
        for seqs, budget in ((4, 64), (1, 16), (12, 512), (7, 100), (32, 2048)):
            eng.update_settings(max_num_seqs=seqs, max_num_batched_tokens=budget)
            prompts = [torch.randint(3, 1000, (9,), generator=gen).tolist() for _ in range(seqs)]
            replays, steps = graphs.replays, compiled.steps
            run_to_end(eng, prompts, [params] * seqs)
            if seqs <= 8:
                assert graphs.replays > replays
            else:  # equal lengths: every decode step is above the ceiling, compiled, no graph
                assert compiled.steps > steps and graphs.replays == replays
    assert graphs.captures == 4 and not compiled._eager_rows
