"""No single request can take the engine down (issue 15, items 1, 3 and 7).

- Every number a request carries is range-checked and finite before admission: 400 naming the
  field, never a dead step loop.
- A request that fails inside a step (sampling, post-processing) ends alone with finish reason
  `error`; a failed forward pass fails that step's requests; the engine keeps serving.
- After an abort, the published stats agree with the block pool at once.

Failures are injected by patching one engine function to raise for one chosen request: the
engine, the model, the daemon and HTTP all run for real.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import controlplane.engine.engine as engine_module
import controlplane.engine.sampler as sampler_module
from controlplane.engine import AsyncEngine, Engine, InvalidSettingError, SamplingParams
from controlplane.engine.engine import MAX_CONSECUTIVE_FAILED_STEPS
from harness import InProcessDaemon, drain, wait_rows

MODEL = "model"  # the tiny demo model's directory name, served as the model id
TOKEN = "faults-admin-token-0123456789"
NAN, INF = float("nan"), float("inf")


# -- SamplingParams: every field, every bad value, the field named --------------------------


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", 2.0, "integer"),
        ("temperature", NAN, "finite"),
        ("temperature", INF, "finite"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", 100.5, "<= 100"),
        ("temperature", 10**400, "finite"),
        ("temperature", "1", "finite"),
        ("top_k", 10**20, "2^31-1"),
        ("top_k", 2**31, "2^31-1"),
        ("top_k", -2, "-1 or 0"),
        ("top_k", 5.0, "-1 or 0"),
        ("top_k", True, "-1 or 0"),
        ("top_p", NAN, "(0, 1]"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", INF, "(0, 1]"),
        ("min_p", NAN, "[0, 1]"),
        ("min_p", -INF, "[0, 1]"),
        ("repetition_penalty", NAN, "(0, 1e+06]"),
        ("repetition_penalty", INF, "(0, 1e+06]"),
        ("repetition_penalty", 0.0, "(0, 1e+06]"),
        ("repetition_penalty", 1e7, "(0, 1e+06]"),
        ("presence_penalty", NAN, "[-2, 2]"),
        ("presence_penalty", -INF, "[-2, 2]"),
        ("frequency_penalty", NAN, "[-2, 2]"),
        ("frequency_penalty", 2.5, "[-2, 2]"),
        ("seed", 2**64, "int64"),
        ("seed", 2**63, "int64"),
        ("seed", -(2**63) - 1, "int64"),
        ("seed", 1.5, "int64"),
        # Too long for str(): the message must still be built.
        pytest.param("seed", 10**5000, "int64", id="seed-5000-digits"),
        ("stop_token_ids", [10**30], "[0, 2^31-1]"),
        ("stop_token_ids", [-1], "[0, 2^31-1]"),
        ("stop_token_ids", [1.0], "[0, 2^31-1]"),
        ("stop_token_ids", list(range(65)), "at most 64"),
        ("stop", ["x"] * 17, "at most 16"),
        ("logprobs", 21, "[0, 20]"),
        ("ignore_eos", 1, "boolean"),
    ],
)
def test_sampling_params_reject_out_of_range(field: str, value: Any, words: str) -> None:
    with pytest.raises(InvalidSettingError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and words in str(info.value), str(info.value)


def test_sampling_params_accept_the_limits() -> None:
    for kwargs in (
        {"temperature": 100.0},
        {"temperature": 0},
        {"top_k": 2**31 - 1},
        {"top_k": -1},
        {"repetition_penalty": 1e6},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"stop_token_ids": list(range(64))},
        {"min_p": 1},
    ):
        SamplingParams(**kwargs)
    assert SamplingParams(temperature=1e-320).greedy and not SamplingParams(temperature=1e-5).greedy
    # int64 negatives map onto torch's range one to one (two's complement).
    assert SamplingParams(seed=-1).torch_seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).torch_seed == 2**63


# -- the engine, in process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(model=str(tiny_model_dir), max_model_len=256, block_size=8, max_num_seqs=8)


# After each test that used the module's engine: no request and no KV block left held.
pytestmark = pytest.mark.usefixtures("engine_left_clean")


PROMPTS = [[3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17, 18], list(range(30, 47)), [7] * 25]


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def seeded(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, top_k=40, seed=7, ignore_eos=True)


def run_batch(engine: Engine, victim_params: SamplingParams) -> tuple[dict[str, Any], str]:
    """The same workload each time: four greedy requests, one seeded, and a victim."""
    ids = [engine.add_request(p, greedy(), request_id=f"g{i}") for i, p in enumerate(PROMPTS)]
    ids.append(engine.add_request([20, 21, 22], seeded(), request_id="seeded"))
    victim = engine.add_request([50, 51, 52, 53], victim_params, request_id="victim")
    return drain(engine), victim


def test_tiny_temperature_is_greedy_and_huge_top_k_keeps_everything(engine):
    base = engine.add_request([3, 4, 5], greedy())
    tiny = engine.add_request([3, 4, 5], SamplingParams(max_tokens=12, temperature=1e-320))
    done = drain(engine)
    assert done[tiny].token_ids == done[base].token_ids
    # top_k beyond the vocabulary is top_k disabled (the sampler clamps it), same seed same draw.
    params = {"max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    huge = engine.add_request([8, 9], SamplingParams(top_k=2**31 - 1, **params))
    off = engine.add_request([8, 9], SamplingParams(top_k=0, **params))
    done = drain(engine)
    assert done[huge].finish_reason == "length" and done[huge].token_ids == done[off].token_ids


def test_token_ids_are_checked_against_the_vocabulary(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidSettingError) as info:
        engine.add_request([1, 2], SamplingParams(stop_token_ids=[vocab]))
    assert info.value.field == "stop_token_ids" and f"[0, {vocab})" in str(info.value)
    with pytest.raises(InvalidSettingError) as info:
        engine.add_request([1, 10**30], SamplingParams())
    assert info.value.field == "prompt" and f"[0, {vocab})" in str(info.value)
    assert not engine.has_unfinished_requests()


def test_a_sampling_failure_fails_only_its_request(engine, monkeypatch):
    clean, _ = run_batch(engine, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    real = sampler_module._filter
    calls = {"batch_failures": 0}

    def faulty(logits, seqs):
        # The victim fails from its 4th token on, in whatever batch it is sampled.
        if any(s.request_id == "victim" and len(s.output_token_ids) >= 3 for s in seqs):
            calls["batch_failures"] += len(seqs) > 1
            raise RuntimeError("injected sampling fault")
        return real(logits, seqs)

    monkeypatch.setattr(sampler_module, "_filter", faulty)
    finished_before = engine.stats().num_finished
    done, victim = run_batch(
        engine, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    )
    out = done[victim]
    assert out.finished and out.finish_reason == "error"
    assert "injected sampling fault" in out.error and len(out.token_ids) == 3
    assert calls["batch_failures"] >= 1, "the victim shared a batch with the seeded request"
    for rid in [f"g{i}" for i in range(len(PROMPTS))] + ["seeded"]:
        assert done[rid].finish_reason == "length" and done[rid].error is None
        assert done[rid].token_ids == clean[rid].token_ids, rid  # greedy and seeded alike
    assert engine.block_pool.num_used == 0 and not engine.requests
    assert engine.stats().num_finished == finished_before + len(PROMPTS) + 2
    monkeypatch.undo()
    again = engine.add_request([3, 4, 5], greedy())
    assert drain(engine)[again].token_ids == clean["g0"].token_ids


def test_a_post_processing_failure_fails_only_its_request(engine, monkeypatch):
    clean, _ = run_batch(engine, greedy())
    real = engine_module.take_token

    def faulty(seq, token, *args):
        if seq.request_id == "victim" and len(seq.output_token_ids) == 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real(seq, token, *args)

    monkeypatch.setattr(engine_module, "take_token", faulty)
    done, victim = run_batch(engine, greedy())
    assert done[victim].finish_reason == "error" and "injected" in done[victim].error
    assert done[victim].token_ids == clean[victim].token_ids[:5]
    for rid in [f"g{i}" for i in range(len(PROMPTS))] + ["seeded"]:
        assert done[rid].token_ids == clean[rid].token_ids, rid
    assert engine.block_pool.num_used == 0


def test_a_forward_failure_fails_that_step_and_the_engine_serves_on(engine, monkeypatch):
    clean, _ = run_batch(engine, greedy())
    real = engine.runner.execute
    calls = {"n": 0}

    def faulty(sched):
        calls["n"] += 1
        if calls["n"] == 4:  # once, mid-decode
            raise RuntimeError("injected device fault")
        return real(sched)

    monkeypatch.setattr(engine.runner, "execute", faulty)
    done, _ = run_batch(engine, greedy())
    assert len(done) == len(PROMPTS) + 2
    assert all(
        o.finish_reason == "error" and "injected device fault" in o.error for o in done.values()
    )
    assert all(len(o.token_ids) < 12 for o in done.values())
    assert engine.block_pool.num_used == 0 and engine.swap_pool.num_used == 0
    # The next requests are served, token for token as before.
    after, _ = run_batch(engine, greedy())
    assert {rid: o.token_ids for rid, o in after.items()} == {
        rid: o.token_ids for rid, o in clean.items()
    }


def test_a_forward_that_keeps_failing_stops_the_engine(tiny_model_dir, monkeypatch):
    eng = Engine(model=str(tiny_model_dir), max_model_len=128)

    def broken(sched):
        raise RuntimeError("injected persistent fault")

    monkeypatch.setattr(eng.runner, "execute", broken)
    for _ in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        rid = eng.add_request([1, 2, 3], greedy())
        (out,) = eng.step()
        assert out.request_id == rid and out.finish_reason == "error"
    eng.add_request([1, 2, 3], greedy())
    with pytest.raises(RuntimeError, match="consecutive steps failed"):
        eng.step()


def test_stats_agree_with_the_block_pool_right_after_an_abort(engine):
    a = engine.add_request([1, 2, 3] * 10, SamplingParams(max_tokens=100, ignore_eos=True))
    b = engine.add_request([4, 5], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(5):
        engine.step()
    before = engine.stats()
    assert before.num_running == 2
    engine.abort(a)
    st = engine.stats()
    assert st.kv_blocks_used == engine.block_pool.num_used < before.kv_blocks_used
    assert st.num_running == 1 and st.num_finished == before.num_finished + 1
    # Gauges only: the step and its cumulative counters are the same step's.
    assert (st.step, st.busy_s_total, st.running_total, st.decode_tokens_total) == (
        before.step,
        before.busy_s_total,
        before.running_total,
        before.decode_tokens_total,
    )
    engine.abort(b)
    assert engine.stats().kv_blocks_used == 0 == engine.stats().num_running


def test_async_engine_survives_a_failing_request(tiny_model_dir, monkeypatch):
    real = sampler_module._filter

    def faulty(logits, seqs):
        if any(s.prompt_token_ids == [50, 51, 52, 53] for s in seqs):
            raise RuntimeError("injected sampling fault")
        return real(logits, seqs)

    async def collect(aeng, prompt, params):
        return [o async for o in aeng.generate(prompt, params)][-1]

    async def main() -> None:
        aeng = AsyncEngine.from_settings(model=str(tiny_model_dir), max_model_len=256)
        aeng.start()
        try:
            clean = await asyncio.gather(*(collect(aeng, p, greedy(20)) for p in PROMPTS))
            monkeypatch.setattr(sampler_module, "_filter", faulty)
            victim = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
            outs = await asyncio.gather(
                collect(aeng, [50, 51, 52, 53], victim),
                *(collect(aeng, p, greedy(20)) for p in PROMPTS),
            )
            assert outs[0].finish_reason == "error" and "injected" in outs[0].error
            assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in clean]
            assert aeng.is_running and aeng.engine.block_pool.num_used == 0

            # A request whose admission raises something unexpected fails alone, too.
            real_add = aeng.engine.add_request

            def add(prompt, params=None, request_id=None, **kw):  # kw: validated=True
                if prompt == [9, 9]:
                    raise RuntimeError("injected admission fault")
                return real_add(prompt, params, request_id, **kw)

            monkeypatch.setattr(aeng.engine, "add_request", add)
            with pytest.raises(RuntimeError, match="injected admission fault"):
                await collect(aeng, [9, 9], greedy())
            last = await collect(aeng, PROMPTS[0], greedy(20))
            assert aeng.is_running and last.token_ids == clean[0].token_ids

            # Item 7 through AsyncEngine: abort the only request; no step follows, and the
            # published ring already shows its blocks free, without a duplicate step.
            stream = aeng.add_request([1] * 20, SamplingParams(max_tokens=200, ignore_eos=True))
            async for out in stream:
                if len(out.token_ids) >= 3:
                    break
            assert aeng.recent_steps()[-1].kv_blocks_used > 0
            aeng.abort(stream.request_id)
            outs = [o async for o in stream]
            assert outs[-1].finish_reason == "abort"
            steps = aeng.recent_steps()
            assert steps[-1].kv_blocks_used == 0 == aeng.engine.block_pool.num_used
            assert steps[-1].num_running == 0
            assert len({s.step for s in steps}) == len(steps)
            assert aeng.recent_steps(steps[-1].step) == [steps[-1]]
        finally:
            await aeng.shutdown()

    asyncio.run(main())


# -- the real daemon over HTTP -----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        engine={"max_model_len": 512, "max_num_seqs": 8},
        store={"flush_interval_s": 0.1},
        admin_tokens=[{"name": "ops", "token": TOKEN}],
        with_file=False,
    )


def post_raw(d: InProcessDaemon, text: str, timeout: float = 60) -> httpx.Response:
    """POST JSON text as given (NaN and Infinity are not JSON, but clients send them)."""
    return httpx.post(
        d.url + "/v1/completions",
        content=text,
        headers={"Content-Type": "application/json"},
        timeout=timeout,
    )


def complete(d: InProcessDaemon, **body: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "ignore_eos": True, **body}
    return httpx.post(d.url + "/v1/completions", json=body, timeout=60)


def assert_serving(d: InProcessDaemon) -> None:
    h = httpx.get(d.url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ready", h.text
    r = complete(d, temperature=1.0, top_k=50)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("top_k", "100000000000000000000"),
        ("seed", str(2**64)),
        ("seed", str(-(2**63) - 1)),
        ("stop_token_ids", "[1000000000000000000000000000000]"),
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("temperature", "-Infinity"),
        ("temperature", "1e400"),
        ("repetition_penalty", "NaN"),
        ("top_p", "NaN"),
        ("min_p", "Infinity"),
        ("presence_penalty", "NaN"),
        ("frequency_penalty", "-Infinity"),
    ],
)
def test_out_of_range_numbers_get_400_and_the_daemon_serves_on(served, field, raw):
    d = served
    fields = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 1.0}
    fields.pop(field, None)
    text = json.dumps(fields)[:-1] + f', "{field}": {raw}}}'
    r = post_raw(d, text)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    assert_serving(d)


def test_stop_token_ids_beyond_the_vocabulary_get_400(served):
    d = served
    vocab = d.daemon.aengine.engine.model_config.vocab_size
    r = complete(d, stop_token_ids=[vocab])
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    assert f"[0, {vocab})" in r.json()["error"]["message"]


def test_tiny_temperature_is_served_greedy(served):
    d = served
    greedy_text = complete(d, prompt="tiny temperature", max_tokens=10, temperature=0)
    raw = json.dumps({"model": MODEL, "prompt": "tiny temperature", "max_tokens": 10})
    tiny = post_raw(d, raw[:-1] + ', "ignore_eos": true, "temperature": 1e-320}')
    assert tiny.status_code == 200 and greedy_text.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy_text.json()["choices"][0]["text"]
    assert_serving(d)


VICTIM_PROMPT = [61, 62, 63, 64, 65]


def test_a_failing_request_gets_500_and_the_others_are_served(served, monkeypatch):
    d = served
    cfg = d.cfg
    others = [{"prompt": [3 + i, 4, 5 + i], "max_tokens": 12, "temperature": 0} for i in range(4)]
    clean = [complete(d, **body).json()["choices"][0]["text"] for body in others]
    real = sampler_module._filter

    def faulty(logits, seqs):
        if any(s.prompt_token_ids == VICTIM_PROMPT and s.output_token_ids for s in seqs):
            raise RuntimeError("injected sampling fault")
        return real(logits, seqs)

    monkeypatch.setattr(sampler_module, "_filter", faulty)
    victim = {"prompt": VICTIM_PROMPT, "max_tokens": 12, "temperature": 1.0}

    def victim_stream() -> list[str]:
        body = {"model": MODEL, "ignore_eos": True, "stream": True, **victim}
        with httpx.stream("POST", d.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    with ThreadPoolExecutor(6) as pool:
        plain = pool.submit(complete, d, **victim)
        streamed = pool.submit(victim_stream)
        served_ok = [pool.submit(complete, d, **body) for body in others]
        r = plain.result()
        events = streamed.result()
        results = [f.result() for f in served_ok]
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "injected sampling fault" in err["message"]
    assert "[DONE]" not in events and "injected sampling fault" in events[-1]
    assert json.loads(events[-1])["error"]["type"] == "server_error"
    assert [x.status_code for x in results] == [200] * 4
    assert [x.json()["choices"][0]["text"] for x in results] == clean
    assert d.daemon.aengine.engine.block_pool.num_used == 0
    monkeypatch.undo()
    assert_serving(d)
    failed = wait_rows(
        cfg.store_url, lambda rows: len(rows) == 2, where="status = 'error'", timeout=30
    )
    assert all(
        row["finish_reason"] == "error" and "injected sampling fault" in row["error"]
        for row in failed
    )


def _gauges(d: InProcessDaemon) -> dict[str, float]:
    text = httpx.get(d.url + "/metrics", timeout=10).text
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in ("controlplane:num_requests_running", "controlplane:kv_cache_usage_perc")
    }


def test_admin_stats_and_metrics_agree_with_the_block_map_right_after_an_abort(served):
    d = served
    admin = d.client(TOKEN, timeout=30)
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["r"] = complete(d, prompt="abort me", max_tokens=480, temperature=0)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = 200
    while deadline and not admin.get("/admin/requests").json()["live"]:
        deadline -= 1
        threading.Event().wait(0.05)
    (live,) = admin.get("/admin/requests").json()["live"]
    for _ in range(500):
        if admin.get("/admin/stats").json()["kv_blocks_used"] > 0:
            break
        threading.Event().wait(0.02)
    assert _gauges(d)["controlplane:num_requests_running"] == 1
    assert admin.post(f"/admin/requests/{live['id']}/abort").status_code == 200
    t.join(60)
    assert result["r"].json()["choices"][0]["finish_reason"] == "abort"
    # The engine is idle now: no step follows the abort, yet every view agrees at once.
    stats = admin.get("/admin/stats", params={"block_map": 8}).json()
    assert admin.get("/admin/requests").json()["live"] == []
    assert set(stats["kv_block_map"]) == {0.0}
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0, stats
    assert stats["kv_usage_perc"] == 0.0 and stats["queue_length"] == 0
    assert _gauges(d) == {
        "controlplane:num_requests_running": 0.0,
        "controlplane:kv_cache_usage_perc": 0.0,
    }
    steps = d.daemon.aengine.recent_steps()
    assert len({s.step for s in steps}) == len(steps), "an abort must not add a step"
