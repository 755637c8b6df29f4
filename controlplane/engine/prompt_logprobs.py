"""Prompt logprobs (scoring): for each prompt position p >= 1, the logprob of prompt token p
given the tokens before it, and the top-N alternatives, for the requests that ask
(`SamplingParams.prompt_logprobs`); position 0 has none (None).

The runner keeps every prompt row's logits only for such requests (other rows and requests
are unchanged: plain traffic pays nothing). `Sequence.prompt_logprobs` grows in position order
as the prompt's chunks are computed, and doubles as the progress counter: the next row to score
is position len(list) - 1 (row q predicts token q + 1).

- Chunked prefill: each chunk scores its own rows, in order.
- Recompute preemption: a recomputed sequence's rows below the next position were scored
  already and are not kept again (no duplicates); none are skipped (see the cache rule).
- The prefix cache: a cached block has no logits, so a scoring request takes cached blocks only
  below the next position it must score (`cache_limit`): the first pass of a scoring request
  computes its whole prompt (no cached tokens, so none billed at the cached price), a
  recompute after scoring finished may use the cache as any request. Its blocks are registered
  as anyone's, so later requests (scoring or not past the scored part) still hit them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from controlplane.engine.transfer import to_device
from controlplane.engine.types import TokenLogprobs

if TYPE_CHECKING:
    from controlplane.engine.sequence import Sequence


def wants(seq: Sequence) -> bool:
    """Whether seq still has prompt positions to score."""
    lps = seq.prompt_logprobs
    return lps is not None and len(lps) < len(seq.prompt_token_ids)


def rows_needed(seq: Sequence, start: int, n: int) -> tuple[int, int]:
    """Positions [lo, hi) of the chunk [start, start + n) whose logits score a prompt token not
    scored yet (lo == hi: none)."""
    if not wants(seq):
        return start, start
    assert seq.prompt_logprobs is not None
    nxt = len(seq.prompt_logprobs) - 1
    hi = min(start + n, len(seq.prompt_token_ids) - 1)
    if start > nxt and hi > start:  # cache_limit prevents it: a position would be lost
        raise RuntimeError(
            f"request {seq.request_id}: prompt logprobs at position {nxt} would be skipped "
            f"(chunk starts at {start})"
        )
    lo = max(start, nxt)
    return lo, max(lo, hi)


def cache_limit(seq: Sequence) -> int | None:
    """Most leading tokens seq may take from the prefix cache (None: no limit): only those
    whose logits it no longer needs."""
    if not wants(seq):
        return None
    assert seq.prompt_logprobs is not None
    return len(seq.prompt_logprobs) - 1


def score(seq: Sequence, lo: int, logits: torch.Tensor) -> None:
    """Append the logprobs of prompt tokens lo + 1 .. lo + len(logits), from the logits of
    rows lo .. lo + len(logits) - 1."""
    assert seq.prompt_logprobs is not None and len(seq.prompt_logprobs) - 1 == lo
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = seq.prompt_token_ids[lo + 1 : lo + 1 + len(logits)]
    t = to_device(targets, lp.device).unsqueeze(1)
    chosen = lp.gather(1, t)
    ranks = ((lp > chosen).sum(1) + 1).tolist()
    values = chosen.squeeze(1).tolist()
    top_n = seq.params.prompt_logprobs or 0
    tops: list[list[tuple[int, float]]] = [[] for _ in targets]
    if top_n:
        vals, ids = lp.topk(top_n, dim=-1)
        tops = [
            list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)
        ]
    for tok, v, top, rank in zip(targets, values, tops, ranks, strict=True):
        seq.prompt_logprobs.append(TokenLogprobs(tok, v, top, rank))
