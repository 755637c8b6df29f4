"""Engine behaviour on the tiny demo model: input validation, abort, sampling, stops, async."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from controlplane.engine import (
    LLM,
    AsyncEngine,
    Engine,
    InvalidSettingError,
    ModelLoadError,
    RestartRequiredError,
    SamplingParams,
)
from harness import drain


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(model=str(tiny_model_dir), max_model_len=256, block_size=8)


# After each test that used the module's engine: no request and no KV block left held.
pytestmark = pytest.mark.usefixtures("engine_left_clean")


@pytest.mark.parametrize(
    ("prompt", "params", "field", "limit"),
    [
        ([], {}, "prompt", "empty"),
        ("", {}, "prompt", "empty"),
        ([1] * 250, {"max_tokens": 10}, "max_tokens", "max_model_len (256)"),
        ([1, 2], {"max_tokens": 0}, "max_tokens", ">= 1"),
        ([1, 2], {"top_p": 0.0}, "top_p", "(0, 1]"),
        ([1, 2], {"top_p": 1.5}, "top_p", "(0, 1]"),
        ([1, 2], {"temperature": -0.1}, "temperature", ">= 0"),
        ([1, 2], {"logprobs": 21}, "logprobs", "[0, 20]"),
        ([5000], {}, "prompt", "[0, 1024)"),
    ],
)
def test_bad_requests_name_field_and_limit_and_engine_keeps_serving(
    engine, prompt, params, field, limit
):
    good = engine.add_request([3, 4, 5], SamplingParams(max_tokens=5, temperature=0))
    with pytest.raises(ValueError) as info:
        engine.add_request(prompt, SamplingParams(**{"max_tokens": 4, **params}))
    assert field in str(info.value) and limit in str(info.value)
    done = drain(engine)
    assert list(done) == [good] and len(done[good].token_ids) == 5


def test_bad_sampling_params_raise_at_construction():
    with pytest.raises(InvalidSettingError, match="min_p"):
        SamplingParams(min_p=2)
    with pytest.raises(InvalidSettingError, match="presence_penalty"):
        SamplingParams(presence_penalty=3)


def test_update_settings_validates_all_or_nothing(engine):
    before = engine.settings
    with pytest.raises(
        InvalidSettingError, match=r"max_num_batched_tokens: must be >= max_num_seqs \(64\)"
    ):
        engine.update_settings(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(InvalidSettingError, match=r"prefill_chunk_size: must be in \[1,"):
        engine.update_settings(prefill_chunk_size=0)
    with pytest.raises(InvalidSettingError, match="bogus: unknown setting"):
        engine.update_settings(bogus=1)
    with pytest.raises(
        InvalidSettingError, match="preemption_mode: must be one of recompute, swap"
    ):
        engine.update_settings(preemption_mode="evict")
    with pytest.raises(RestartRequiredError, match=r"block_size: .*restart"):
        engine.update_settings(block_size=32)
    with pytest.raises(InvalidSettingError, match="max_num_seqs: must be an integer"):
        engine.update_settings(max_num_seqs=True)
    engine.step()
    assert engine.settings == before
    engine.update_settings(max_num_seqs=7)
    assert engine.settings.max_num_seqs == before.max_num_seqs  # staged, not yet applied
    engine.step()
    assert engine.settings.max_num_seqs == 7
    engine.update_settings(max_num_seqs=before.max_num_seqs)
    engine.step()


def test_unknown_constructor_setting(tiny_model_dir):
    with pytest.raises(InvalidSettingError, match="max_batch: unknown setting"):
        Engine(model=str(tiny_model_dir), max_batch=3)


def test_lowering_max_num_seqs_caps_the_running_batch_at_the_next_step(engine):
    for i in range(8):
        engine.add_request(
            [7, 8, 9, i], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        )
    engine.step()
    assert engine.stats().num_running == 8
    engine.update_settings(max_num_seqs=3)
    engine.step()
    assert engine.stats().num_running == 3
    assert engine.stats().num_waiting == 5
    engine.update_settings(max_num_seqs=32)
    drain(engine)


def test_abort_mid_generation_frees_blocks(engine):
    a = engine.add_request([1, 2, 3] * 10, SamplingParams(max_tokens=100, ignore_eos=True))
    b = engine.add_request([4, 5], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(5):
        engine.step()
    used = engine.block_pool.num_used
    assert used > 0
    (out,) = engine.abort(a)
    assert out.finished and out.finish_reason == "abort"
    assert engine.block_pool.num_used < used
    assert engine.abort("no-such-request") == []
    engine.abort(b)
    assert engine.block_pool.num_used == 0


def test_abort_waiting_and_swapped_requests(tiny_model_dir):
    eng = Engine(
        model=str(tiny_model_dir),
        block_size=4,
        num_kv_blocks=12,
        preemption_mode="swap",
        max_num_seqs=2,
    )
    ids = [
        eng.add_request([1] * 12, SamplingParams(max_tokens=30, ignore_eos=True)) for _ in range(4)
    ]
    swapped_seen = False
    for _ in range(40):
        eng.step()
        swapped_seen |= eng.stats().num_swapped > 0
    assert swapped_seen
    for rid in ids:
        eng.abort(rid)
    assert eng.block_pool.num_used == 0 and eng.swap_pool.num_used == 0


def test_seeded_sampling_is_independent_of_batch_composition(engine):
    params = SamplingParams(
        max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=42, ignore_eos=True
    )
    alone = engine.add_request([10, 11, 12], params)
    first = drain(engine)[alone].token_ids
    others = [
        engine.add_request(
            list(range(20, 20 + n)), SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
        )
        for n in (3, 9, 17, 30)
    ]
    crowded = engine.add_request([10, 11, 12], params)
    done = drain(engine)
    assert done[crowded].token_ids == first
    assert all(len(done[o].token_ids) == 30 for o in others)
    different = engine.add_request([10, 11, 12], SamplingParams(**{**_asdict(params), "seed": 43}))
    assert drain(engine)[different].token_ids != first


def _asdict(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in p.__slots__}


def test_sampling_filters(engine):
    # top_k=1 is greedy whatever the temperature.
    greedy = engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    topk1 = engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True)
    )
    minp1 = engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=12, temperature=1.5, min_p=1.0, ignore_eos=True)
    )
    done = drain(engine)
    assert done[topk1].token_ids == done[greedy].token_ids == done[minp1].token_ids


def test_penalties_change_greedy_output(engine):
    base = engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )
    pen = engine.add_request(
        [5, 6, 7],
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, frequency_penalty=2.0),
    )
    rep = engine.add_request(
        [5, 6, 7],
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1e6),
    )
    done = drain(engine)
    assert len(set(done[base].token_ids)) < 30  # a random tiny model repeats itself...
    assert len(set(done[rep].token_ids)) == 30  # ...a huge repetition penalty forbids repeats
    assert done[pen].token_ids != done[base].token_ids


def test_stop_strings_stop_tokens_and_text(engine):
    tok = engine.tokenizer
    probe = engine.add_request(
        "hello world", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )
    full = drain(engine)[probe]
    assert full.text == tok.decode(full.token_ids)
    assert full.finish_reason == "length"
    # Stop on a string that appears in the middle of the greedy text.
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip()
    cut = full.text.index(stop)
    stream_id = engine.add_request(
        "hello world", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    )
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.delta_text)
            final = out
    assert final.request_id == stream_id and final.finish_reason == "stop"
    assert final.text == full.text[:cut]
    assert "".join(deltas) == final.text  # streamed text never included any of the stop string
    # A stop token id ends the request and is not rendered.
    stop_id = full.token_ids[4]
    rid = engine.add_request(
        "hello world",
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]),
    )
    out = drain(engine)[rid]
    first = full.token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    assert out.text == tok.decode(full.token_ids[:first])


def test_eos_stops_unless_ignored(tiny_model_dir, tmp_path):
    # Make the greedy first token of a prompt the model's eos, in a copy of the model.
    first = LLM(str(tiny_model_dir)).generate(
        [[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0)
    )
    eos = first[0].token_ids[0]
    d = _copy(tiny_model_dir, tmp_path / "m")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((d / name).read_text())
        cfg["eos_token_id"] = eos
        (d / name).write_text(json.dumps(cfg))
    llm = LLM(str(d))
    stopped, ignored = llm.generate(
        [[1, 2, 3], [1, 2, 3]],
        [
            SamplingParams(max_tokens=5, temperature=0),
            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        ],
    )
    assert stopped.finish_reason == "stop" and stopped.token_ids == [eos] and stopped.text == ""
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 5


def test_logprobs(engine):
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    collected = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            collected += out.logprobs
    assert len(collected) == 4
    for lp in collected:
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy: the sampled token is the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))
    assert rid


def test_metrics_timestamps(engine):
    rid = engine.add_request(
        [1, 2, 3, 4], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    m = drain(engine)[rid].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert m.num_prompt_tokens == 4 and m.num_output_tokens == 5 and m.num_preemptions == 0
    assert m.mean_itl is not None and m.ttft is not None and m.queue_time >= 0


def test_step_stats_snapshot(engine):
    engine.add_request(
        list(range(1, 40)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    )
    engine.update_settings(prefill_chunk_size=16)
    engine.step()
    st = engine.stats()
    assert st.num_prefill_tokens == 16 and st.num_decode_tokens == 0 and st.num_running == 1
    assert st.kv_blocks_used == 2 and st.kv_blocks_total == engine.block_pool.num_blocks
    assert st.step_duration > 0
    drain(engine)
    assert engine.stats().num_decode_tokens == 1
    engine.update_settings(prefill_chunk_size=512)
    engine.step()


def test_llm_generate_in_input_order_with_strings_and_ids(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    prompts = ["a long prompt " * 8, [1, 2, 3], "short"]
    outs = llm.generate(
        prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 3, 6)]
    )
    assert [len(o.token_ids) for o in outs] == [9, 3, 6]
    assert outs[1].prompt_token_ids == [1, 2, 3]
    assert all(o.finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["fine", "also fine"], [SamplingParams(), SamplingParams(max_tokens=10**6)])
    assert not llm.engine.has_unfinished_requests()  # nothing left queued by the failed call


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(tiny_model_dir, dtype):
    ref = Engine(model=str(tiny_model_dir), dtype="float32")
    ref.runner.trace, half_trace = [], []
    half = Engine(model=str(tiny_model_dir), dtype=dtype)
    half.runner.trace = half_trace
    for eng in (ref, half):
        eng.add_request(list(range(1, 30)), SamplingParams(max_tokens=1, temperature=0))
        drain(eng)
    a, b = ref.runner.trace[0][2], half_trace[0][2]
    assert half.kv_cache.k[0].dtype == getattr(torch, dtype)
    assert (a - b).abs().max() / a.abs().max() < 0.05


def test_async_engine_streams_and_disconnect_aborts(tiny_model_dir):
    async def main() -> None:
        aeng = AsyncEngine.from_settings(model=str(tiny_model_dir))
        aeng.start()
        try:
            texts = []
            async for out in aeng.generate(
                "hello", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            ):
                texts.append(out.delta_text)
            assert out.finished and len(out.token_ids) == 8 and "".join(texts) == out.text

            # Two concurrent streams.
            async def collect(prompt):
                return [
                    o
                    async for o in aeng.generate(
                        prompt, SamplingParams(max_tokens=5, temperature=0)
                    )
                ][-1]

            r1, r2 = await asyncio.gather(collect([1, 2, 3]), collect([4, 5, 6]))
            assert r1.finished and r2.finished

            # A consumer that walks away mid-stream aborts its request and frees its blocks.
            async with contextlib.aclosing(
                aeng.generate([1] * 20, SamplingParams(max_tokens=200, ignore_eos=True))
            ) as gen:
                async for out in gen:
                    if len(out.token_ids) >= 3:
                        assert aeng.engine.block_pool.num_used > 0
                        break
            for _ in range(100):
                if (
                    aeng.engine.block_pool.num_used == 0
                    and not aeng.engine.has_unfinished_requests()
                ):
                    break
                await asyncio.sleep(0.02)
            assert aeng.engine.block_pool.num_used == 0

            with pytest.raises(ValueError, match="max_tokens"):
                aeng.add_request([1], SamplingParams(max_tokens=10**7))
        finally:
            await aeng.shutdown()

    asyncio.run(main())


# -- loader errors ---------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_config_names_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json: missing"):
        Engine(model=str(tmp_path))


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match=r"config\.json: unsupported architecture \['GPT2LMHeadModel'\]"
    ):
        Engine(model=str(d))


def test_missing_and_misshaped_tensors_name_file_and_tensor(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, d / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"
    ):
        Engine(model=str(d))
    weights = load_file(tiny_model_dir / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(63)
    save_file(weights, d / "model.safetensors")
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \(63,\), expected \(64,\)",
    ):
        Engine(model=str(d))
    (d / "model.safetensors").unlink()
    with pytest.raises(
        ModelLoadError, match=r"no model\.safetensors or model\.safetensors\.index\.json"
    ):
        Engine(model=str(d))


def test_sharded_checkpoint_loads_and_missing_shard_is_named(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: weights[k] for k in keys}, d / fname)
        weight_map.update(dict.fromkeys(keys, fname))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    sharded = LLM(str(d)).generate(
        [[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    single = LLM(str(tiny_model_dir)).generate(
        [[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    assert sharded[0].token_ids == single[0].token_ids
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors: shard listed in"):
        Engine(model=str(d))


def test_weights_are_memory_mapped_not_copied(tiny_model_dir):
    eng = Engine(model=str(tiny_model_dir), dtype="float32", cpu_weight_packing=False)
    # down_proj, not a fused projection: fusing q/k/v and gate/up concatenates (copies) them.
    for w in (eng.model.model.layers[0].mlp.down_proj.weight, eng.model.model.embed_tokens.weight):
        # A tensor backed by the file mapping has no private allocation that could be resized.
        storage = w.untyped_storage()
        with pytest.raises(RuntimeError):
            storage.resize_(storage.nbytes() + 8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_cpu_linears_match_plain_linears(tiny_model_dir, dtype):
    from controlplane.engine.model.linear import PackedLinear, cpu_packing_supported

    # Holds on every CPU: where this CPU cannot pack the dtype (bfloat16 without oneDNN bf16,
    # e.g. AVX2 only) the documented fallback is plain linears, with the same results.
    fast_path = cpu_packing_supported(getattr(torch, dtype))
    traces = []
    for packing in (True, False):
        eng = Engine(model=str(tiny_model_dir), dtype=dtype, cpu_weight_packing=packing)
        q_proj = eng.model.model.layers[0].self_attn.qkv_proj
        if packing and fast_path:
            assert isinstance(q_proj, PackedLinear)
        else:
            assert type(q_proj) is torch.nn.Linear
        eng.runner.trace = []
        eng.add_request(
            list(range(1, 40)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        )
        drain(eng)
        traces.append(torch.cat([t[2] for t in eng.runner.trace]))
    packed, plain = traces
    # float32: the same sums. bfloat16: oneDNN's packed GEMM and the plain one round an output
    # differently now and then (one ulp: seen at layer 1's o_proj of this model, from the same
    # input, at the 8th token), so the logits agree to within one bf16 ulp of the largest.
    tol = 1e-5 if dtype == "float32" else 2**-7
    assert (packed - plain).abs().max() <= tol * plain.abs().max()


def test_packed_linears_pad_rows_to_few_buckets_with_the_same_results():
    from controlplane.engine.model.linear import PackedLinear, cpu_packing_supported, padded_rows

    # Bounded shapes: oneDNN keeps one kernel per row count, and ragged batches would
    # otherwise make hundreds of them (RSS grew ~265 MB over 4000 requests, see README).
    assert [padded_rows(t) for t in (1, 2, 3, 5, 16, 17, 250, 257, 2048)] == [
        1,
        2,
        4,
        8,
        16,
        32,
        256,
        320,
        2048,
    ]
    assert all(t <= padded_rows(t) <= max(2 * t - 1, 1.25 * t) for t in range(1, 5000))
    assert len({padded_rows(t) for t in range(1, 2049)}) <= 64
    if not cpu_packing_supported(torch.float32):
        pytest.skip("oneDNN cannot pack float32 here: plain linears, nothing padded")
    lin = torch.nn.Linear(64, 96)
    packed = PackedLinear(lin)
    for t in (1, 3, 17, 33, 300):
        x = torch.randn(t, 64)
        y = packed(x)
        assert y.shape == (t, 96)
        torch.testing.assert_close(y, lin(x), rtol=1e-5, atol=1e-5)


def test_the_cpp_packed_linear_is_the_python_one():
    from controlplane.engine.kernels import cpu_ops
    from controlplane.engine.model.linear import (
        PackedLinear,
        _packed_linear,
        cpu_packing_supported,
        padded_rows,
    )

    if not cpu_ops.available() or not cpu_packing_supported(torch.bfloat16):
        pytest.skip("needs our CPU kernels and oneDNN bf16 packing")
    # One bucket rule in two languages: the C++ op's and the Python fallback's.
    assert all(torch.ops.controlplane_cpu.packed_rows(t) == padded_rows(t) for t in range(1, 5000))
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.native
    for t in (1, 3, 17, 300):
        x = torch.randn(t, 64, dtype=torch.bfloat16)
        y = packed(x)
        assert y.shape == (t, 48)
        assert torch.equal(y, _packed_linear(x, packed.packed, packed.bias))
    with pytest.raises(RuntimeError, match="out_features=47"):
        torch.ops.controlplane_cpu.packed_linear(x, packed.packed, packed.bias, 47)


def test_packing_test_holds_on_an_avx2_only_cpu(tiny_model_dir):
    # oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA) is what an AVX2-only CPU looks like to the
    # engine: bfloat16 does not pack there, float32 still does, and the test above must hold.
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    probe = (
        "import torch; from controlplane.engine.model.linear import cpu_packing_supported as s;"
        "print(s(torch.bfloat16), s(torch.float32))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.stdout.split() == ["False", "True"], out.stderr
    node = f"{__file__}::test_packed_cpu_linears_match_plain_linears[bfloat16]"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
