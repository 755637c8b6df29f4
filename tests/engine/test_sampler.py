"""The sampler on logits built by hand: greedy tokens are the first of equal maxima, as
torch.argmax gives them (the sampler reads them through `argmax_rows`, NumPy's argmax for
float32 on a CPU, which is faster there)."""

from __future__ import annotations

import pytest
import torch

# The code the sampler's batched filter and penalties replaced, kept once, as the benchmark's
# baseline: here the reference they must equal.
from benchmarks.sampling import full_sort_filter, penalize_row_by_row
from controlplane.engine import SamplingParams
from controlplane.engine.sampler import (
    FILTER_WIDTHS,
    Sampler,
    apply_penalties,
    argmax_rows,
    draw,
    filter_probs,
    invert_cdf,
)
from controlplane.engine.sequence import Sequence
from controlplane.engine.types import RequestMetrics


def _seq(i: int, params: SamplingParams) -> Sequence:
    return Sequence(f"r{i}", [1, 2, 3], params, RequestMetrics(arrival_time=0.0), detokenizer=None)


def test_greedy_tokens_are_the_first_of_equal_maxima():
    gen = torch.Generator().manual_seed(0)
    # Few distinct values: every row has its maximum at several positions.
    logits = torch.randint(0, 4, (16, 49152), generator=gen).float()
    logits[3, 7] = logits[3, 11] = 9.0  # the first maximum well before the others
    greedy = SamplingParams(temperature=0.0)
    tokens, _ = Sampler(0, torch.device("cpu"))(logits, [_seq(i, greedy) for i in range(16)])
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[3] == 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_argmax_rows_is_torchs_max_indices_with_nan_inf_and_strides(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (9, 1031), generator=gen).to(dtype)
    logits[1, 40] = logits[1, 900] = float("nan")  # a NaN counts as the largest: the first
    logits[2, 5] = logits[2, 6] = float("inf")
    logits[3] = float("-inf")  # nothing finite: the first entry
    logits[4, 1030] = 7.0  # the last column
    logits[5] = float("nan")
    with torch.inference_mode():  # the engine's logits are inference tensors
        for view in (logits, logits[:, 3:700], logits.t().contiguous().t(), logits[::2]):
            got = argmax_rows(view)
            assert got.dtype == torch.int64 and got.shape == (view.shape[0],)
            assert got.tolist() == view.max(dim=-1).indices.tolist()
    assert argmax_rows(logits)[1:6].tolist() == [40, 5, 0, 1030, 0]


