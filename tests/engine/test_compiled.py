"""The compiled decode step (engine.compile = on) against the eager one.

Greedy outputs must be token-identical for 16 concurrent mixed requests under chunked
prefill, recompute and swap preemption, prefix-cache hits, speculation and structured output,
for every architecture the engine loads; a live change of the knobs must never compile in the
hot path (checked under the compiler's fail_on_recompile stance). Tiny models keep the
warm-up short (inductor compiles C++ on the CPU): the module is marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine import compiled as compiled_module
from controlplane.engine.attention.backend import SeqSpan
from controlplane.engine.compiled import compile_mode
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.model.linear import cpu_has_native_bf16
from controlplane.engine.structured import StructuredOutput
from tests.admin.test_admin_api import MODEL, TOKEN
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


# On a CPU without native bf16 (an AVX2 EPYC here) a bf16 model's compiled tokens part from
# the eager ones at a near-tie whatever the attention op (the Python op and the torch backend
# too): emulated bf16 outside attention, not yet traced to its op. Float32 runs both ops
# everywhere.
_BF16_EMULATED = pytest.mark.xfail(
    not cpu_has_native_bf16(),
    reason="bf16 compiled and eager differ on a CPU without native bf16 (issue 26 note)",
    strict=False,
)


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [
        ("float32", "float32"),
        ("float32", "int8"),
        pytest.param("bfloat16", "bfloat16", marks=_BF16_EMULATED),
        pytest.param("bfloat16", "int8", marks=_BF16_EMULATED),
    ],
)
def test_compiled_decode_calls_the_backends_graph_op(dtype, kv_dtype, hf_model_dirs):
    # The CPU kernel's own op (step_attention: no Python per layer) for a 16- or 32-bit cache,
    # the Python custom op for an 8-bit one; either way the eager tokens.
    kw = dict(
        model=str(hf_model_dirs["llama"]),
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        attention_backend="cpu",
        **MIXED_ENGINE,
    )
    eager, compiled = Engine(compile="off", **kw), Engine(compile="on", **kw)
    expected = (
        torch.ops.controlplane.paged_attention
        if kv_dtype == "int8"
        else torch.ops.controlplane_cpu.step_attention
    )
    assert all(layer.self_attn.graph_op is expected for layer in compiled.model.model.layers)
    prompts, params = mixed_workload(eager.model_config.vocab_size, 3, 12)
    assert run_to_end(compiled, prompts, params) == run_to_end(eager, prompts, params)
    assert compiled.runner.compiled.steps > 0


def test_cpp_wrapper_gives_the_eager_tokens(hf_model_dirs, monkeypatch):
    """engine.compile_cpp_wrapper = on: the step's graph is driven by a C++ wrapper that
    inductor really built and loaded, and gives the eager tokens under preemption and prefix
    hits."""
    from torch._inductor.codecache import CppWrapperCodeCache

    loaded = []
    load = CppWrapperCodeCache.load_pybinding

    def spy(*args, **kwargs):
        loaded.append(kwargs.get("device_type"))
        return load(*args, **kwargs)

    monkeypatch.setattr(CppWrapperCodeCache, "load_pybinding", spy)
    kw = dict(model=str(hf_model_dirs["llama"]), dtype="float32", **MIXED_ENGINE)
    eager = Engine(compile="off", **kw)
    compiled = Engine(compile="on", compile_cpp_wrapper="on", **kw)
    assert compiled.runner.compiled.cpp_wrapper
    assert loaded and set(loaded) == {"cpu"}  # one wrapper a graph (1 row, 2..max rows)
    prompts, params = mixed_workload(eager.model_config.vocab_size, 3, 12)
    assert run_to_end(compiled, prompts, params) == run_to_end(eager, prompts, params)
    assert compiled.runner.compiled.steps > 0
    assert compiled.scheduler.num_preemptions > 0
    for wrong in ("yes", True):  # a bool from an older config file is named, not coerced
        with pytest.raises(InvalidSettingError, match=r"compile_cpp_wrapper.*auto, on, off"):
            Engine(model="unused", compile_cpp_wrapper=wrong)


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


def test_decode_steps_past_64_rows_run_compiled(hf_model_dirs, caplog):
    """max_num_seqs 72 at start: the compiled step covers 72 rows (engine.compile_max_rows
    0), through the int8 linears' dequantized branch at 64 rows (one more graph), warmed up at
    every row count, and 70 concurrent requests decode in compiled steps to the eager tokens."""
    kw = dict(
        model=str(hf_model_dirs["llama"]),
        dtype="float32",
        quantization="int8",
        max_num_seqs=72,
        num_kv_blocks=160,
        block_size=16,
    )
    eager, compiled = Engine(compile="off", **kw), Engine(compile="on", **kw)
    step = compiled.runner.compiled
    assert step.max_rows == 72 and sorted(step.warm_rows) == list(range(1, 73))
    # One row; 2..63 rows; 64..72 rows (the int8 linears' dequantized branch).
    assert step.num_graphs == 3
    gen = torch.Generator().manual_seed(11)
    vocab = eager.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (3 + i % 6,), generator=gen).tolist() for i in range(70)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * len(prompts)
    assert run_to_end(compiled, prompts, params) == run_to_end(eager, prompts, params)
    assert step.steps >= 4 and not step._eager_rows and step.num_graphs == 3
    # Raised live past the ceiling: said at once, since those steps will run eagerly.
    compiled.update_settings(max_num_seqs=72)
    assert "above the compiled" not in caplog.text
    compiled.update_settings(max_num_seqs=80)
    assert "max_num_seqs 80 is above the compiled decode step's 72 rows" in caplog.text
    caplog.clear()  # said once, at the change: not again with every other change
    compiled.update_settings(prefill_chunk_size=64)
    assert "above the compiled" not in caplog.text


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
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_mode("on", cpu) == "start" and compile_mode("on", cuda) == "start"
    assert compile_mode("auto", cuda) == "start"
    assert compile_mode("off", cpu) == "off" and compile_mode("off", cuda) == "off"
    assert compiled_module.CPU_AUTO == "off"  # the suite's choice (conftest)
    assert compile_mode("auto", cpu) == "off"
    assert compile_mode("auto", cpu, long_running=True) == "off"
    assert compile_mode("auto", cuda, long_running=True) == "start"


def _wait_for_warm_up(engine: Engine, timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    while engine.compile_state == "warming" and time.monotonic() < deadline:
        time.sleep(0.2)
    return engine.compile_state


def test_background_warm_up_serves_eagerly_then_takes_over(hf_model_dirs, monkeypatch):
    """`auto` on a CPU: the engine serves at once, eagerly, while the decode step compiles in
    a thread of its own (its own attention backend and KV block, the step state per thread);
    the compiled step takes over when every graph is warm. Tokens are eager's throughout."""
    monkeypatch.setattr(compiled_module, "CPU_AUTO", "background")
    assert compile_mode("auto", torch.device("cpu"), long_running=True) == "background"
    assert compile_mode("auto", torch.device("cpu")) == "off"  # a one-off engine: LLM's
    # The warm-up waits for `held` before it compiles: with inductor's cache warm it took
    # 1.1 s in CI, less than the eager reference run, and the engine was ready before the
    # test had served anything (CI failed on `served_while_warming > 0`).
    held = threading.Event()
    warm_up = compiled_module.CompiledDecode.warm_up

    def held_warm_up(self, *args, **kwargs):
        assert held.wait(120), "the test never let the warm-up go"
        return warm_up(self, *args, **kwargs)

    monkeypatch.setattr(compiled_module.CompiledDecode, "warm_up", held_warm_up)
    kw = dict(model=str(hf_model_dirs["llama"]), dtype="float32", **MIXED_ENGINE)
    eager = Engine(compile="off", **kw)
    prompts, params = mixed_workload(eager.model_config.vocab_size, 3, 12)
    want = run_to_end(eager, prompts, params)
    interval = sys.getswitchinterval()
    eng = Engine(compile="auto", long_running=True, **kw)
    assert eng.compile_state == "warming"
    assert eng.runner.compiled.cpp_wrapper  # compile_cpp_wrapper = auto: C++ in the background
    assert eng.block_pool.num_used == 1  # held for the warm-up's dummy K/V
    assert run_to_end(eng, prompts, params) == want  # served while warming: eagerly
    assert eng.compile_state == "warming" and eng.runner.compiled.steps == 0
    held.set()
    while eng.compile_state == "warming":  # requests run alongside the compiler
        assert run_to_end(eng, prompts, params) == want
    assert _wait_for_warm_up(eng) == "ready"
    assert eng.runner.compiled.num_graphs == 2 and eng.runner.compiled.warmup_s > 0
    for thread in threading.enumerate():  # it restores the GIL's switch interval as it ends
        if thread.name == "compile-warm-up":
            thread.join(10)
    assert sys.getswitchinterval() == interval
    assert run_to_end(eng, prompts, params) == want
    assert eng.runner.compiled.steps > 0  # decode steps ran compiled
    assert not eng._warm_up_block and eng.block_pool.num_used == 0  # released by a step


