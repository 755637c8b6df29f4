"""Speculative decoding on the tiny demo model: exact outputs, exact distributions, clean KV."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from controlplane.engine import Engine, InvalidSettingError, SamplingParams
from controlplane.engine import spec_decode as spec_module
from controlplane.engine.demo_model import write_demo_model
from controlplane.engine.model_runner import samples
from controlplane.engine.spec_decode import ngram_propose
from controlplane.engine.structured import StructuredOutput
from harness import assert_no_leaks, drain

BS = 8


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same tokenizer, different random weights: a draft whose q differs much from p."""
    return write_demo_model(tmp_path_factory.mktemp("draft") / "model", size="tiny", seed=1)


@pytest.fixture(scope="module")
def sharp_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with its logits x 8 (lm_head x 8): the same ranking, a sharper
    distribution. As a draft, q differs from p on every token, so the acceptance rule matters:
    exact rejection sampling gives p, accepting too much gives q."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("sharp") / "model"
    shutil.copytree(tiny_model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 8
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make(tiny_model_dir: Path, **kw: Any) -> Engine:
    return Engine(model=str(tiny_model_dir), block_size=BS, max_model_len=512, **kw)


# Sixteen mixed requests: repetitive ones (n-gram proposals hit), a shared prefix (cache
# hits), long and short prompts.
SHARED = [(3 + 5 * i) % 700 + 4 for i in range(3 * BS)]
PROMPTS = (
    [[5, 6, 7, 8, 9] * (2 + i % 3) for i in range(4)]
    + [[*SHARED, 100 + i, 200 + i] for i in range(4)]
    + [list(range(20 + i, 60 + 3 * i)) for i in range(4)]
    + [[11 + i, 12, 13] for i in range(4)]
)


def greedy_run(engine: Engine, max_tokens: int = 30, on_step=None) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=max_tokens + i % 7, temperature=0, ignore_eos=True)
        engine.add_request(p, params, request_id=f"r{i}")
    out = {rid: o.token_ids for rid, o in drain(engine, on_step).items()}
    assert_no_leaks(engine)
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[int]]:
    return greedy_run(make(tiny_model_dir))


SCENARIOS = {
    "plain": {},
    "chunked": {"prefill_chunk_size": 5, "max_num_batched_tokens": 40},
    "recompute": {"num_kv_blocks": 40, "preemption_mode": "recompute"},
    "swap": {"num_kv_blocks": 40, "preemption_mode": "swap"},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(
    ("method", "k"),
    [("ngram", 1), ("ngram", 3), ("ngram", 5), ("draft", 1), ("draft", 3), ("draft", 5)],
)
def test_greedy_outputs_are_identical(
    tiny_model_dir, other_model_dir, reference, scenario, method, k
):
    kw = dict(SCENARIOS[scenario])
    if method == "draft":
        kw["speculative_draft_model"] = str(other_model_dir)
    eng = make(
        tiny_model_dir,
        speculative_method=method,
        speculative_num_tokens=k,
        speculative_max_batch_size=32,
        **kw,
    )
    assert greedy_run(eng) == reference
    st = eng.stats()
    assert st.spec_decode_num_drafts_total > 0 and st.spec_decode_num_draft_tokens_total > 0
    assert st.prefix_cache_hits_total > 0
    if scenario in ("recompute", "swap"):
        assert st.num_preemptions > 0


def test_self_draft_accepts_everything_greedy(tiny_model_dir, reference):
    eng = make(
        tiny_model_dir,
        speculative_method="draft",
        speculative_draft_model=str(tiny_model_dir),
        speculative_num_tokens=4,
        speculative_max_batch_size=32,
    )
    assert greedy_run(eng) == reference
    st = eng.stats()
    assert st.spec_decode_num_accepted_tokens_total == st.spec_decode_num_draft_tokens_total > 0
    assert len(st.spec_decode_accepted_per_pos) == 4


def test_live_method_and_k_changes_keep_greedy_outputs(tiny_model_dir, other_model_dir, reference):
    eng = make(
        tiny_model_dir, speculative_draft_model=str(other_model_dir), speculative_max_batch_size=32
    )
    plan = iter(
        [
            {"speculative_method": "ngram", "speculative_num_tokens": 2},
            {"speculative_method": "draft", "speculative_num_tokens": 4},
            {"speculative_method": "off"},
            {"speculative_method": "draft", "speculative_num_tokens": 1},
            {"speculative_method": "ngram", "speculative_num_tokens": 5},
        ]
        * 20
    )

    def change(engine: Engine) -> None:
        if engine.stats().step % 3 == 0:
            engine.update_settings(**next(plan))

    assert greedy_run(eng, on_step=change) == reference


def test_speculation_pauses_above_the_batch_limit(tiny_model_dir):
    eng = make(tiny_model_dir, speculative_method="ngram", speculative_max_batch_size=2)
    for i in range(4):
        eng.add_request(
            PROMPTS[12 + i], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        )
    eng.step()  # the prefills: nobody decodes yet
    eng.step()
    assert eng.stats().speculation == "paused"
    drain(eng)
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.stats().speculation == "active"
    drain(eng)
    assert_no_leaks(eng)


def test_stop_inside_an_accepted_run_ends_there(tiny_model_dir, other_model_dir, reference):
    out = reference["r0"]
    stop_at = 6
    stop_id = out[stop_at]
    first = out.index(stop_id)
    for method, extra in (
        ("ngram", {}),
        ("draft", {"speculative_draft_model": str(tiny_model_dir)}),
    ):
        eng = make(tiny_model_dir, speculative_method=method, speculative_num_tokens=5, **extra)
        eng.add_request(
            PROMPTS[0],
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]),
            request_id="s",
        )
        eng.add_request(
            PROMPTS[0], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True), request_id="m"
        )
        done = drain(eng)
        assert done["s"].token_ids == out[: first + 1] and done["s"].finish_reason == "stop"
        assert done["m"].token_ids == out[:7] and done["m"].finish_reason == "length"
        assert_no_leaks(eng)


