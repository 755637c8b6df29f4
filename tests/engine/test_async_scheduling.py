"""Asynchronous scheduling (engine.async_scheduling, engine/overlap.py): the same outputs as the
synchronous step under everything the engine does, and a step period that follows the longer
of the host's work and the forward rather than their sum.

On a CPU `on` runs the forward on the device queue's thread: the structure a CUDA stream gives
(the host goes on while the device computes) is exercised here for real."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.structured import StructuredOutput
from harness.engine import drain
from tests.conftest import MIXED_ENGINE, mixed_workload, run_to_end


def _engines(model_dir: Path, **kw: Any) -> tuple[Engine, Engine]:
    common = dict(model=str(model_dir), dtype="float32", attention_backend="torch", **kw)
    return Engine(async_scheduling="off", **common), Engine(async_scheduling="on", **common)


def _outputs(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[Any]:
    """Every choice's (token ids, text, finish reason, logprobs) in request order."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                lps = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
                done.setdefault(out.request_id, []).append(
                    (out.index, out.token_ids, out.text, out.finish_reason, lps)
                )
    return [sorted(done[i]) for i in ids]


def _no_leaks(engine: Engine) -> None:
    engine.close()
    assert engine.block_pool.num_used == 0
    assert not engine.requests
    assert engine._overlap.inflight is None


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_greedy_tokens_are_the_synchronous_ones_under_chunks_preemption_and_prefix_hits(
    tiny_model_dir: Path, preemption: str
) -> None:
    sync, ahead = _engines(tiny_model_dir, preemption_mode=preemption, **MIXED_ENGINE)
    prompts, params = mixed_workload(sync.model_config.vocab_size, 11, 10)
    assert run_to_end(ahead, prompts, params) == run_to_end(sync, prompts, params)
    stats = ahead.stats()
    assert stats.num_preemptions > 0  # the workload does preempt...
    assert stats.prefix_cache_hits_total > 0  # ...hit the prefix cache...
    assert stats.prefill_tokens_total > 0
    # ...and ran ahead at every step (nothing in it needs a synchronous one).
    assert ahead._overlap.steps == stats.step and not ahead._overlap.synchronous
    assert sync._overlap.steps == 0
    _no_leaks(ahead)


def test_every_feature_gives_the_synchronous_outputs(tiny_model_dir: Path) -> None:
    """Stop strings, EOS, stop tokens, logprobs, seeded sampling and max_model_len run ahead;
    penalties, n > 1, prompt logprobs, structured outputs and speculation run synchronously
    while they are in flight, and everything ends as the synchronous engine ends it."""
    sync, ahead = _engines(tiny_model_dir, max_num_seqs=8, max_model_len=96)
    vocab = sync.model_config.vocab_size
    gen = torch.Generator().manual_seed(5)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab - 8, (n,), generator=gen).tolist()

    greedy = dict(temperature=0.0)
    # A stop string and a stop token that the greedy output of `probe` is known to reach.
    probe = prompt(12)
    ((_, probe_ids, probe_text, _, _),) = _outputs(
        sync, [(probe, SamplingParams(max_tokens=24, ignore_eos=True, **greedy))]
    )[0]
    assert len(probe_text) > 8
    ahead_runs = [
        (prompt(9), SamplingParams(max_tokens=30, **greedy)),  # EOS may end it
        (probe, SamplingParams(max_tokens=24, stop=[probe_text[5:8]], **greedy)),
        (probe, SamplingParams(max_tokens=24, stop_token_ids=[probe_ids[7]], **greedy)),
        (prompt(7), SamplingParams(max_tokens=12, logprobs=3, ignore_eos=True, **greedy)),
        (prompt(8), SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True)),
        (prompt(80), SamplingParams(max_tokens=16, ignore_eos=True, **greedy)),  # max_model_len
    ]
    expected = _outputs(sync, ahead_runs)
    assert _outputs(ahead, ahead_runs) == expected
    reasons = {choice[3] for request in expected for choice in request}
    assert {"stop", "length"} <= reasons
    assert expected[1][0][3] == expected[2][0][3] == "stop"
    assert ahead._overlap.steps > 0 and not ahead._overlap.synchronous
    # Each beside a request that could run ahead: synchronous while it is in flight.
    sync_runs = {
        "penalties": SamplingParams(max_tokens=9, repetition_penalty=1.3, **greedy),
        "parallel sampling before its fork": SamplingParams(
            max_tokens=7, n=3, temperature=0.8, seed=3, ignore_eos=True
        ),
        "prompt logprobs": SamplingParams(max_tokens=5, prompt_logprobs=2, **greedy),
        "structured outputs": SamplingParams(
            max_tokens=12, structured=StructuredOutput("regex", r"[a-z]{3,6}"), **greedy
        ),
    }
    for reason, params in sync_runs.items():
        requests = [ahead_runs[3], (prompt(6), params)]
        assert _outputs(ahead, requests) == _outputs(sync, requests), reason
        assert ahead._overlap.synchronous[reason] > 0, reason
    # Speculation: synchronous while it is on, ahead once it is switched off.
    ahead.update_settings(speculative_method="ngram", speculative_num_tokens=2)
    sync.update_settings(speculative_method="ngram", speculative_num_tokens=2)
    spec = [(prompt(20) * 2, SamplingParams(max_tokens=12, ignore_eos=True, **greedy))]
    assert _outputs(ahead, spec) == _outputs(sync, spec)
    assert ahead._overlap.synchronous["speculation"] > 0
    _no_leaks(ahead)