def test_a_recompile_on_the_step_thread_runs_eagerly(hf_model_dirs):
    """Warmed up on this thread, stepped on another (a daemon's step thread): a step whose
    inputs need another graph (int32 token ids) runs eagerly there, never compiles. Dynamo's
    config is per thread: the step thread must forbid recompiles on itself."""
    eng = Engine(model=str(hf_model_dirs["llama"]), dtype="float32", compile="on", max_num_seqs=4)
    compiled, backend = eng.runner.compiled, eng.runner.backend
    assert compiled.num_graphs == 2
    assert not compiled.cpp_wrapper  # compile_cpp_wrapper = auto: not under compile = on
    block = eng.block_pool.allocate(1)
    out: dict[str, torch.Tensor] = {}

    def step() -> None:
        meta = backend.prepare([SeqSpan(1, 1, block)], eng.device)
        ids, pos = torch.tensor([5], dtype=torch.int32), torch.tensor([0])
        with torch.inference_mode():
            out["logits"] = compiled(ids, pos, torch.tensor([0]), backend, meta)

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert out["logits"].shape == (1, eng.model_config.vocab_size)
    assert compiled.num_graphs == 2 and compiled._eager_rows == {1}


def _run_cold(script: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    """`script` in a Python process of its own, inductor's caches off (every graph compiles
    from scratch); it must exit with 0."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        **env,
    }
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_a_failed_background_warm_up_leaves_the_engine_eager(hf_model_dirs, tmp_path):
    """No C++ compiler on the PATH (and no inductor cache to fall back on), in a process of
    its own: the warm-up fails in its thread, says so, and the engine serves eagerly."""
    script = f"""
import logging, time
from controlplane.engine import Engine, SamplingParams, compiled
logging.basicConfig(level=logging.INFO)
compiled.CPU_AUTO = "background"
eng = Engine(model={str(hf_model_dirs["qwen2"])!r}, dtype="float32", max_num_seqs=4,
             attention_backend="torch", compile="auto", long_running=True)
while eng.compile_state == "warming":
    time.sleep(0.1)
params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
rid = eng.add_request([5, 6, 7], params)
while eng.has_unfinished_requests():
    eng.step()
print("STATE", eng.compile_state, eng.runner.compiled.steps, eng.block_pool.num_used)
"""
    run = _run_cold(script, tmp_path, PATH=str(tmp_path))  # nothing in it: no g++, no c++
    assert "STATE failed 0 0" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "compiling the decode step failed; every step stays eager" in run.stderr


def test_shutdown_stops_a_background_warm_up(hf_model_dirs, tmp_path):
    """A daemon stopped while its decode step still compiles (CI's quickstart, stopped 27 s
    after ready): shutdown stops the warm-up at its next graph and waits for it, and the
    process exits cleanly. (A daemon thread left inside the compiler at interpreter exit
    aborted it: "terminate called without an active exception", exit code 134.)"""
    script = f"""
import asyncio, logging, threading
from controlplane.engine import AsyncEngine, compiled
logging.basicConfig(level=logging.INFO)
compiled.CPU_AUTO = "background"

async def main():
    aeng = AsyncEngine.from_settings(model={str(hf_model_dirs["llama"])!r}, dtype="float32",
                                     max_num_seqs=4, compile="auto", long_running=True)
    aeng.start()
    assert aeng.engine.compile_state == "warming"
    await aeng.shutdown()
    alive = [t.name for t in threading.enumerate() if t.name == "compile-warm-up"]
    print("AFTER", aeng.engine.compile_state, alive)

asyncio.run(main())
"""
    run = _run_cold(script, tmp_path)  # cold: still compiling at shutdown
    assert "AFTER cold []" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "compiling the decode step stopped; every step stays eager" in run.stderr


def _decode_logits(engine, prompts, params) -> dict[tuple[int, int], torch.Tensor]:
    """Logits of every generated position, by (prompt index, position)."""
    rows = traced_logits(engine, prompts, params)
    return {(i, pos): row for (i, pos), row in rows.items() if pos >= len(prompts[i])}


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_compiled_decode_on_smollm2(dtype):
    """The real model, one user and four at once: every decode step's logits are eager's,
    bit for bit. (Before RMSNorm summed its squares in float64, 7 of 296 decode rows differed
    in bf16 and 47 in float32: inductor's reduction order is not eager's.)"""
    if dtype == "auto" and not cpu_has_native_bf16():
        # auto runs the Q4_1 GGUF in float32 here (model/linear.auto_dtype): the same engines
        # as the float32 case, compiled again (about 70 s of CI on an AVX2-only CPU).
        pytest.skip("dtype auto is float32 on a CPU without native bf16: the float32 case")
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


def test_a_daemon_serves_while_its_step_compiles(monkeypatch, make_daemon):
    """The daemon's default on a CPU: it answers from the start while the decode step
    compiles, `/admin/stats` says `warming` then `ready`, and once ready its step thread (not
    the thread that warmed up) runs the compiled step, with the same greedy text."""
    monkeypatch.setattr(compiled_module, "CPU_AUTO", "background")
    d = make_daemon(admin=True, engine={"max_num_seqs": 4})
    admin = d.client(TOKEN)
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 12, "temperature": 0}
    stats = admin.get("/admin/stats").json()
    assert stats["compiled_step"] == "warming"
    assert stats["compiled_max_rows"] == 32  # max_num_seqs 4 at start: at least 32
    first = httpx.post(f"{d.url}/v1/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    deadline = time.monotonic() + 600
    while (state := admin.get("/admin/stats").json()["compiled_step"]) == "warming":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert state == "ready"
    compiled = d.daemon.aengine.engine.runner.compiled
    again = httpx.post(f"{d.url}/v1/completions", json=body, timeout=120)
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert compiled.steps >= 10 and not compiled._eager_rows  # the step thread ran it


def test_an_fx_trace_on_another_thread_breaks_an_eager_step_unless_primed():
    """Why `prime_fx_tracer` runs before the background warm-up: while torch.fx traces, on any
    thread, every nn.Module call in the process goes through its tracer, and an eager forward
    on the step thread raises. Inductor's one such trace (its loop-body interpreter's) is
    cached: primed, it never happens during a warm-up."""
    inside, release = threading.Event(), threading.Event()

    def traced(x):
        inside.set()
        release.wait(30)
        return x

    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(traced,))
    tracer.start()
    try:
        assert inside.wait(30)
        with pytest.raises(NameError, match="not installed as a submodule"):
            torch.nn.Linear(2, 2)(torch.ones(1, 2))
    finally:
        release.set()
        tracer.join()
    torch.nn.Linear(2, 2)(torch.ones(1, 2))  # fine again once the trace is over
    # A fresh process: the trace inductor would make is done (and cached) by the priming.
    probe = (
        "from torch._inductor.loop_body import InterpreterShim as S\n"
        "from controlplane.engine.compiled import prime_fx_tracer\n"
        "assert S._dummy_gm.cache_info().currsize == 0\n"
        "prime_fx_tracer()\n"
        "assert S._dummy_gm.cache_info().currsize == 1\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)