def test_abort_during_speculation_frees_everything(tiny_model_dir, other_model_dir):
    eng = make(
        tiny_model_dir, speculative_method="draft", speculative_draft_model=str(other_model_dir)
    )
    for i in range(6):
        eng.add_request(
            PROMPTS[i], SamplingParams(max_tokens=100, ignore_eos=True), request_id=f"a{i}"
        )
    for _ in range(6):
        eng.step()
    assert eng.draft.pool.num_used > 0 and eng.stats().spec_decode_num_drafts_total > 0
    for i in range(6):
        eng.abort(f"a{i}")
    assert_no_leaks(eng)


def test_draft_settings_are_validated(tiny_model_dir):
    with pytest.raises(InvalidSettingError) as err:
        make(tiny_model_dir, speculative_method="draft")
    assert err.value.field == "speculative_method"
    eng = make(tiny_model_dir)
    with pytest.raises(InvalidSettingError) as err:
        eng.update_settings(speculative_method="draft")
    assert "restart" in str(err.value)
    with pytest.raises(InvalidSettingError) as err:
        eng.update_settings(speculative_num_tokens=17)
    assert err.value.field == "speculative_num_tokens"


def test_ngram_proposer():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 2, 1, 3) == [9, 1]
    assert ngram_propose([1, 2, 3, 4], 2, 1, 3) == []  # nothing repeats
    # The longest suffix wins: "2 3" occurs twice, "1 2 3" once.
    assert ngram_propose([1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3], 1, 2, 3) == [7]
    # Token 256 = bytes 00 01 00 00: a byte match straddling two tokens is no token match.
    assert ngram_propose([1, 256, 0, 5, 256], 1, 1, 1) == [0]
    assert ngram_propose([0x01000000, 0, 1, 1], 1, 2, 2) == []


# -- the distribution ------------------------------------------------------------------------

TOP_K = 5


@pytest.fixture(scope="module")
def prompt(tiny_model_dir) -> list[int]:
    """A prompt ending in the target's own greedy continuation, which repeats itself: likely
    next tokens occur earlier in it, so the n-gram proposer's drafts are sometimes accepted and
    sometimes rejected (both halves of the rule are exercised)."""
    base = [5, 6, 7, 8, 9, 5, 6, 7, 8]
    eng = make(tiny_model_dir)
    eng.add_request(
        base, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), request_id="g"
    )
    return base + drain(eng)["g"].token_ids


def exact_next(engine: Engine, prefix: list[int]) -> dict[int, float]:
    """The target's top-k distribution after `prefix` (what top_k sampling draws from)."""
    engine.add_request(
        prefix, SamplingParams(max_tokens=1, temperature=0, logprobs=TOP_K), request_id="x"
    )
    (lp,) = drain(engine)["x"].logprobs
    weights = {t: math.exp(v) for t, v in lp.top}
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


