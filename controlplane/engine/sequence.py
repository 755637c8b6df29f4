"""A request as the engine tracks it: tokens, progress, blocks, timings."""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.types import OutputText, RequestMetrics, TokenLogprobs

if TYPE_CHECKING:
    import torch

    from controlplane.engine.detokenizer import IncrementalDetokenizer


def new_block_table(blocks: Iterable[int] = ()) -> array:
    """A block table: the KV cache blocks of a sequence, in order, as int64 in an `array`, so
    that a step's padded table of every row is a memory copy a row rather than a conversion a
    block id (docs/benchmarks.md#host-overhead). Mutate it in place or replace it with another
    from here; a list works everywhere too, only slower."""
    return array("q", blocks)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    PENDING = "pending"  # choice i > 0 of parallel sampling, before choice 0 forks it
    FINISHED = "finished"


def chain_hashes(
    token_ids: list[int], block_size: int, hashes: list[bytes], root: bytes = b""
) -> None:
    """Extend `hashes` to one per full block of `token_ids`. A block's hash covers its parent's
    hash and its own token ids (and `root`: anything else that changes K/V, such as an
    adapter), so equal hashes mean equal prefixes. 128-bit BLAKE2b: a crafted prompt cannot
    collide with another tenant's prefix and read its cache."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(token_ids) // block_size):
        block = array("i", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)


def salt_root(salt: str) -> bytes:
    """The hash chain's root for a cache salt: a salted request's blocks never match those of
    another salt (or of no salt), so its cache hits reveal nothing about other tenants."""
    data = b"cache-salt\x00" + salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None  # set when params.seed is given
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    output_token_ids: list[int] = field(default_factory=list)
    # One rule drives prefill, chunking and decode: each step closes part of the gap between
    # num_computed_tokens (K/V in cache) and len(token_ids).
    num_computed_tokens: int = 0
    # Asynchronous scheduling (engine/overlap.py): tokens sampled on the device whose values
    # the host learns a step later. They count in num_tokens (the scheduler plans with them)
    # but are not in token_ids yet; at most one while a step is scheduled.
    num_pending: int = 0
    block_table: array = field(default_factory=new_block_table)
    swap_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    output_text: OutputText = field(default_factory=OutputText)
    num_emitted_chars: int = 0  # text already handed to the caller
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    # Prefix cache: hashes of the full blocks of token_ids (extended as tokens come), and how
    # many leading blocks of block_table are registered in (or were found in) the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Parallel sampling: the request's choices, this one at `index` (a list shared by all of
    # them; [self] when n == 1). Choice 0 runs the prompt and forks the others at its first
    # sample; until then they wait as PENDING, outside the scheduler's queues.
    index: int = 0
    group: list[Sequence] = field(default_factory=list)
    forked: bool = False
    cumulative_logprob: float = 0.0
    # Speculative decoding: this step's proposed tokens (scheduled after the last token as
    # extra rows) and the draft model's distributions for them (None for n-gram proposals).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    # The draft model's own KV (speculative_method = draft): its blocks and how many of
    # token_ids it holds.
    draft_block_table: array = field(default_factory=new_block_table)
    draft_num_computed: int = 0
    # Structured outputs: this choice's grammar state (an llguidance matcher, advanced by
    # every token appended), None when unconstrained or once the sequence has ended.
    matcher: Any = None
    # Prefix cache partition: the root of the block hash chain (see chain_hashes), from
    # params.cache_salt; b"" (the shared partition) when the request has none.
    hash_root: bytes = b""
    # SamplingParams.prompt_logprobs: [None] then one entry per prompt position scored so far
    # (see prompt_logprobs.py); None when not requested. Forked choices share choice 0's list.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        if self.params.cache_salt is not None and not self.hash_root:
            self.hash_root = salt_root(self.params.cache_salt)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.group:
            self.group = [self]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def awaits_fork(self) -> bool:
        """Choice 0 of a parallel-sampling request whose other choices still wait for it (only
        choice 0 forks; the flag means nothing on the others)."""
        return self.index == 0 and not self.forked and len(self.group) > 1

    @property
    def num_slots(self) -> int:
        """Batch slots this sequence takes once running: all n choices for an unforked choice 0."""
        return len(self.group) if self.awaits_fork else 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
