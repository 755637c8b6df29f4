"""The engine over three ranks (a model whose 6 heads and 3 KV heads the ranks divide) and over
two with asynchronous scheduling: the greedy tokens of one rank for 16 concurrent mixed
requests, under chunked prefill, preemption, prefix hits, speculation and structured outputs.
(Two ranks without asynchronous scheduling: tests/engine/test_tensor_parallel.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.structured import StructuredOutput
from tests.conftest import MIXED_ENGINE, mixed_workload, run_to_end, speculation_prompts
from tests.engine.test_tensor_parallel import _llama


@pytest.fixture(scope="module")
def six_heads(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llama(
        tmp_path_factory.mktemp("six-heads"),
        tiny_model_dir,
        num_attention_heads=6,
        num_key_value_heads=3,
    )


def _same_tokens(model: Path, size: int, prompts, params, **kw: object) -> Engine:
    """Runs `prompts` on one rank and on `size`; asserts equal tokens; returns the split one
    (closed) for further checks of its stats."""
    expected = run_to_end(Engine(model=str(model), dtype="float32", **kw), prompts, params)
    split = Engine(model=str(model), dtype="float32", tensor_parallel_size=size, **kw)
    try:
        assert run_to_end(split, prompts, params) == expected
    finally:
        split.close()
    return split


def test_three_ranks_generate_the_single_rank_tokens_under_preemption(six_heads: Path) -> None:
    prompts, params = mixed_workload(1024, 11, 10)
    split = _same_tokens(
        six_heads,
        3,
        prompts,
        params,
        preemption_mode="swap",
        attention_backend="torch",
        **MIXED_ENGINE,
    )
    stats = split.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits_total > 0
    assert [p.exitcode for p in split.runner.workers.procs] == [0, 0]


def test_three_ranks_under_speculation_and_structured_outputs(six_heads: Path) -> None:
    greedy = dict(temperature=0.0, ignore_eos=True)
    prompts = [p[:120] for p in speculation_prompts()] + [[5, 6, 7]]
    params = [SamplingParams(max_tokens=24, **greedy) for _ in range(3)] + [
        SamplingParams(max_tokens=12, structured=StructuredOutput("regex", r"[a-z]{3,8}"), **greedy)
    ]
    split = _same_tokens(
        six_heads,
        3,
        prompts,
        params,
        speculative_method="ngram",
        speculative_num_tokens=3,
        speculative_ngram_min=1,
    )
    assert split.stats().spec_decode_num_draft_tokens_total > 0


def test_two_ranks_with_asynchronous_scheduling(tiny_model_dir: Path) -> None:
    """Steps launched before the previous step's tokens are known (the device queue's thread
    sends each step to the workers): the tokens of one synchronous rank."""
    prompts, params = mixed_workload(1024, 5, 10)
    split = _same_tokens(tiny_model_dir, 2, prompts, params, async_scheduling="on", **MIXED_ENGINE)
    stats = split.stats()
    assert stats.num_preemptions > 0 and stats.async_steps_total > 0