def marginals(engine: Engine, prompt: list[int], depth: int) -> list[dict[int, float]]:
    """Exact distributions of output tokens 1..depth (marginalised over earlier ones)."""
    layers = [{(): 1.0}]
    out = []
    for _ in range(depth):
        nxt: dict[tuple[int, ...], float] = {}
        dist: dict[int, float] = {}
        for prefix, w in layers[-1].items():
            for t, p in exact_next(engine, prompt + list(prefix)).items():
                nxt[(*prefix, t)] = w * p
                dist[t] = dist.get(t, 0.0) + w * p
        layers.append(nxt)
        out.append(dist)
    return out


def chi_square_rejects(
    counts: dict[int, int], expected: dict[int, float], n: int
) -> tuple[bool, float]:
    """Goodness of fit at significance 0.001 (Wilson-Hilferty quantile); pools small cells."""
    stat, df = 0.0, -1
    rest_obs, rest_exp = 0, 0.0
    for t, p in expected.items():
        if n * p < 5:
            rest_obs, rest_exp = rest_obs + counts.get(t, 0), rest_exp + n * p
            continue
        stat += (counts.get(t, 0) - n * p) ** 2 / (n * p)
        df += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / max(rest_exp, 1e-9)
        df += 1
    z = 3.09  # one-sided 0.001
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > crit, stat / crit


def sample_tokens(engine: Engine, prompt: list[int], n: int, depth: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=depth, temperature=1.0, top_k=TOP_K, ignore_eos=True)
    for i in range(n):
        engine.add_request(prompt, params, request_id=f"d{i}")
    done = drain(engine)
    assert_no_leaks(engine)
    return [done[f"d{i}"].token_ids for i in range(n)]


N_SAMPLES = 1500
DEPTH = 3


@pytest.fixture(scope="module")
def exact(tiny_model_dir, prompt) -> list[dict[int, float]]:
    return marginals(make(tiny_model_dir), prompt, DEPTH)


