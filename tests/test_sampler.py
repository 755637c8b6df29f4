"""The sampler on logits built by hand: greedy tokens are the first of equal maxima, as
torch.argmax gives them (the sampler reads max(...).indices, which is faster on a CPU)."""

from __future__ import annotations

import torch

from controlplane.engine import SamplingParams
from controlplane.engine.sampler import Sampler
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
