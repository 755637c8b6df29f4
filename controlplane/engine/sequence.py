"""A request as the engine tracks it: tokens, progress, blocks, timings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.types import RequestMetrics

if TYPE_CHECKING:
    import torch

    from controlplane.engine.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


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
    block_table: list[int] = field(default_factory=list)
    swap_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    output_text: str = ""
    num_emitted_chars: int = 0  # text already handed to the caller
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
