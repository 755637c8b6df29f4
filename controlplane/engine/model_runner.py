"""Turn a scheduled step into tensors, run the forward, return logits of the sampling rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from controlplane.engine.attention.backend import AttentionBackend, SeqSpan
from controlplane.engine.compiled import CompiledDecode
from controlplane.engine.cuda_graphs import CudaGraphDecode
from controlplane.engine.kv_cache import KVCache
from controlplane.engine.model.llama import CausalLM
from controlplane.engine.prompt_logprobs import rows_needed
from controlplane.engine.scheduler import ScheduledSeq, SchedulerOutput
from controlplane.engine.sequence import Sequence
from controlplane.engine.transfer import to_device
from controlplane.engine.types import RankStats

# Rows of a step's input ids and the tokens they take from the device (asynchronous scheduling).
Fed = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class StepInputs:
    """A scheduled step as plain lists (ModelRunner.prepare), what the device needs to run it."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[SeqSpan] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # the rows whose logits the forward returns
    logits_rows: list[int] = field(default_factory=list)  # of them, the sampling rows
    samplers: list[Sequence] = field(default_factory=list)  # their sequences, in order
    # Prompt logprobs: the extra rows kept for the requests that score their prompt.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, lo, rows)
    # Rows whose input token is the previous step's sampled token at row `fed_from` there.
    fed_rows: list[int] = field(default_factory=list)
    fed_from: list[int] = field(default_factory=list)
    traced: list[tuple[str, int]] = field(default_factory=list)  # (request id, rows): trace


class StepSink(Protocol):
    """Where rank 0 of a tensor-parallel engine sends each step's inputs before running it
    (parallel/workers.py's Workers)."""

    def send(self, inputs: StepInputs, fed: torch.Tensor | None) -> None: ...

    def ran(self) -> None: ...

    def ranks(self) -> list[RankStats]: ...

    def check(self) -> None: ...

    def failure(self, exc: BaseException) -> Exception: ...

    def close(self) -> None: ...


