"""A recorded window as a workload to drive again: arrival times, prompt lengths, the
shared-prefix structure, output lengths and `n`, from the rows alone.

Prompt text is not stored, so prompts are token ids of the recorded lengths, drawn from a seeded
generator. What that changes, and how the replay accounts for it:
- Prefix sharing: a row's `cached_prompt_tokens` says how much of its prompt was served from the
  prefix cache. The replayed prompt starts with that many tokens of the most recent earlier
  replayed prompt long enough to hold them (the donor), then draws the rest: the cache sees the
  same shared lengths as it did, so hits reproduce as far as the cache still holds the donor
  (the same eviction question the original run answered). A prefix whose donor arrived before
  the window has none in it: `unmatched_prefix_tokens` counts those tokens (served as misses).
- Output lengths: each of the n choices generates completion_tokens / n tokens with EOS
  ignored, so every request produces what it produced.
- Speculation: drafts from n-gram lookup depend on the text; random ids rarely repeat, so the
  acceptance rate is not the recorded one (the summary puts both side by side).
- Structured outputs: grammars are not stored; constrained requests replay as free text of the
  same length, without the mask cost (the summary gives their share).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from controlplane.planning.window import PlanningError, Recorded, Window


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    offset_s: float  # after the window's first arrival, before time scaling
    prompt: list[int]
    max_tokens: int  # each choice's (EOS ignored)
    n: int
    recorded: Recorded


@dataclass(slots=True)
class Workload:
    requests: list[ReplayRequest]
    unmatched_prefix_tokens: int  # recorded cached tokens no earlier replayed prompt holds
    structured: int  # requests that were constrained (replayed as free text)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def completion_tokens(self) -> int:
        return sum(r.max_tokens * r.n for r in self.requests)


def build_workload(window: Window, vocab_size: int, max_model_len: int, seed: int = 0) -> Workload:
    """The window's requests as prompts of token ids in [3, vocab_size) (below 3: the usual
    special ids). PlanningError naming the first request that the model cannot hold."""
    if vocab_size <= 3:
        raise PlanningError(f"a vocabulary of {vocab_size} tokens cannot carry a replay")
    rng = random.Random(seed)
    start = window.rows[0].arrival
    requests: list[ReplayRequest] = []
    donors: list[list[int]] = []  # recent prompts, newest last (for prefixes)
    unmatched = structured = 0
    for row in window.rows:
        per_choice = max(1, round(row.completion_tokens / max(1, row.n)))
        if row.prompt_tokens + per_choice > max_model_len:
            raise PlanningError(
                f"request {row.id} ({row.prompt_tokens} prompt + {per_choice} completion "
                f"tokens) does not fit the model's max_model_len ({max_model_len}): replay "
                "against the model it was served with"
            )
        cached = min(row.cached_prompt_tokens, row.prompt_tokens)
        prefix: list[int] = []
        if cached:
            donor = next((d for d in reversed(donors) if len(d) >= cached), None)
            if donor is None:
                unmatched += cached
            else:
                prefix = donor[:cached]
        prompt = prefix + [
            rng.randrange(3, vocab_size) for _ in range(row.prompt_tokens - len(prefix))
        ]
        donors.append(prompt)
        if len(donors) > _DONORS:
            del donors[0]
        structured += row.structured is not None
        requests.append(ReplayRequest(row.arrival - start, prompt, per_choice, row.n, row))
    return Workload(requests, unmatched, structured)


# How many recent prompts a prefix may come from: a cached prefix outlives only as many
# prompts as the KV cache holds, so older donors would mostly be evicted anyway.
_DONORS = 4096
