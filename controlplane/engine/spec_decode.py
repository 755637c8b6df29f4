"""Speculative decoding: proposing draft tokens and verifying them exactly.

A speculating sequence is scheduled with its last token plus k draft tokens as extra rows of
the ragged batch; the target's logits for those k + 1 rows verify the drafts in one forward.
Greedy: the longest prefix of drafts that the target would have chosen, plus the target's
next token. Sampling: the rejection rule of Leviathan et al. / Chen et al.: draft d with
draft probability q(d) is accepted with probability min(1, p(d) / q(d)); on rejection a token
is drawn from normalize(max(0, p - q)) and verification stops; when every draft is accepted a
bonus token is drawn from the last row. The emitted tokens are then distributed exactly as
the target's own samples. The n-gram proposer is deterministic: q is a point mass, so d is
accepted with probability p(d) and a rejection draws from p without d.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import torch

from controlplane.engine.sampler import apply_penalties, argmax_rows, draw, filter_probs
from controlplane.engine.sequence import Sequence
from controlplane.engine.types import TokenLogprobs

if TYPE_CHECKING:
    from controlplane.engine.draft import DraftModel
    from controlplane.engine.sampler import Sampler
    from controlplane.engine.settings import EngineSettings


def ngram_propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (longest n
    first) and propose the k tokens that followed it."""
    if len(token_ids) < n_min + 1:
        return []
    data = array("i", token_ids).tobytes()
    for n in range(min(n_max, len(token_ids) - 1), n_min - 1, -1):
        pattern = data[-4 * n :]
        end = len(data) - 4  # a match must end before the last token (not be the suffix)
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:  # aligned on a token, not a byte pattern straddling two
                start = at // 4 + n
                return token_ids[start : start + k]
            end = at + 4 * n - 1
    return []


def propose(
    running: list[Sequence],
    s: EngineSettings,
    max_model_len: int,
    draft: DraftModel | None,
    sampler: Sampler,
) -> tuple[str, list[Sequence]]:
    """Draft tokens (into `seq.draft_token_ids`) for the running decodes, when speculation is
    on and the batch is small enough for it to pay. Returns the speculation state (off |
    paused | active) and the sequences the draft model proposed for."""
    if s.speculative_method == "off":
        return "off", []
    if len(running) > s.speculative_max_batch_size:
        return "paused", []
    seqs, ks = [], []
    for seq in running:
        if seq.num_uncomputed != 1 or not seq.output_token_ids:
            continue  # not decoding
        k = min(
            s.speculative_num_tokens,
            seq.params.max_tokens - len(seq.output_token_ids) - 1,
            max_model_len - seq.num_tokens - 1,
        )
        if k <= 0:
            continue
        if s.speculative_method == "ngram":
            seq.draft_token_ids = ngram_propose(
                seq.token_ids, k, s.speculative_ngram_min, s.speculative_ngram_max
            )
        else:
            seqs.append(seq)
            ks.append(k)
    drafted: list[Sequence] = []
    if seqs and draft is not None:
        draft.propose(seqs, ks, sampler.generator)
        drafted = seqs
    for seq in running:
        if seq.matcher is not None and seq.draft_token_ids:
            # Drafts the grammar refuses are dropped before verification: the target could
            # never accept them (their masked probability is 0).
            keep = seq.matcher.validate_tokens(seq.draft_token_ids)
            del seq.draft_token_ids[keep:]
    return "active", drafted


def _row_distribution(
    row: torch.Tensor, seq: Sequence, prefix: list[int]
) -> tuple[torch.Tensor | None, int]:
    """The target's next-token choice at one verification row, as the sampler would make it
    with `prefix` (the drafts accepted so far) already appended: (probabilities, None-greedy
    argmax). Returns (probs, argmax); probs is None for greedy requests."""
    p = seq.params
    if p.needs_penalties:
        rows = row.unsqueeze(0).clone(memory_format=torch.contiguous_format)
        apply_penalties(rows, [p], [seq.token_ids + prefix], [seq.output_token_ids + prefix])
        row = rows[0]
    if p.greedy:
        return None, int(argmax_rows(row.unsqueeze(0))[0])
    probs = filter_probs(row.unsqueeze(0), [p])[0]
    return probs, -1


def verify(
    rows: torch.Tensor,
    seq: Sequence,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """rows: the target's logits [k + 1, vocab] for the last token and the k drafts.
    draft_probs: [k, vocab], the draft model's distributions (None: the n-gram proposer's
    point masses). Returns the tokens to emit (the accepted drafts, then one token from the
    target) and their logprobs (when the request wants them)."""
    p = seq.params
    want_lp = p.logprobs is not None or p.n > 1
    raw_lp = torch.log_softmax(rows, dim=-1) if want_lp else None
    gen = seq.generator or generator
    out: list[int] = []
    for i in range(len(drafts) + 1):
        probs, best = _row_distribution(rows[i], seq, out)
        if i == len(drafts):  # every draft accepted: the bonus token
            token = best if probs is None else draw(probs, gen)
            out.append(token)
            break
        d = drafts[i]
        if probs is None:
            out.append(best)
            if best != d:
                break
            continue
        q = draft_probs[i] if draft_probs is not None else None
        q_d = 1.0 if q is None else float(q[d])
        u = float(torch.rand((), generator=gen))
        if q_d > 0 and u * q_d < float(probs[d]):  # u < min(1, p/q), without dividing
            out.append(d)
            continue
        if q is None:
            residual = probs.clone()
            residual[d] = 0.0
        else:
            residual = (probs - q).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: nothing left to correct; p itself
            residual = probs
        out.append(draw(residual, gen))
        break
    lps: list[TokenLogprobs | None] = [None] * len(out)
    if raw_lp is not None:
        for i, token in enumerate(out):
            top: list[tuple[int, float]] = []
            if p.logprobs:
                vals, ids = raw_lp[i].topk(p.logprobs)
                top = list(zip(ids.tolist(), vals.tolist(), strict=True))
            lps[i] = TokenLogprobs(token, float(raw_lp[i, token]), top)
    return out, lps