def samples(item: ScheduledSeq) -> bool:
    """Whether a scheduled chunk reaches the end of what is known of its sequence: then its
    last row predicts a new token."""
    return item.seq.num_computed_tokens + item.num_new_tokens >= item.seq.num_tokens


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv_cache: KVCache, backend: AttentionBackend, device: torch.device
    ) -> None:
        self.model = model
        self.kv = kv_cache
        self.backend = backend
        self.device = device
        self.compiled: CompiledDecode | None = None  # set (and warmed up) by the engine
        self.graphs: CudaGraphDecode | None = None  # set (and captured) by the engine
        # Tests set this to a list to receive (request_id, positions, logits) for every row
        # of every step, prefill-chunk rows included; None in production (no extra work).
        self.trace: list[tuple[str, list[int], torch.Tensor]] | None = None
        # The last step's prompt rows (prompt logprobs): (sequence, first position, logits of
        # its rows from that position on), for the requests that asked; [] for most steps.
        self.prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = []
        # Tensor parallel (rank 0): the workers every step's inputs go to before it runs.
        self.workers: StepSink | None = None

    @staticmethod
    def sampling_sequences(step: SchedulerOutput) -> list[Sequence]:
        """The sequences of `step` that sample (or verify) this step, in logits-row order."""
        return [item.seq for item in step.scheduled if samples(item)]

    def execute(self, step: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Returns logits (float32) and the sequences they belong to: one row per sequence,
        1 + len(draft_token_ids) consecutive rows for a speculating one."""
        inputs = self.prepare(step)
        return self.run(inputs), inputs.samplers

    def prepare(self, step: SchedulerOutput, fed: dict[Sequence, int] | None = None) -> StepInputs:
        """The step's inputs as plain lists, read from the sequences now: `run` reads nothing
        else of them, so it may run while the host changes them (asynchronous scheduling).

        `fed`: sequences whose last token is still on the device (num_pending), with their
        row in the previous step's sampled tokens; their input row takes it from there."""
        inputs = StepInputs(step.swap_out, step.swap_in, step.copies)
        input_ids, positions, spans = inputs.input_ids, inputs.positions, inputs.spans
        logits_rows, samplers = inputs.logits_rows, inputs.samplers
        prompt_rows, prompt_spans = inputs.prompt_rows, inputs.prompt_spans
        for item in step.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            drafts = seq.draft_token_ids
            if n == 1 and not drafts and start < len(seq.token_ids) and not seq.prompt_logprobs:
                # One known token (the steady state of decode), in the fewest operations; what
                # follows does the same for any chunk. The row samples unless it is a prompt's
                # chunk of one token short of its end.
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                table = seq.block_table if fed is None else seq.block_table[:]
                spans.append(SeqSpan(1, start + 1, table))
                if start + 1 >= seq.num_tokens:
                    logits_rows.append(len(input_ids) - 1)
                    samplers.append(seq)
                if self.trace is not None:
                    inputs.traced.append((seq.request_id, 1))
                continue
            if seq.num_pending:  # a decode of the token sampled last step, not known here yet
                assert fed is not None and n == 1 and start == len(seq.token_ids), seq
                inputs.fed_rows.append(len(input_ids))
                inputs.fed_from.append(fed[seq])
                input_ids.append(0)
            else:
                input_ids += (seq.token_ids + drafts if drafts else seq.token_ids)[
                    start : start + n
                ]
            positions += range(start, start + n)
            # A copy of the block table where the host may change it before the step runs.
            table = seq.block_table if fed is None else seq.block_table[:]
            spans.append(SeqSpan(n, start + n, table))
            if seq.prompt_logprobs is not None:
                lo, hi = rows_needed(seq, start, n)
                if hi > lo:
                    first = len(input_ids) - n - start  # the row of position 0
                    prompt_rows += range(first + lo, first + hi)
                    prompt_spans.append((seq, lo, hi - lo))
            if samples(item):  # each draft token's row verifies the next draft too
                logits_rows += range(len(input_ids) - 1 - len(drafts), len(input_ids))
                samplers.append(seq)
            if self.trace is not None:
                inputs.traced.append((seq.request_id, n))
        if self.trace is not None:
            inputs.rows = list(range(len(input_ids)))
        else:
            inputs.rows = logits_rows + prompt_rows if prompt_rows else logits_rows
        return inputs

    @torch.inference_mode()
    def run(self, inputs: StepInputs, fed_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The step on the device: KV copies, then the forward. Returns the logits of the
        sampling rows (float32); `fed_tokens`: the previous step's sampled tokens, for the
        rows `prepare` left to them."""
        if self.workers is not None:
            self.workers.send(inputs, fed_tokens)
        # Copy-on-write first: a sequence that took a copy and was then preempted in the same
        # step (priority and fair preempt any running one) swaps out the copied block, and a
        # block it gave back may be a swap-in's target.
        if inputs.copies:
            self.kv.copy(*map(list, zip(*inputs.copies, strict=True)))
        if inputs.swap_out:
            self.kv.swap_out(*map(list, zip(*inputs.swap_out, strict=True)))
        if inputs.swap_in:
            self.kv.swap_in(*map(list, zip(*inputs.swap_in, strict=True)))
        input_ids, positions, spans, rows = (
            inputs.input_ids,
            inputs.positions,
            inputs.spans,
            inputs.rows,
        )
        fed = None
        if inputs.fed_rows:
            assert fed_tokens is not None
            dev = fed_tokens.device
            fed = (to_device(inputs.fed_rows, dev), fed_tokens[to_device(inputs.fed_from, dev)])
        prompt_rows, logits_rows = inputs.prompt_rows, inputs.logits_rows
        if not prompt_rows and self.graphs is not None and self.graphs.applies(spans):
            logits = self.graphs(input_ids, positions, spans, rows, fed)
        else:
            logits = self._forward(input_ids, positions, spans, rows, fed)
        self.prompt_logits = []
        if prompt_rows:
            extra = logits[prompt_rows] if self.trace is not None else logits[len(logits_rows) :]
            at = 0
            for seq, lo, k in inputs.prompt_spans:
                self.prompt_logits.append((seq, lo, extra[at : at + k]))
                at += k
            if self.trace is None:
                logits = logits[: len(logits_rows)]
        if self.trace is not None:
            row = 0
            for request_id, n in inputs.traced:
                self.trace.append((request_id, positions[row : row + n], logits[row : row + n]))
                row += n
            logits = logits[logits_rows]
        if self.workers is not None:
            self.workers.ran()
        return logits

    def _forward(
        self,
        input_ids: list[int],
        positions: list[int],
        spans: list[SeqSpan],
        rows: list[int],
        fed: Fed | None = None,
    ) -> torch.Tensor:
        """A step without a graph: compiled when the compiled step applies, else eager."""
        meta = self.backend.prepare(spans, self.device)
        dev = self.device
        ids_t = to_device(input_ids, dev)
        if fed is not None:
            ids_t[fed[0]] = fed[1]
        pos_t = to_device(positions, dev)
        rows_t = to_device(rows, dev)
        if self.compiled is not None and self.compiled.applies(meta, len(input_ids)):
            return self.compiled(ids_t, pos_t, rows_t, self.backend, meta)
        return self.model(ids_t, pos_t, self.backend, meta, rows_t)