def spec_engine(tiny_model: Path, method: str, draft: Path | None = None, **extra: Any) -> Engine:
    if draft is not None:
        extra["speculative_draft_model"] = str(draft)
    return make(
        tiny_model,
        speculative_method=method,
        speculative_num_tokens=2,
        speculative_ngram_min=1,
        speculative_max_batch_size=4096,
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        **extra,
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_sampled_distribution_is_the_targets(
    tiny_model_dir, sharp_model_dir, prompt, exact, method
):
    draft = sharp_model_dir if method == "draft" else None
    eng = spec_engine(tiny_model_dir, method, draft)
    samples = sample_tokens(eng, prompt, N_SAMPLES, DEPTH)
    if method != "off":
        st = eng.stats()
        # Both outcomes are exercised: accepted drafts and rejections (residual draws).
        assert 0 < st.spec_decode_num_accepted_tokens_total < st.spec_decode_num_draft_tokens_total
    for pos in range(1, DEPTH):  # token 0 comes from the prefill, never speculated
        counts: dict[int, int] = {}
        for s in samples:
            counts[s[pos]] = counts.get(s[pos], 0) + 1
        rejected, ratio = chi_square_rejects(counts, exact[pos], N_SAMPLES)
        assert not rejected, f"position {pos}: chi-square {ratio:.2f}x the critical value"


@pytest.mark.slow
def test_a_wrong_acceptance_rule_fails_the_distribution_test(
    tiny_model_dir, sharp_model_dir, prompt, exact, monkeypatch
):
    # Accept every draft the target could emit (u = 0): the output follows the draft.
    real_rand = spec_module.torch.rand
    monkeypatch.setattr(spec_module.torch, "rand", lambda *a, **k: real_rand(*a, **k) * 0)
    eng = spec_engine(tiny_model_dir, "draft", sharp_model_dir)
    samples = sample_tokens(eng, prompt, N_SAMPLES, DEPTH)
    counts: dict[int, int] = {}
    for s in samples:
        counts[s[1]] = counts.get(s[1], 0) + 1
    rejected, ratio = chi_square_rejects(counts, exact[1], N_SAMPLES)
    assert rejected, f"chi-square only {ratio:.2f}x the critical value"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_constrained_greedy_outputs_are_identical_with_speculation(
    tiny_model_dir, other_model_dir, method
):
    """Drafts the grammar refuses are dropped before verification, each verified row is
    masked by the grammar state after the drafts before it, and the accepted run advances
    the state: constrained greedy output is the same with and without speculation, under
    preemption too."""
    pattern = "[a-z]{2,6}( [a-z]{2,6}){3,8}"
    out = StructuredOutput("regex", pattern)

    def run(engine: Engine) -> dict[str, str]:
        for i, p in enumerate(PROMPTS):
            params = SamplingParams(max_tokens=80, temperature=0, structured=out)
            engine.add_request(p, params, request_id=f"r{i}")
        texts = {rid: o.text for rid, o in drain(engine).items()}
        assert_no_leaks(engine)
        assert engine.stats().grammar_states == 0
        return texts

    base = run(make(tiny_model_dir, num_kv_blocks=40))
    draft = {"speculative_draft_model": str(other_model_dir)} if method == "draft" else {}
    eng = make(
        tiny_model_dir,
        num_kv_blocks=40,
        speculative_method=method,
        speculative_num_tokens=3,
        speculative_max_batch_size=32,
        **draft,
    )
    assert run(eng) == base
    assert all(re.fullmatch(pattern, t) for t in base.values()), base
    st = eng.stats()
    assert st.spec_decode_num_draft_tokens_total > 0 and st.num_preemptions > 0


def _mixed_step_run(tiny_model_dir: Path, seed: int) -> tuple[set[str], list[str]]:
    """Random arrivals of n > 1, constrained, greedy and sampled requests with repetitive
    prompts (the n-gram proposer hits) on a small KV cache (preemption), small chunks and live
    speculation switches; returns what shared one step and the errors seen."""
    import random

    rng = random.Random(seed)
    method = ("ngram", "draft")[seed % 2]
    eng = make(
        tiny_model_dir,
        speculative_method=method,
        speculative_draft_model=str(tiny_model_dir) if method == "draft" else "",
        speculative_num_tokens=rng.choice([1, 3, 5]),
        num_kv_blocks=rng.choice([32, 48, 64]),
        preemption_mode=("recompute", "swap")[seed % 3 == 0],
        prefill_chunk_size=rng.choice([8, 16]),
        max_num_batched_tokens=rng.choice([32, 64]),
        max_num_seqs=rng.choice([4, 8, 16]),
    )
    seen: set[str] = set()
    after_forward = eng._after_forward

    def observe(sched, logits, seqs, job, outputs):  # what this step's rows held
        if any(s.draft_token_ids for s in seqs):
            seen.add("drafts")
            if any(s.awaits_fork for s in seqs):
                seen.add("drafts+fork")
            if job.rows:
                seen.add("drafts+mask")
            if any(not samples(item) for item in sched.scheduled):
                seen.add("drafts+chunk")
            if sched.swap_out or eng.scheduler.waiting:
                seen.add("drafts+preemption")
        return after_forward(sched, logits, seqs, job, outputs)

    eng._after_forward = observe
    base = [rng.randrange(4, 700) for _ in range(5)]
    errors: list[str] = []
    outs: dict[str, list] = {}
    greedy: set[str] = set()
    added = 0
    while added < 24 or eng.has_unfinished_requests():
        if added < 24 and rng.random() < 0.3:
            prompt = [*(base * 8)[: rng.randrange(3, 60)], rng.randrange(4, 700)]
            structured = None
            if rng.random() < 0.3:
                structured = StructuredOutput("regex", rng.choice(["[a-z ]{0,40}", "(ab|cd)+"]))
            temperature = rng.choice([0, 0, 1.0])
            params = SamplingParams(
                max_tokens=rng.randrange(1, 60),
                temperature=temperature,
                n=rng.choice([1, 2, 2, 3]),
                ignore_eos=True,
                structured=structured,
            )
            eng.add_request(prompt, params, request_id=f"r{added}")
            if temperature == 0:
                greedy.add(f"r{added}")
            added += 1
        if rng.random() < 0.03:
            eng.update_settings(speculative_method=rng.choice(["off", method]))
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
            if out.error:
                errors.append(f"{out.request_id}: {out.error}")
    for rid in greedy:  # every greedy choice follows the same argmax path
        tokens: dict[int, list[int]] = {}
        for out in outs[rid]:
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
        assert len({tuple(t) for t in tokens.values()}) == 1, (rid, tokens)
    assert_no_leaks(eng)
    assert eng.stats().grammar_states == 0
    return seen, errors


def test_forks_drafts_masks_chunks_and_preemption_share_steps(tiny_model_dir):
    """The step's logits rows and its sequences agree whatever shares the step: a forked
    choice with drafts once killed the engine (IndexError) when another request forked in the
    same step. Every combination of forks, drafts, masks, prefill chunks and preemption in
    one step: no request fails, nothing leaks."""
    seen: set[str] = set()
    for seed in range(8):
        found, errors = _mixed_step_run(tiny_model_dir, seed)
        assert not errors, (seed, errors)
        seen |= found
    expected = {"drafts", "drafts+fork", "drafts+mask", "drafts+chunk", "drafts+preemption"}
    assert seen >= expected, f"never in one step: {expected - seen}"
