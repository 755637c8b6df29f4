"""Prefix caching and parallel sampling in the engine, on the tiny demo model.

The rule every test holds: greedy outputs are token-identical with the cache on and off, and
afterwards no block is held and every block is either free or cached (evictable).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controlplane.engine import Engine, InvalidSettingError, SamplingParams
from controlplane.engine.types import RequestOutput
from harness import assert_no_leaks, drain

BS = 8


def make(tiny_model_dir: Path, **kw: Any) -> Engine:
    return Engine(model=str(tiny_model_dir), block_size=BS, max_model_len=512, **kw)


def run(
    engine: Engine,
    leaders: list[list[int]],
    followers: list[list[int]],
    max_tokens: int = 12,
    n: int = 1,
) -> dict[str, list[int]]:
    """Leaders run first (so their blocks get cached), then the followers all at once.
    Returns {request id: output tokens}, by index for n > 1."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)
    out: dict[str, list[int]] = {}
    for group, tag in ((leaders, "lead"), (followers, "follow")):
        for i, prompt in enumerate(group):
            engine.add_request(prompt, params, request_id=f"{tag}-{i}")
        for (rid, index), o in drain(engine, by_index=True).items():
            assert o.finish_reason == "length", o.error
            out[f"{rid}#{index}"] = list(o.token_ids)
    assert_no_leaks(engine)
    return out


def both(tiny_model_dir: Path, leaders, followers, **kw: Any) -> tuple[dict, Engine]:
    """Outputs with the cache off and on (must be equal); returns them and the caching engine."""
    max_tokens = kw.pop("max_tokens", 12)
    n = kw.pop("n", 1)
    off = run(
        make(tiny_model_dir, enable_prefix_caching=False, **kw), leaders, followers, max_tokens, n
    )
    on_engine = make(tiny_model_dir, **kw)
    on = run(on_engine, leaders, followers, max_tokens, n)
    assert on == off
    return on, on_engine


def prompt(start: int, length: int) -> list[int]:
    return [(start + 7 * i) % 900 + 3 for i in range(length)]


@pytest.mark.parametrize(
    ("shared", "expect_cached"),
    [
        (5, 0),  # shorter than a block: nothing to reuse
        (2 * BS, 2 * BS),  # exactly two blocks
        (2 * BS + 1, 2 * BS),  # two blocks and a token: the partial block is computed
    ],
)
def test_shared_prefix_alignments(tiny_model_dir, shared, expect_cached):
    base = prompt(1, shared)
    leaders = [base + prompt(500, 9)]
    followers = [base + prompt(600 + 13 * i, 3 + i) for i in range(4)]
    _, eng = both(tiny_model_dir, leaders, followers)
    stats = eng.stats()
    assert stats.prefix_cache_hits_total == expect_cached * len(followers)
    queried = sum(map(len, leaders + followers))
    assert stats.prefix_cache_queries_total == queried


def test_a_block_matches_only_after_the_same_prefix(tiny_model_dir):
    # The second block's tokens are equal, the first's differ: the hash chain tells them apart.
    same = prompt(40, BS)
    leaders = [prompt(1, BS) + same + [9, 9, 9]]
    followers = [prompt(300, BS) + same + [9, 9, 9]]
    _, eng = both(tiny_model_dir, leaders, followers)
    assert eng.stats().prefix_cache_hits_total == 0


@pytest.mark.parametrize("length", [3 * BS, 3 * BS + 5])
def test_whole_prompt_cached_still_computes_its_last_token(tiny_model_dir, length):
    p = prompt(3, length)
    eng = make(tiny_model_dir)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eng.add_request(p, params, request_id="first")
    first = drain(eng, by_index=True)["first", 0]
    eng.add_request(p, params, request_id="again")
    again = drain(eng, by_index=True)["again", 0]
    assert again.token_ids == first.token_ids
    # The last prompt token's logits are needed: a prompt of exactly 3 blocks reuses 2.
    assert again.metrics.num_cached_tokens == (length - 1) // BS * BS
    assert first.metrics.num_cached_tokens == 0
    assert_no_leaks(eng)


def test_chunked_prefill_with_cache_hits(tiny_model_dir):
    base = prompt(11, 6 * BS + 3)
    leaders = [base + prompt(40, 10)]
    followers = [base + prompt(50 + i, 20 + i) for i in range(5)] + [leaders[0]]
    _, eng = both(
        tiny_model_dir, leaders, followers, prefill_chunk_size=5, max_num_batched_tokens=32
    )
    assert eng.stats().prefix_cache_hits_total >= 6 * BS * len(followers)


def test_a_burst_with_one_prefix_computes_it_once(tiny_model_dir):
    # Four requests arrive together: the first computes the shared blocks, chunk by chunk;
    # the others wait for them (while other work may overtake) instead of computing them too.
    base = prompt(31, 6 * BS)
    burst = [base + prompt(200 + 9 * i, 5) for i in range(4)]
    other = prompt(700, 20)  # shares nothing: never held back
    _, eng = both(tiny_model_dir, [], [*burst, other], prefill_chunk_size=2 * BS)
    stats = eng.stats()
    assert stats.prefix_cache_hits_total == 3 * 6 * BS
    assert stats.prefill_tokens_total == sum(map(len, burst)) + len(other) - 3 * 6 * BS


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_cache_hits(tiny_model_dir, mode):
    base = prompt(21, 3 * BS)
    leaders = [base + prompt(70, 4)]
    followers = [base + prompt(80 + 3 * i, 2 + i) for i in range(8)]
    out, eng = both(
        tiny_model_dir,
        leaders,
        followers,
        max_tokens=40,
        num_kv_blocks=24,
        preemption_mode=mode,
        n=2,
    )
    assert eng.stats().num_preemptions > 0
    assert eng.stats().prefix_cache_hits_total > 0
    # n=2 greedy: both choices are the same sequence.
    assert all(out[f"{rid}#0"] == out[f"{rid}#1"] for rid in ("lead-0", "follow-3"))


