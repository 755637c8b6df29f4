"""The compiled decode step (engine.compile = on) against the eager one.

Greedy outputs must be token-identical for 16 concurrent mixed requests under chunked
prefill, recompute and swap preemption, prefix-cache hits, speculation and structured output,
for every architecture the engine loads; a live change of the knobs must never compile in the
hot path (checked under the compiler's fail_on_recompile stance). Tiny models keep the
warm-up short (inductor compiles C++ on the CPU): the module is marked slow.
"""

from __future__ import annotations

import json

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.compiled import compile_enabled
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.structured import StructuredOutput
from tests.conftest import (
    MIXED_ENGINE,
    mixed_workload,
    require_smollm2,
    run_to_end,
    traced_logits,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_compiled_decode_gives_the_eager_tokens(kind, preemption, hf_model_dirs):
    kw = dict(
        model=str(hf_model_dirs[kind]),
        dtype="float32",
        **MIXED_ENGINE,
        preemption_mode=preemption,
    )
    eager = Engine(compile="off", **kw)
    compiled = Engine(compile="on", **kw)
    assert eager.runner.compiled is None and compiled.runner.compiled is not None
    prompts, params = mixed_workload(eager.model_config.vocab_size, 3, 12)
    assert run_to_end(compiled, prompts, params) == run_to_end(eager, prompts, params)
    assert compiled.runner.compiled.steps > 0  # decode-only steps ran compiled
    assert compiled.scheduler.num_preemptions > 0
    assert compiled.stats().prefix_cache_hits_total > 0


def test_compiled_decode_with_speculation_and_structured_output(hf_model_dirs):
    kw = dict(model=str(hf_model_dirs["llama"]), dtype="float32", max_num_seqs=8)
    eager, compiled = Engine(compile="off", **kw), Engine(compile="on", **kw)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11], [12, 13, 14, 15]]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=20,
            temperature=0.0,
            structured=StructuredOutput("json_schema", json.dumps(schema)),
        ),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    ]
    for eng in (eager, compiled):
        eng.update_settings(speculative_method="ngram", speculative_num_tokens=2)
    assert run_to_end(compiled, prompts, params) == run_to_end(eager, prompts, params)


def test_live_knob_changes_never_compile_in_the_hot_path(hf_model_dirs):
    eng = Engine(model=str(hf_model_dirs["qwen2"]), dtype="float32", compile="on", max_num_seqs=4)
    compiled, graphs = eng.runner.compiled, eng.runner.graphs

    def compiled_steps() -> int:  # on CUDA most decode steps replay the graphs captured at start
        return compiled.steps + (graphs.replays if graphs is not None else 0)

    assert compiled.warmup_s > 0
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with torch.compiler.set_stance("fail_on_recompile"):  # a recompile would raise here
        for seqs, budget in ((4, 64), (1, 16), (12, 512), (7, 100), (32, 2048)):
            eng.update_settings(max_num_seqs=seqs, max_num_batched_tokens=budget)
            prompts = [torch.randint(3, 1000, (9,), generator=gen).tolist() for _ in range(seqs)]
            before = compiled_steps()
            run_to_end(eng, prompts, [params] * seqs)
            assert compiled_steps() > before
    assert not compiled._eager_rows


def test_every_engine_keeps_its_own_graphs(hf_model_dirs):
    """Five compiled engines in one process (dynamo keeps at most 8 graphs per code object:
    had they shared one, the fifth would have run eagerly) each hold their 2 graphs and give
    their own eager tokens: the guards left after warm-up are the inputs' only, so an engine
    must never reach another's graph (other weights, other shapes)."""
    kinds = ["llama", "qwen2", "mistral", "llama", "qwen2"]
    kw = dict(dtype="float32", max_num_seqs=4, num_kv_blocks=64)  # a fixed size on any device
    compiled = [Engine(model=str(hf_model_dirs[k]), compile="on", **kw) for k in kinds]
    assert [e.runner.compiled.num_graphs for e in compiled] == [2] * len(kinds)
    gen = torch.Generator().manual_seed(9)
    # Different lengths: steps of 3, 2 and 1 rows (both graphs).
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (8, 3, 5)]
    for kind, eng in zip(kinds, compiled, strict=True):
        vocab = eng.model_config.vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 9, 2)]
        eager = Engine(model=str(hf_model_dirs[kind]), compile="off", **kw)
        assert run_to_end(eng, prompts, params) == run_to_end(eager, prompts, params), kind
        assert eng.runner.compiled.num_graphs == 2 and not eng.runner.compiled._eager_rows


def test_compile_setting():
    with pytest.raises(InvalidSettingError, match="compile"):
        Engine(model="unused", compile="yes")
    assert compile_enabled("on", torch.device("cpu"))
    assert not compile_enabled("auto", torch.device("cpu"))
    assert compile_enabled("auto", torch.device("cuda"))
    assert not compile_enabled("off", torch.device("cuda"))


def _decode_logits(engine, prompts, params) -> dict[tuple[int, int], torch.Tensor]:
    """Logits of every generated position, by (prompt index, position)."""
    rows = traced_logits(engine, prompts, params)
    return {(i, pos): row for (i, pos), row in rows.items() if pos >= len(prompts[i])}


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_compiled_decode_on_smollm2(dtype):
    """The real model, one user and four at once: every decode step's logits are eager's,
    bit for bit. (Before RMSNorm summed its squares in float64, 7 of 296 decode rows differed
    in bf16 and 47 in float32: inductor's reduction order is not eager's.)"""
    path = require_smollm2()
    kw = dict(model=str(path), kv_cache_memory_bytes=64 << 20, max_num_seqs=4, dtype=dtype)
    eager, compiled = Engine(compile="off", **kw), Engine(compile="on", **kw)
    ids = eager.tokenizer.encode("The three primary colours are red, yellow and")
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 4
    for prompts in ([ids], [ids, ids[:5], ids[2:], eager.tokenizer.encode("Paged attention")]):
        before = compiled.runner.compiled.steps
        got = _decode_logits(compiled, prompts, params[: len(prompts)])
        want = _decode_logits(eager, prompts, params[: len(prompts)])
        assert got.keys() == want.keys() and len(got) == 23 * len(prompts)
        differing = [key for key in want if not torch.equal(got[key], want[key])]
        assert not differing, f"{len(differing)} of {len(want)} rows differ from eager"
        assert compiled.runner.compiled.steps - before >= 20  # the decode steps ran compiled