def test_penalties_for_all_rows_at_once_equal_them_row_by_row():
    """Repetition (prompt and output), frequency and presence penalties, alone and together,
    with repeated tokens, an empty output and rows without penalties, in one batch."""
    gen = torch.Generator().manual_seed(5)
    vocab = 3000
    logits = torch.randn(7, vocab, generator=gen) * 4
    greedy = {"temperature": 0.0}
    params = [
        SamplingParams(repetition_penalty=1.3, **greedy),
        SamplingParams(frequency_penalty=0.7, **greedy),
        SamplingParams(presence_penalty=-1.5, **greedy),
        SamplingParams(
            repetition_penalty=0.8, frequency_penalty=1.1, presence_penalty=0.4, **greedy
        ),
        SamplingParams(frequency_penalty=2.0, **greedy),  # no output yet: nothing counted
        SamplingParams(**greedy),
        SamplingParams(repetition_penalty=1.05, presence_penalty=2.0, **greedy),
    ]
    tokens = [
        torch.randint(0, 40, (n,), generator=gen).tolist() for n in (50, 9, 30, 80, 5, 3, 400)
    ]
    outputs = [t[len(t) // 2 :] for t in tokens]
    outputs[4] = []
    want = penalize_row_by_row(logits, params, tokens, outputs)
    got = logits.clone()
    apply_penalties(got, params, tokens, outputs)
    assert torch.equal(got, want)
    assert not torch.equal(got[3], logits[3]) and torch.equal(got[5], logits[5])
    assert torch.equal(got[4], logits[4])
    # The sampler applies them to the rows that ask, and samples greedily from the result.
    seqs = [_seq(i, p) for i, p in enumerate(params)]
    for seq, t, o in zip(seqs, tokens, outputs, strict=True):
        seq.token_ids, seq.output_token_ids = list(t), list(o)
    sampled, _ = Sampler(0, torch.device("cpu"))(logits, seqs)
    assert sampled == want.argmax(dim=-1).tolist()


def test_top_k_top_p_by_widening_candidates_equals_the_full_sort():
    """Rows settled in the first width (peaked, or a small k), in the second, and only by the
    whole vocabulary (flat, a large k, p = 1 with k past the widths), mixed in one batch."""
    gen = torch.Generator().manual_seed(3)
    vocab = 20_000
    assert FILTER_WIDTHS[-1] < vocab
    scales = [8.0, 8.0, 3.0, 3.0, 0.3, 0.3, 0.05, 8.0, 0.3, 3.0, 0.3, 8.0]
    logits = torch.randn(len(scales), vocab, generator=gen) * torch.tensor(scales).unsqueeze(1)
    ks = [0, 40, 0, 0, 0, 5000, 0, 1, 0, 300, 19_999, 25_000]
    ps = [0.9, 1.0, 0.95, 0.5, 0.9, 1.0, 0.99, 0.3, 0.999, 0.9, 1.0, 0.8]
    params = [
        SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in zip(ks, ps, strict=True)
    ]
    with torch.inference_mode():
        got = filter_probs(logits, params)
        # Each row alone too: the batch's other rows change nothing.
        alone = torch.cat([filter_probs(logits[i : i + 1], params[i : i + 1]) for i in range(12)])
    want = full_sort_filter(logits, params)
    assert torch.equal(got, want)
    assert torch.equal(alone, want)
    kept = (got > 0).sum(-1).tolist()
    assert kept[1] == 40 and kept[7] == 1 and kept[10] == 19_999
    # The batch reached every width: rows kept past the first width and past the second.
    assert any(FILTER_WIDTHS[0] < n <= FILTER_WIDTHS[1] for n in kept)
    assert any(n > FILTER_WIDTHS[1] for n in kept)


def test_sampled_tokens_follow_the_filtered_distribution_and_seeds():
    vocab, rows = 50, 4000
    probs = torch.zeros(vocab)
    probs[[3, 10, 11, 49]] = torch.tensor([0.5, 0.2, 0.2, 0.1])  # the rest filtered out
    logits = probs.clamp(min=1e-30).log().expand(rows, vocab).contiguous()
    params = SamplingParams(temperature=1.0)
    sampler = Sampler(0, torch.device("cpu"))
    tokens, _ = sampler(logits, [_seq(i, params) for i in range(rows)])
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).float() / rows
    assert set(tokens) == {3, 10, 11, 49}  # never an entry of probability zero
    assert torch.allclose(counts[[3, 10, 11, 49]], probs[[3, 10, 11, 49]], atol=0.03)
    # A seeded request draws from its own generator: the same token whatever shares its batch.
    seeded = SamplingParams(temperature=1.0, seed=5)

    def alone_then_batched(n: int) -> int:
        seqs = [_seq(i, params) for i in range(n)] + [_seq(n, seeded)]
        seqs[-1].generator = torch.Generator().manual_seed(5)
        return sampler(logits[: n + 1], seqs)[0][-1]

    assert len({alone_then_batched(n) for n in (0, 1, 3, 8, 17, 30)}) == 1


def test_one_row_draw_follows_unnormalized_probabilities():
    """Speculative decoding draws its correction token from an unnormalized residual."""
    residual = torch.zeros(49152)
    residual[[0, 7, 49151]] = torch.tensor([0.06, 0.03, 0.01])  # sums to 0.1, not 1
    gen = torch.Generator().manual_seed(1)
    tokens = torch.tensor([draw(residual, gen) for _ in range(3000)])
    counts = torch.bincount(tokens, minlength=49152).float() / len(tokens)
    assert set(tokens.tolist()) == {0, 7, 49151}
    assert torch.allclose(counts[[0, 7, 49151]], torch.tensor([0.6, 0.3, 0.1]), atol=0.03)
    # The same generator state, the same token.
    a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert [draw(residual, a) for _ in range(20)] == [draw(residual, b) for _ in range(20)]


def test_a_row_without_finite_mass_still_draws_a_token_in_the_vocabulary():
    probs = torch.rand(4, 100)
    probs[1] = float("nan")
    probs[2] = 0.0
    probs[3, 7] = float("inf")
    u = torch.full((4, 1), 0.5, dtype=torch.float64)
    tokens = invert_cdf(probs, u)
    assert ((tokens >= 0) & (tokens < 100)).all()
    assert tokens[3] == 7 and tokens[0] == invert_cdf(probs[:1], u[:1])[0]