def test_eviction_pressure(tiny_model_dir):
    # Distinct prefixes one after another through a small cache: old ones must be evicted.
    leaders = [prompt(100 * i, 4 * BS + 2) for i in range(8)]
    followers = [[*p[: 4 * BS], 5, 6, 7] for p in leaders]
    _, eng = both(tiny_model_dir, leaders, followers, num_kv_blocks=20, max_tokens=8)
    stats = eng.stats()
    assert stats.prefix_cache_evictions_total > 0
    assert stats.prefix_cache_hits_total > 0  # the recent ones still hit


def test_toggle_live_and_reset(tiny_model_dir):
    p = prompt(7, 4 * BS + 1)
    eng = make(tiny_model_dir)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def once(rid: str) -> RequestOutput:
        eng.add_request(p, params, request_id=rid)
        return drain(eng, by_index=True)[rid, 0]

    ref = once("a")
    assert eng.block_pool.num_evictable > 0
    assert once("b").metrics.num_cached_tokens == 4 * BS
    eng.update_settings(enable_prefix_caching=False)
    off = once("c")
    assert off.metrics.num_cached_tokens == 0 and off.token_ids == ref.token_ids
    eng.update_settings(enable_prefix_caching=True)
    assert once("d").metrics.num_cached_tokens == 4 * BS  # the cached blocks survived
    assert eng.reset_prefix_cache() > 0
    assert eng.block_pool.num_evictable == 0 and eng.block_pool.num_cached == 0
    assert once("e").metrics.num_cached_tokens == 0
    assert_no_leaks(eng)


def test_abort_releases_cache_and_shared_blocks(tiny_model_dir):
    eng = make(tiny_model_dir)
    p = prompt(9, 3 * BS + 2)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, n=3)
    eng.add_request(p, params, request_id="x")
    eng.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True), request_id="y")
    for _ in range(4):
        eng.step()
    aborted = eng.abort("x")
    assert sorted(o.index for o in aborted) == [0, 1, 2]
    assert all(o.finish_reason == "abort" for o in aborted)
    eng.abort("y")
    assert_no_leaks(eng)


# -- parallel sampling ----------------------------------------------------------------------


def test_choices_share_the_prompt_blocks(tiny_model_dir):
    eng = make(tiny_model_dir)
    p = prompt(13, 2 * BS + 4)  # two full blocks and a partial one
    eng.add_request(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=4))
    eng.step()  # the prompt: choice 0 computes it and forks three more
    pool = eng.block_pool
    assert len(eng.scheduler.running) == 4
    assert pool.num_used == 3  # one prompt's blocks, held four times
    assert [pool.ref_counts[b] for b in eng.scheduler.running[0].block_table] == [4, 4, 4]
    eng.step()  # each choice writes into the partial block: three copy it, the last keeps it
    assert pool.num_used == 3 + 3
    done = drain(eng, by_index=True)
    outs = [done["req-0", i].token_ids for i in range(4)]
    assert all(o == outs[0] for o in outs)  # greedy: every choice is the same
    eng.add_request(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert drain(eng, by_index=True)["req-1", 0].token_ids == outs[0]
    assert_no_leaks(eng)


def test_seeded_choices_are_reproducible(tiny_model_dir):
    eng = make(tiny_model_dir)
    p = prompt(17, 11)

    def sample(n: int, seed: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True, n=n)
        rid = eng.add_request(p, params)
        # Something else in the batch must not change what a seeded choice draws.
        eng.add_request(prompt(300, 7), SamplingParams(max_tokens=5, temperature=1.0))
        done = drain(eng, by_index=True)
        return [done[rid, i].token_ids for i in range(n)]

    three = sample(3, 5)
    assert sample(3, 5) == three
    assert sample(1, 5) == three[:1]  # choice 0 uses the request's seed
    assert len({tuple(c) for c in three}) == 3  # the choices differ
    assert sample(3, 6) != three
    assert_no_leaks(eng)


def test_choices_sum_output_tokens_and_rank_by_logprob(tiny_model_dir):
    eng = make(tiny_model_dir)
    rid = eng.add_request(
        prompt(19, 9), SamplingParams(max_tokens=7, temperature=1.0, seed=1, ignore_eos=True, n=3)
    )
    done = drain(eng, by_index=True)
    outs = [done[rid, i] for i in range(3)]
    assert outs[0].metrics is outs[1].metrics  # one request, one record
    assert outs[0].metrics.num_output_tokens == 21
    assert all(o.cumulative_logprob is not None and o.cumulative_logprob < 0 for o in outs)


def test_n_is_bounded_by_the_batch(tiny_model_dir):
    eng = make(tiny_model_dir, max_num_seqs=4)
    with pytest.raises(InvalidSettingError) as err:
        eng.add_request([1, 2, 3], SamplingParams(n=5))
    assert err.value.field == "n" and "max_num_seqs is 4" in str(err.value)
    with pytest.raises(InvalidSettingError) as err:
        SamplingParams(n=0)
    assert err.value.field == "n"
