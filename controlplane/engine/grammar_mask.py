"""Per-step token masks of constrained sequences, computed while the forward pass runs.

`MaskBatch.start` (before the forward) hands the step's constrained rows to a worker thread,
where llguidance's batched executor (which drops the GIL) writes their allowed-token bitmasks;
`finish` waits for it after the forward, and `apply` sets the disallowed logits to -inf
before sampling, so every sampler feature (temperature, top-p, seeds, speculative
verification) sees the constrained distribution. A speculating sequence gets 1 + k masks:
the grammar state after each prefix of its drafts.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from controlplane.engine.structured import grammar_failed
from controlplane.engine.transfer import to_device

if TYPE_CHECKING:
    from controlplane.engine.sequence import Sequence


@dataclass(slots=True)
class MaskJob:
    """One step's constrained rows: (sequence, first logits row); a speculating sequence's
    mask covers its 1 + k rows (the state after each accepted draft prefix)."""

    rows: list[tuple[Sequence, int]]
    num_rows: int
    future: Future | None = None
    bitmask: torch.Tensor | None = None
    compute_s: float = 0.0
    # id(seq) -> why it fails: GrammarFailedError (its grammar gave up), else the worker's.
    errors: dict[int, Exception] = field(default_factory=dict)


class MaskBatch:
    """Computes bitmasks off the step thread: `start` before the forward, `finish` after it."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._executor: Any = None
        self._shifts = torch.arange(32, dtype=torch.int32)

    def start(self, rows: list[tuple[Sequence, int]], num_rows: int) -> MaskJob:
        job = MaskJob(rows, num_rows)
        if rows:
            job.future = self._pool.submit(self._compute, job)
        return job

    def _compute(self, job: MaskJob) -> None:
        import llguidance

        if self._executor is None:
            # Half the cores: the masks are computed while the forward pass runs, and its
            # kernels use the CPU too (on 2 cores, 2 mask threads cost 4.1 ms a step at
            # batch 16 against 2.6 ms with one).
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
            self._executor = llguidance.LLExecutor(num_threads=threads)
        t0 = time.perf_counter()
        # All ones: rows of unconstrained sequences stay unmasked (and are never applied).
        mask = torch.full((job.num_rows, self.words), -1, dtype=torch.int32)
        plain = [(s.matcher, at) for s, at in job.rows if not s.draft_token_ids]
        drafted = [
            (s.matcher, at, list(s.draft_token_ids)) for s, at in job.rows if s.draft_token_ids
        ]
        nbytes = self.words * 4
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, mask.data_ptr(), nbytes, job.num_rows)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, mask.data_ptr(), nbytes, job.num_rows
            )
        for seq, _ in job.rows:
            if seq.matcher.is_error():
                job.errors[id(seq)] = grammar_failed(
                    seq.params.structured, seq.matcher, len(seq.output_token_ids)
                )
        job.bitmask = mask
        job.compute_s = time.perf_counter() - t0

    def finish(self, job: MaskJob) -> float:
        """Wait for the masks; returns the seconds the step thread waited. Should the worker
        have raised, every row of the job gets the error (those requests fail, not the
        engine)."""
        if job.future is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            job.future.result()
        except Exception as exc:
            for seq, _ in job.rows:
                job.errors.setdefault(id(seq), RuntimeError(f"grammar mask failed: {exc!r}"))
        return time.perf_counter() - t0

    def allowed(self, bitmask: torch.Tensor) -> torch.Tensor:
        """[R, words] int32 bitmask -> [R, vocab] bool (bit j of word w: token 32w + j)."""
        bits = (bitmask.unsqueeze(-1) >> self._shifts) & 1
        return bits.view(bitmask.shape[0], -1)[:, : self.vocab_size].bool()

    @torch.inference_mode()  # the runner's logits are inference tensors
    def apply(self, logits: torch.Tensor, job: MaskJob, rows: list[int]) -> None:
        """Mask `rows` of `logits` in place with the job's masks (mask row = logits row)."""
        if not rows:
            return
        assert job.bitmask is not None
        allowed = to_device(self.allowed(job.bitmask[rows]), logits.device, torch.bool)
        width = logits.shape[1]
        if width > self.vocab_size:  # padded embedding rows are never tokens
            pad = allowed.new_zeros((len(rows), width - self.vocab_size))
            allowed = torch.cat([allowed, pad], dim=1)
        index = to_device(rows, logits.device)
        logits[index] = logits[index].masked_fill(~allowed[:, :width], float("-inf"))
