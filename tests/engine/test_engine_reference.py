"""The engine against transformers, the reference implementation (float32, tiny random models)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from harness import assert_no_leaks, drain

NUM_REQUESTS = 16
MAX_NEW = 24


def workload(seed: int = 0, n: int = NUM_REQUESTS) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 60, (n,), generator=g).tolist()
    outs = torch.randint(1, MAX_NEW + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(0, 1000, (k,), generator=g).tolist() for k in lens]
    return prompts, outs


@pytest.fixture(scope="module")
def hf_models(hf_model_dirs: dict[str, Path]):
    from transformers import AutoModelForCausalLM

    return {
        k: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for k, d in hf_model_dirs.items()
    }


@pytest.fixture(scope="module")
def references(hf_models) -> dict[str, list[list[int]]]:
    """Greedy continuations from transformers.generate, one request at a time (no padding)."""
    prompts, outs = workload()
    refs = {}
    with torch.no_grad():
        for kind, model in hf_models.items():
            refs[kind] = [
                model.generate(
                    torch.tensor([p]),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )[0, len(p) :].tolist()
                for p, n in zip(prompts, outs, strict=True)
            ]
    return refs


def run_all(engine: Engine, prompts, outs, on_step=None) -> list[list[int]]:
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in zip(prompts, outs, strict=True)
    ]
    steps = itertools.count(1)  # on_step is told how many steps have run
    done = drain(engine, on_step and (lambda e: on_step(e, next(steps))))
    assert_no_leaks(engine)
    return [list(done[i].token_ids) for i in ids]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_logits_of_every_chunk_and_decode_match_transformers(kind, hf_model_dirs, hf_models):
    engine = Engine(
        model=str(hf_model_dirs[kind]),
        dtype="float32",
        prefill_chunk_size=7,
        max_num_batched_tokens=32,
    )
    engine.runner.trace = []
    prompts, outs = workload(seed=1, n=6)
    outputs = run_all(engine, prompts, outs)
    # Replay each request's tokens (the last output was never fed back) through transformers.
    full_logits = {}
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        with torch.no_grad():
            full_logits[f"req-{i}"] = hf_models[kind](torch.tensor([prompt + output[:-1]])).logits[
                0
            ]
    checked = 0
    for rid, positions, logits in engine.runner.trace:
        ref = full_logits[rid][positions]
        rel = (logits - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, (
            f"{kind} {rid} positions {positions[0]}..{positions[-1]}: rel err {rel:.2e}"
        )
        checked += len(positions)
    chunked = [p for _, p, _ in engine.runner.trace if len(p) > 1]
    assert chunked and max(len(p) for p in chunked) == 7, "prefill was not chunked"
    assert checked == sum(len(p) + n - 1 for p, n in zip(prompts, outs, strict=True))


SCENARIOS = {
    "default": {},
    "chunk7": {"prefill_chunk_size": 7},
    "max_seqs3": {"max_num_seqs": 3},
    "preempt_recompute": {"block_size": 4, "num_kv_blocks": 40, "preemption_mode": "recompute"},
    "preempt_swap": {
        "block_size": 4,
        "num_kv_blocks": 40,
        "preemption_mode": "swap",
        "swap_space_bytes": 40960,
    },
    # No swap space at all: every swap preemption must fall back to recompute.
    "swap_full_fallback": {
        "block_size": 4,
        "num_kv_blocks": 40,
        "preemption_mode": "swap",
        "swap_space_bytes": 0,
    },
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_outputs_identical_to_transformers(kind, scenario, hf_model_dirs, references):
    engine = Engine(model=str(hf_model_dirs[kind]), dtype="float32", **SCENARIOS[scenario])
    prompts, outs = workload()
    seen = {"running": 0, "swapped": 0, "chunked": False}

    def watch(eng: Engine, _step: int) -> None:
        st = eng.stats()
        seen["running"] = max(seen["running"], st.num_running)
        seen["swapped"] = max(seen["swapped"], st.num_swapped)

    got = run_all(engine, prompts, outs, on_step=watch)
    assert got == references[kind]
    if scenario == "max_seqs3":
        assert seen["running"] == 3
    if scenario.startswith("preempt") or scenario == "swap_full_fallback":
        assert engine.stats().num_preemptions > 0, "the KV budget was meant to force preemption"
    if scenario == "swap_full_fallback":
        assert seen["swapped"] == 0
    if scenario == "preempt_swap":
        assert seen["swapped"] > 0, "swap mode never swapped"
    if scenario == "default":
        # Short requests finish while others prefill; most of the 16 still share a batch.
        assert seen["running"] >= 12


def test_settings_changed_mid_run_keep_greedy_outputs(hf_model_dirs, references):
    engine = Engine(
        model=str(hf_model_dirs["llama"]), dtype="float32", block_size=4, num_kv_blocks=60
    )
    prompts, outs = workload()
    changes = {
        3: {"max_num_seqs": 2, "prefill_chunk_size": 5},
        8: {"max_num_seqs": 16, "max_num_batched_tokens": 64, "preemption_mode": "swap"},
        15: {"prefill_chunk_size": 3, "preemption_mode": "recompute", "max_num_seqs": 5},
    }
    caps = []

    def tune(eng: Engine, step: int) -> None:
        if step in changes:
            eng.update_settings(**changes[step])
        caps.append((eng.settings.max_num_seqs, eng.stats().num_running))

    assert run_all(engine, prompts, outs, on_step=tune) == references["llama"]
    # The cap in force at each step boundary was obeyed by that step's batch.
    assert all(running <= cap for cap, running in caps)
    assert any(cap == 2 for cap, _ in caps)
