"""Turn a scheduled step into tensors, run the forward, return logits of the sampling rows."""

from __future__ import annotations

import torch

from controlplane.engine.attention.backend import AttentionBackend, SeqSpan
from controlplane.engine.compiled import CompiledDecode
from controlplane.engine.cuda_graphs import CudaGraphDecode
from controlplane.engine.kv_cache import KVCache
from controlplane.engine.model.llama import CausalLM
from controlplane.engine.prompt_logprobs import rows_needed
from controlplane.engine.scheduler import ScheduledSeq, SchedulerOutput
from controlplane.engine.sequence import Sequence


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

    @staticmethod
    def sampling_sequences(step: SchedulerOutput) -> list[Sequence]:
        """The sequences of `step` that sample (or verify) this step, in logits-row order."""
        return [item.seq for item in step.scheduled if samples(item)]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Returns logits (float32) and the sequences they belong to: one row per sequence,
        1 + len(draft_token_ids) consecutive rows for a speculating one."""
        if step.swap_out:
            self.kv.swap_out(*map(list, zip(*step.swap_out, strict=True)))
        if step.swap_in:
            self.kv.swap_in(*map(list, zip(*step.swap_in, strict=True)))
        if step.copies:
            self.kv.copy(*map(list, zip(*step.copies, strict=True)))
        input_ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        logits_rows: list[int] = []
        samplers: list[Sequence] = []
        # Prompt logprobs: the extra rows kept for the requests that score their prompt.
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Sequence, int, int]] = []  # (seq, first position, rows)
        for item in step.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            drafts = seq.draft_token_ids
            input_ids += (seq.token_ids + drafts if drafts else seq.token_ids)[start : start + n]
            positions += range(start, start + n)
            spans.append(SeqSpan(n, start + n, seq.block_table))
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
            rows = list(range(len(input_ids)))
        else:
            rows = logits_rows + prompt_rows if prompt_rows else logits_rows
        if not prompt_rows and self.graphs is not None and self.graphs.applies(spans):
            logits = self.graphs(input_ids, positions, spans, rows)
        else:
            logits = self._forward(input_ids, positions, spans, rows)
        self.prompt_logits = []
        if prompt_rows:
            extra = logits[prompt_rows] if self.trace is not None else logits[len(logits_rows) :]
            at = 0
            for seq, lo, k in prompt_spans:
                self.prompt_logits.append((seq, lo, extra[at : at + k]))
                at += k
            if self.trace is None:
                logits = logits[: len(logits_rows)]
        if self.trace is not None:
            row = 0
            for item in step.scheduled:
                n = item.num_new_tokens
                self.trace.append(
                    (item.seq.request_id, positions[row : row + n], logits[row : row + n])
                )
                row += n
            logits = logits[logits_rows]
        return logits, samplers

    def _forward(
        self, input_ids: list[int], positions: list[int], spans: list[SeqSpan], rows: list[int]
    ) -> torch.Tensor:
        """A step without a graph: compiled when the compiled step applies, else eager."""
        meta = self.backend.prepare(spans, self.device)
        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        if self.compiled is not None and self.compiled.applies(meta, len(input_ids)):
            return self.compiled(ids_t, pos_t, rows_t, self.backend, meta)
        return self.model(ids_t, pos_t, self.backend, meta, rows_t)
