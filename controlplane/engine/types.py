"""The engine's output and statistics records, torch-free.

The engine produces these; the HTTP app, the admin API (stats, Prometheus metrics), the jobs
and the tests read them. Importing this module (or `controlplane.engine`, whose __init__ is
lazy) does not import torch, so the layers above the engine use the real types rather than
protocols that copy their fields. tests/test_architecture.py checks that it stays so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "MemoryUse",
    "OutputText",
    "RequestMetrics",
    "RequestOutput",
    "StepStats",
    "TokenLogprobs",
]


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first
    rank: int | None = None  # the token's rank in the distribution, 1 = best (prompt logprobs)


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.time()) and counts for one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: proposed, and of those accepted
    num_accepted_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return (
            None
            if self.first_scheduled_time is None
            else self.first_scheduled_time - self.arrival_time
        )

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def mean_itl(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(slots=True)
class StepStats:
    """A snapshot published after every step, never changed once published (a new one
    replaces it), so readers never lock the engine. Not `frozen`: a frozen dataclass sets each
    of these fields through object.__setattr__, a few microseconds of every step's host time
    (docs/benchmarks.md#host-overhead)."""

    step: int
    time: float
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_sampled_tokens: int  # new tokens produced (decodes plus prefills that completed)
    step_duration: float  # seconds inside step(), forward included
    num_preemptions: int  # cumulative
    num_finished: int  # cumulative
    num_context_tokens: int = 0  # the scheduled rows' contexts after the step (SchedulerOutput)
    # Cumulative since start: a sampler differences two snapshots, exactly, whatever happened
    # in between (no need to see every step).
    busy_s_total: float = 0.0  # time inside step()
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    running_total: int = 0  # sum over steps of num_running (mean batch fill = delta / steps)
    batched_tokens_total: int = 0  # sum over steps of prefill + decode tokens
    # Prefix cache (vLLM's counters): prompt tokens looked up at admission and of those, found
    # cached (so not computed); cached blocks evicted to make room. Cumulative.
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prefix_cache_evictions_total: int = 0
    # Gauges: blocks whose contents are registered in the prefix cache (held or not), and of
    # those, the ones nobody holds (evictable: allocation reuses them after the free ones).
    # kv_blocks_used counts held blocks only; total - used can be allocated.
    kv_blocks_cached: int = 0
    kv_blocks_evictable: int = 0
    # Speculative decoding (vLLM's counters), cumulative: sequences that had drafts verified,
    # tokens proposed, tokens accepted, and accepted tokens by position in the draft.
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()
    speculation: str = "off"  # off | active | paused (more running than the max batch size)
    # Structured outputs: live grammar states (a gauge: one per constrained choice still
    # running); grammars compiled and cache hits; seconds of mask work (computing, in the
    # worker, and applying) and of the step waiting for the worker after its forward; steps
    # with constrained rows. Cumulative but the gauge.
    grammar_states: int = 0
    grammar_compiles_total: int = 0
    grammar_cache_hits_total: int = 0
    grammar_mask_s_total: float = 0.0
    grammar_mask_wait_s_total: float = 0.0
    grammar_mask_steps_total: int = 0
    # Asynchronous scheduling: steps launched before the previous step's tokens were known
    # (cumulative; the rest ran synchronously: engine/overlap.py says when and why).
    async_steps_total: int = 0
    # Arrival (time.time()) of the oldest request waiting or swapped out at the step's end;
    # None when none waits (GET /admin/stats's oldest_waiting_s).
    oldest_waiting_arrival: float | None = None

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class OutputText:
    """A sequence's output text as it grows, a token's piece at a time, kept as its pieces:
    `text += piece` copied the whole text every token, quadratic in the output's length
    (docs/benchmarks.md#host-overhead).
    The pieces list is only ever appended to; `cut` and the compaction give the sequence a new
    list, so a `prefix` taken earlier still reads what it read then."""

    __slots__ = ("length", "parts")
    COMPACT_AT = 64  # pieces joined into one past this many (memory: an object a piece)

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0

    def __str__(self) -> str:
        return "".join(self.parts)

    def append(self, piece: str) -> None:
        if len(self.parts) >= self.COMPACT_AT:
            self.parts = ["".join(self.parts)]  # a new list: earlier prefixes keep theirs
        self.parts.append(piece)
        self.length += len(piece)

    def tail(self, start: int) -> str:
        """The text from `start` on (read from the last pieces: `start` is near the end)."""
        parts, i, at = self.parts, len(self.parts), self.length
        while i and at > start:
            i -= 1
            at -= len(parts[i])
        text = parts[i] if i == len(parts) - 1 else "".join(parts[i:])
        return text[start - at :] if start > at else text

    def cut(self, end: int) -> None:
        """Keep the text before `end`."""
        self.parts = [str(self)[:end]]
        self.length = end

    def prefix(self, end: int) -> tuple[list[str], int, int]:
        """What RequestOutput.text joins when read: the text up to `end`, as it is now."""
        return (self.parts, len(self.parts), end)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far (the live list: do not mutate)
    new_token_ids: list[int]  # produced by this step
    # All output text released so far: read it as `text`. A string, or OutputText.prefix's
    # (pieces, count, end) joined on the first read (most outputs are streamed as
    # delta_text, and their whole text never read).
    text_so_far: str | tuple[list[str], int, int] = field(repr=False)
    delta_text: (
        str  # released by this step (never a broken UTF-8 char, never part of a stop string)
    )
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs | None]  # for new_token_ids, when requested
    time: float = 0.0  # when this output was produced (time.time()): per-token latencies
    error: str | None = None  # why, when finish_reason is "error" (the engine kept serving)
    # The request field at fault when the failure is the request's own (its output could not
    # follow its grammar): the server answers 400 naming it rather than 500.
    error_param: str | None = None
    # Parallel sampling (SamplingParams.n > 1): outputs of one request come per choice; `index`
    # says which, `finished` means that choice is done (the request is done when all n are).
    # `metrics` is the request's, shared by its choices (output tokens summed over them).
    index: int = 0
    cumulative_logprob: float | None = None  # sum of the choice's token logprobs (n > 1 only)
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), complete
    # once the prompt is computed (every output from the first token on; the live list).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def text(self) -> str:
        text = self.text_so_far
        if not isinstance(text, str):
            parts, count, end = text
            text = self.text_so_far = "".join(parts[:count])[:end]
        return text


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """What the model takes, for the start-up log and /admin/stats: what quantization bought."""

    weights_bytes: int  # as loaded: packed / quantized layouts, tied tensors once
    kv_cache_bytes: int  # the device KV cache (swap space excluded)
    kv_cache_blocks: int
    quantization: str
    dtype: str  # of activations and the float weights
    kv_cache_dtype: str  # the KV cache's storage: dtype, or int8 / float8_e4m3fn (with scales)

    def describe(self) -> str:
        quant = "" if self.quantization == "none" else f", {self.quantization} linears"
        return (
            f"weights {self.weights_bytes / 2**20:.1f} MiB ({self.dtype}{quant}), KV cache "
            f"{self.kv_cache_bytes / 2**20:.1f} MiB ({self.kv_cache_blocks} blocks, "
            f"{self.kv_cache_dtype})"
        )


@dataclass(frozen=True, slots=True)
class RankStats:
    """One rank of a tensor-parallel engine, for /admin/stats, /metrics and the TUI: its memory
    and its recent steps. Times are wall times on the rank's host thread: on a CPU the whole
    forward and the time inside the collectives; on CUDA, where kernels and collectives run
    asynchronously, the host's share only."""

    rank: int
    weights_bytes: int
    kv_cache_bytes: int
    steps: int
    step_s: float  # its forward, averaged over recent steps (exponentially, RankBoard.ALPHA)
    all_reduce_s: float  # of which inside the collectives (all-reduces, the logits' gather)

    @property
    def all_reduce_share(self) -> float:
        return self.all_reduce_s / self.step_s if self.step_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "rank": self.rank,
            "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "steps": self.steps,
            "step_ms": round(self.step_s * 1000, 3),
            "all_reduce_ms": round(self.all_reduce_s * 1000, 3),
            "all_reduce_share": round(self.all_reduce_share, 4),
        }