def test_an_abort_while_its_token_is_in_flight_ends_it_and_frees_its_blocks(
    tiny_model_dir: Path,
) -> None:
    sync, ahead = _engines(tiny_model_dir, max_num_seqs=4)
    vocab = sync.model_config.vocab_size
    prompts = [[(7 * i + j) % (vocab - 8) + 3 for j in range(10)] for i in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = run_to_end(sync, prompts, [params] * 3)
    ids = [ahead.add_request(p, params) for p in prompts]
    seen: dict[str, list[int]] = {}
    for _ in range(6):
        for out in ahead.step():
            seen[out.request_id] = out.token_ids
    victim = ahead.requests[ids[1]]
    assert victim.num_pending == 1  # its next token is on the device
    (aborted,) = ahead.abort(ids[1])
    assert aborted.finish_reason == "abort"
    assert aborted.token_ids == expected[1][: len(aborted.token_ids)]
    done = drain(ahead)
    assert [done[ids[0]].token_ids, done[ids[2]].token_ids] == [expected[0], expected[2]]
    _no_leaks(ahead)


def test_a_forward_that_fails_fails_its_requests_and_the_engine_goes_on(
    tiny_model_dir: Path,
) -> None:
    _, ahead = _engines(tiny_model_dir, max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    real = ahead.runner.run
    calls = {"n": 0}

    def failing_once(*args: Any, **kw: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return real(*args, **kw)

    ahead.runner.run = failing_once  # type: ignore[method-assign]
    rid = ahead.add_request([5, 6, 7, 8], params)
    done = drain(ahead)
    assert done[rid].finish_reason == "error"
    assert "injected device fault" in (done[rid].error or "")
    ahead.runner.run = real  # type: ignore[method-assign]
    again = ahead.add_request([5, 6, 7, 8], params)
    assert len(drain(ahead)[again].token_ids) == 8
    _no_leaks(ahead)


@pytest.mark.serial
@pytest.mark.parametrize("host_s,forward_s", [(0.05, 0.05), (0.03, 0.07)])
def test_the_step_period_follows_the_longer_of_host_and_forward(
    tiny_model_dir: Path, host_s: float, forward_s: float
) -> None:
    """A forward that takes `forward_s` more (sleeping: off the GIL, as a device computes) and
    `host_s` more host work per step (in the output processing: one request, one call a step): synchronous steps take the
    sum, steps run ahead hide the shorter of the two behind the longer."""
    periods = {}
    for mode in ("off", "on"):
        engine = Engine(model=str(tiny_model_dir), dtype="float32", async_scheduling=mode)
        real_run, real_append = engine.runner.run, engine._take

        def slow_run(*args: Any, real_run: Any = real_run, **kw: Any) -> torch.Tensor:
            time.sleep(forward_s)
            return real_run(*args, **kw)

        def slow_append(*args: Any, real_append: Any = real_append, **kw: Any) -> Any:
            time.sleep(host_s)
            return real_append(*args, **kw)

        engine.runner.run = slow_run  # type: ignore[method-assign]
        engine._take = slow_append  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        engine.add_request([5, 6, 7], params)
        for _ in range(4):  # past the first steps (prefill, the pipeline filling)
            engine.step()
        t0, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        periods[mode] = (time.perf_counter() - t0) / steps
        engine.close()
    # The step's real work (the tiny model's, the machine's load) adds to both modes alike.
    assert periods["off"] >= host_s + forward_s
    assert periods["on"] >= max(host_s, forward_s)
    # Ahead, the shorter of the two is hidden: at least half of it, with room for noise.
    assert periods["off"] - periods["on"] >= min(host_s, forward_s) / 2, periods
