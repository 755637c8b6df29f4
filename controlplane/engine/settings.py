"""Engine settings: one typed model, one validator, shared by every caller.

`Engine.update_settings`, the admin API, the TUI and config reload all go through
`validate_changes`, so a value is judged by the same rule wherever it comes from.

Each field declares what it accepts (a `Range` or its choices) and carries its help, which the
configuration reference renders: what the setting does, what it trades and when to turn it off,
with a link to its docs/benchmarks.md section. Figures and machine names stay on that page
(tests/test_help_strings.py); why a default was chosen is a `#` comment beside the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from controlplane.engine.errors import InvalidSettingError
from controlplane.limits import CHOICES, RANGE, Range, check_declared


class RestartRequiredError(InvalidSettingError):
    """A restart-only field was changed on a running engine."""


PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
ASYNC_SCHEDULING = ("auto", "on", "off")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
SPECULATIVE_METHODS = ("off", "ngram", "draft")
PREFIX_CACHE_ISOLATIONS = ("key", "none")
COMPILE_MODES = ("auto", "on", "off")
CUDA_GRAPH_MODES = ("auto", "off")
# The most rows compile_max_rows and cuda_graph_max_rows accept (here because settings stay
# torch-free): 512, the largest batch vLLM captures by default.
MAX_DECODE_ROWS = 512
# What compile_max_rows = 0 covers at least, whatever max_num_seqs was at start: the batches a
# live max_num_seqs is usually raised to (the compiled step's ceiling before it followed
# max_num_seqs).
MIN_COMPILED_ROWS = 32
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
TENSOR_PARALLEL_COMMS = ("auto", "shm", "gloo")
MAX_SPECULATIVE_TOKENS = 16
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's packed int4 kernels accept


def _live(doc: str, default: Any, limit: Range | None = None, choices: tuple = ()) -> Any:
    return _field(doc, default, limit, choices, live=True)


def _restart(doc: str, default: Any, limit: Range | None = None, choices: tuple = ()) -> Any:
    return _field(doc, default, limit, choices, live=False)


def _field(doc: str, default: Any, limit: Range | None, choices: tuple, *, live: bool) -> Any:
    """A setting: its help text, whether it is live, and what it accepts (a `Range` or its
    choices), declared here once: `check` loops over the declarations, GET /admin/config and
    the configuration reference show them."""
    meta = {"live": live, "doc": doc}
    if limit is not None:
        return field(default=default, metadata={**meta, RANGE: limit})
    if choices:
        return field(default=default, metadata={**meta, CHOICES: choices})
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class EngineSettings:
    # Restart-only: they shape memory or the model itself.
    model: str = _restart(
        "The model to serve: a Hugging Face-format directory (safetensors), a .gguf file or a "
        "catalog alias (smollm2). Empty: SmolLM2 where its package is installed, else a "
        "random-weight demo model.",
        "",
    )
    dtype: str = _restart(
        "Float type of the weights and the KV cache: auto (bfloat16 where the CPU has native "
        "bf16 and the checkpoint is 16-bit, float32 on other CPUs; the checkpoint's own on a "
        "GPU), float32, bfloat16 or float16. 16 bits halve the memory read per token, so "
        "decode is faster, at a rounding cost; float32 where outputs must match a float32 "
        "reference.",
        "auto",
        choices=DTYPES,
    )
    device: str = _restart(
        "Where the model runs: auto (cuda when a GPU is visible, else cpu), cpu or cuda.",
        "auto",
        choices=DEVICES,
    )
    block_size: int = _restart(
        "Tokens per KV cache block, the unit of allocation and of prefix caching (only full "
        "blocks are shared): smaller blocks waste less memory at a sequence's end and share "
        "shorter prefixes; larger ones mean fewer blocks to look up per step.",
        16,
        Range(1, 1024),
    )
    kv_cache_dtype: str = _restart(
        "How the KV cache stores keys and values: auto (the model's dtype), float32, bfloat16, "
        "float16, or 8 bits: int8 or fp8_e4m3, with a float32 scale per token and KV head. 8 "
        "bits hold about twice the tokens of a 16-bit cache in the same memory (more sequences "
        "at once, longer contexts) at a small quality cost, and fp8 decodes slowly on CPUs "
        "without native fp8. Keep auto where KV memory is not the limit. Figures: "
        "docs/benchmarks.md#kv-cache-dtype.",
        "auto",
        choices=KV_CACHE_DTYPES,
    )
    attention_backend: str = _restart(
        "Paged attention kernels: auto (triton on CUDA; on CPU, cpu where its kernels build, "
        "torch otherwise), torch (runs anywhere), cpu (our C++ decode kernel, built at first "
        "start for this CPU: faster decode, needs a C++ compiler and ninja), triton (needs the "
        "triton package; on CPU it runs under Triton's interpreter, for tests and debugging "
        "only: very slow). torch where the kernels cannot be built or to rule them out. "
        "Figures: docs/benchmarks.md#attention-backends.",
        "auto",
        choices=ATTENTION_BACKENDS,
    )
    kv_cache_memory_bytes: int = _restart(
        "KV cache budget on a CPU, in bytes: more holds more sequences and longer contexts "
        "before requests wait or are preempted, and leaves less memory to everything else.",
        1 << 30,
        Range(1, 1 << 50),
    )
    gpu_memory_utilization: float = _restart(
        "KV cache budget on a GPU: the fraction of free GPU memory it takes at start.",
        0.8,
        Range(0, 1, lo_open=True),
    )
    num_kv_blocks: int | None = _restart(
        "Exact number of KV blocks, overriding both budgets (tests, reproducible runs).",
        None,
        Range(1, 1 << 40),
    )
    # Restart-only: the ranks are processes started with the engine, each holding its shard.
    tensor_parallel_size: int = _restart(
        "Split the model over this many ranks (processes; one device each on CUDA), each "
        "holding its share of every layer's heads and MLP rows and its own KV cache (of "
        "kv_cache_memory_bytes on a CPU). Must divide the model's attention heads and MLP "
        "size. The decode step runs eagerly. See docs/engine.md#tensor-parallelism.",
        1,
        Range(1, 64),
    )
    tensor_parallel_timeout_s: float = _restart(
        "How long a tensor-parallel step may wait for a rank before the engine stops, naming "
        "the rank (a hung worker); also how long rank 0 waits for the workers to join at start.",
        120.0,
        Range(1.0, 3600.0),
    )
    # auto: shared memory where it runs (a CPU of x86: it relies on x86's store ordering);
    # gloo stays for other CPUs and to rule the shared memory out.
    tensor_parallel_comm: str = _restart(
        "How tensor-parallel ranks on a CPU exchange the layers' sums, the logits and each "
        "step's inputs: shm (a shared-memory segment between the processes; x86 only), gloo "
        "(torch.distributed over loopback sockets, much slower per step), or auto (shm on an "
        "x86 CPU, gloo on other CPUs). CUDA ranks use NCCL whatever it says. gloo to rule the "
        "shared memory out. See docs/engine.md#tensor-parallelism.",
        "auto",
        choices=TENSOR_PARALLEL_COMMS,
    )
    swap_space_bytes: int = _restart(
        "Host memory for KV blocks swapped out under preemption_mode = swap, in bytes.",
        1 << 28,
        Range(0, 1 << 50),
    )
    max_model_len: int | None = _restart(
        "Longest prompt + output of one request; default: the model's context length. Lower "
        "it to refuse requests the KV budget could not hold.",
        None,
        Range(1, 1 << 24),
    )
    seed: int = _restart(
        "Seed of the engine's shared sampling generator (a request with its own seed samples from its own generator).",
        0,
        Range(0, 2**63 - 1),
    )
    cpu_weight_packing: bool = _restart(
        "On a CPU, pack the linear weights into oneDNN's blocked layout at load: faster "
        "matmuls for a longer load. Off: plain torch linears, to rule the packing out.",
        True,
    )
    # On: the copy costs seconds at load and pays on every decode step
    # (docs/benchmarks.md#huge-pages).
    huge_pages: bool = _restart(
        "On a CPU, copy the weights a decode step streams into one region at load, in the order "
        "a step reads them, on 2 MB pages where Linux grants them (transparent huge pages in "
        "madvise or always mode): the hardware prefetcher stops at each page's end, so one "
        "user's decode runs faster, for a copy at load. Off: the weights stay where the loader "
        "put them, on 4 KB pages. Figures: docs/benchmarks.md#huge-pages.",
        True,
    )
    quantization: str = _restart(
        "Weight-only quantization of the linear layers at load: auto (what a GGUF file stores "
        "quantized stays so: 4-bit linears as int4, 5- to 8-bit ones and a quantized embedding "
        "or lm_head as int8; float checkpoints: none), none, int8 (per output channel), int4 "
        "(group-wise) or fp8 (e4m3 per output channel: fast on GPUs with FP8 tensor cores, "
        "elsewhere only smaller); norms stay float. Fewer bits: less memory and a faster "
        "decode, at some quality. Figures: docs/benchmarks.md#quantized-weights.",
        "auto",
        choices=QUANTIZATIONS,
    )
    quantization_group_size: int = _restart(
        "int4: how many input features share one scale and zero point. Smaller groups follow "
        "the weights more closely (quality) and store more scales.",
        32,
        choices=INT4_GROUP_SIZES,
    )
    quantize_lm_head: bool = _restart(
        "With quantization on, quantize lm_head too, to int8 (a tied one becomes an int8 copy: "
        "the embedding table stays float): a faster decode for some quality. Under auto, a "
        "GGUF file's quantized lm_head is int8 whatever this says. Figures: "
        "docs/benchmarks.md#quantized-weights.",
        False,
    )
    # Off: the dense copy costs 2 bytes a weight and makes a prompt's logits depend on how it
    # was split into steps (docs/benchmarks.md#int4-dense-copy).
    int4_dense_copy: bool = _restart(
        "On a CPU with native bf16, int4 linears also keep a bf16 copy of their weights packed "
        "for oneDNN, for steps of 16 rows or more (prompt chunks, batched decode): faster "
        "prompts, for 2 bytes a weight, and a prompt's logits then depend on how its steps were "
        "split (a prefix-cache hit or a chunk boundary can flip a greedy near-tie). Needs "
        "cpu_weight_packing. Figures: docs/benchmarks.md#int4-dense-copy.",
        False,
    )
    # On: faster on every CPU with the instructions that was measured, and batch invariant
    # (docs/benchmarks.md#bf16-dot).
    bf16_dot: bool = _restart(
        "On a CPU with AVX512-BF16, the quantized linears and the CPU decode attention multiply "
        "bf16 values with VDPBF16PS, and bf16 models' linears take our kernel where the CPU has "
        "no matrix tiles: faster prompts and decode, the same results at every batch size, but "
        "not float32's bits. Off: float32 sums (torch's int4 kernel, oneDNN), to compare "
        "against a float32 reference. Figures: docs/benchmarks.md#bf16-dot.",
        True,
    )
    # On: prompts and batches gain more than a single user's decode loses
    # (docs/benchmarks.md#amx).
    amx: bool = _restart(
        "With bf16_dot, on a CPU with matrix tiles (TDPBF16PS), the int4 linears multiply in "
        "the tiles at every row count: much faster prompts and batched decode, a slightly "
        "slower single user. The tiles round their sums their own way, so logits differ from "
        "off's in the last bits (batch invariant either way). Off: VDPBF16PS only, for the "
        "lowest one-user latency. Figures: docs/benchmarks.md#amx.",
        True,
    )
    # Off: the quality cost, and the float path is as fast or faster on the CPUs measured since
    # the AVX2 int4 tile (docs/benchmarks.md#quantize-activations).
    quantize_activations: bool = _restart(
        "On an x86 CPU (AVX2 or AVX512), the quantized linears (int4 ones and the int8 "
        "lm_head) round their activations to int8 per 32 values and multiply in integers, as "
        "llama.cpp does: can speed decode on CPUs without native "
        "bf16, slows prompts, and costs quality (higher perplexity; greedy replies leave "
        "float32's sooner). Figures: docs/benchmarks.md#quantize-activations.",
        False,
    )
    # auto: in the daemon the warm-up runs in the background, so the first requests are served
    # (eagerly) at once and the compiled step takes over when ready
    # (docs/benchmarks.md#compiled-decode-step).
    compile: str = _restart(
        "Compile the decode step with torch.compile: auto (on CUDA at start; on a CPU, in the "
        "daemon, in the background while steps run eagerly, taking over once warm; a one-off "
        "LLM() stays eager), on (at start, before serving) or off. A compiled step decodes "
        "faster; a cold compile takes minutes of CPU. Off: to debug, or to spare the warm-up. "
        "Figures: docs/benchmarks.md#compiled-decode-step.",
        "auto",
        choices=COMPILE_MODES,
    )
    # auto: the C++ wrapper's longer build is paid in the background, never before serving
    # (docs/benchmarks.md#compiled-decode-step).
    compile_cpp_wrapper: str = _restart(
        "On a CPU, the compiled step calls its kernels from C++ (inductor's cpp_wrapper) "
        "instead of from Python: a faster step, for a longer first warm-up while inductor's "
        "cache is cold. auto: on where the step compiles in the background (the daemon on a "
        "CPU), off under compile = on, whose warm-up delays serving. Ignored on CUDA, where "
        "CUDA graphs remove that cost. Figures: docs/benchmarks.md#compiled-decode-step.",
        "auto",
        choices=COMPILE_MODES,
    )
    cuda_graphs: str = _restart(
        "CUDA graphs for decode steps: auto (captured once at start on CUDA when "
        "attention_backend is triton and the decode step is compiled; off otherwise) or off. "
        "Replaying a graph saves every kernel's launch cost in every step, for a capture at "
        "start and the graphs' GPU memory. Off: to debug. Figures: docs/benchmarks.md#gpu.",
        "auto",
        choices=CUDA_GRAPH_MODES,
    )
    # 0: follow max_num_seqs. A fixed 32 ran an 8B model's 64-row decode steps eagerly, at
    # half the 32-row step's tokens per second (docs/benchmarks.md#gpu-seeds).
    compile_max_rows: int = _restart(
        "Largest decode step that runs compiled (and, on CUDA, the graphs' ceiling unless "
        "cuda_graph_max_rows is lower): 0 (default) for max_num_seqs at start, at least 32. "
        "Larger decode steps, after max_num_seqs is raised live past it, run eagerly (slower); "
        "raise it to where the autopilot or an operator may take max_num_seqs. Higher: a "
        "longer warm-up.",
        0,
        Range(0, MAX_DECODE_ROWS),
    )
    cuda_graph_max_rows: int = _restart(
        "Largest decode batch captured as a CUDA graph: 0 (default) for the compiled step's "
        "ceiling (compile_max_rows). Batch sizes 1, 2, 4, 8, 16, 24, 32, then every 16 to 128, "
        "every 32 to 256 and every 64 to 512, below it, and it, are captured at start (a step "
        "pads to the next one); larger decode steps run compiled without a graph. Higher: more "
        "capture time and graph memory at start.",
        0,
        Range(0, MAX_DECODE_ROWS),
    )
    speculative_draft_model: str = _restart(
        "Draft model for speculative_method = draft: a path like `model` (safetensors "
        "directory, .gguf file or alias) sharing the target's tokenizer. Empty: none loaded.",
        "",
    )
    speculative_draft_quantization: str = _restart(
        "The draft model's weight-only quantization (auto, none, int8, int4, fp8), as "
        "`quantization`.",
        "auto",
        choices=QUANTIZATIONS,
    )
    # Live: applied at the next step boundary.
    max_num_seqs: int = _live(
        "Most sequences decoded together in one step: more raises throughput and KV use, and "
        "lengthens each step, so each stream's inter-token latency. The autopilot moves it "
        "within its bounds.",
        32,
        Range(1, 4096),
    )
    # 2048: a burst of 16 prompts is prefilled in 2 steps rather than 4, so fewer streams see a
    # stalled step: a lower ITL p99 at 16 streams for a later first token
    # (docs/benchmarks.md#token-budget).
    max_num_batched_tokens: int = _live(
        "Token budget of one step (prefill + decode): larger prefills more prompts per step "
        "(throughput, fewer stalled steps under a burst), smaller keeps each step short "
        "(latency). At least max_num_seqs. Figures: docs/benchmarks.md#token-budget.",
        2048,
        Range(1, 1 << 20),
    )
    # 128: a step carrying a 512-token chunk stalls every decoding stream for its length; 128
    # halves the ITL p99 at 16 streams for a few percent of throughput
    # (docs/benchmarks.md#token-budget).
    prefill_chunk_size: int = _live(
        "Most prompt tokens one request may prefill in one step: smaller chunks stall the "
        "decoding streams less (ITL p99), larger ones reach the first token sooner. Figures: "
        "docs/benchmarks.md#token-budget.",
        128,
        Range(1, 1 << 20),
    )
    preemption_mode: str = _live(
        "What to do when KV blocks run out: recompute (drop a sequence's blocks and compute "
        "them again later: costs compute) or swap (copy them to host memory, "
        "swap_space_bytes: costs memory and copy time).",
        "recompute",
        choices=PREEMPTION_MODES,
    )
    scheduling_policy: str = _live(
        "Which waiting or prefilling request gets the step's tokens and slots first, and which "
        "running one is preempted first. fcfs: arrival order. priority: the key's priority "
        "class, then the request's `priority` (lower first), then arrival; a waiting request "
        "may preempt a running one of a lower priority. fair: classes first, then equal shares "
        "of step tokens and batch slots between the API keys of a class: a flooding key cannot "
        "starve a light one. See docs/tenants.md#fair-scheduling.",
        "fcfs",
        choices=SCHEDULING_POLICIES,
    )
    # auto: a CPU forward returns only when it is done, so there is nothing to hide the host's
    # work behind unless a thread runs it (on), which competes with the forward for cores.
    async_scheduling: str = _live(
        "Schedule step N+1 and process step N's tokens (stop checks, text) while the device "
        "runs, so the host's work per step hides behind the device's. Same outputs; a token "
        "reaches the caller one step later and a finishing sequence computes one extra row. "
        "Structured outputs, speculation, penalties and prompt logprobs run synchronously. "
        "auto: on with CUDA, off on a CPU; on: a CPU forward runs on a thread of its own. "
        "Figures: docs/benchmarks.md#host-overhead.",
        "auto",
        choices=ASYNC_SCHEDULING,
    )
    speculative_method: str = _live(
        "Speculative decoding: off; ngram (prompt lookup: propose what followed the last n "
        "tokens earlier in the prompt or output); draft (a small model proposes, needs "
        "speculative_draft_model). Outputs keep the target's distribution exactly. Faster "
        "decode for a few users whose outputs repeat their prompt (ngram) or that the draft "
        "predicts; wasted compute where proposals are rejected. Figures: "
        "docs/benchmarks.md#speculative-decoding.",
        "off",
        choices=SPECULATIVE_METHODS,
    )
    speculative_num_tokens: int = _live(
        "Tokens proposed per sequence and step (k): more gains more when proposals are "
        "accepted and wastes more when they are not.",
        3,
        Range(1, MAX_SPECULATIVE_TOKENS),
    )
    speculative_max_batch_size: int = _live(
        "Above this many running sequences speculation pauses: a compute-bound batch gains "
        "nothing from it.",
        8,
        Range(1, 4096),
    )
    speculative_ngram_min: int = _live("ngram: shortest suffix matched.", 2, Range(1, 64))
    speculative_ngram_max: int = _live(
        "ngram: longest suffix matched (tried first).", 4, Range(1, 64)
    )
    grammar_cache_size: int = _live(
        "Structured outputs: compiled grammars kept (LRU, by schema text); a request whose "
        "schema is cached skips the compile. Figures: docs/benchmarks.md#structured-outputs.",
        256,
        Range(0, 100_000),
    )
    enable_prefix_caching: bool = _live(
        "Reuse the KV blocks of prompt prefixes computed before (full blocks, matched by a "
        "chained hash of their tokens): shared system prompts and multi-turn chats skip most "
        "of their prefill; the bookkeeping costs nothing measurable. Off: no matching and no "
        "new entries (to measure cold prompts); nothing in use is freed. Figures: "
        "docs/benchmarks.md#prefix-caching.",
        True,
    )
    prefix_cache_isolation: str = _live(
        "Who shares cached prefixes when API keys are configured: key (each API key has its "
        "own partition: a tenant's cache hits say nothing about other tenants' prompts) or "
        "none (every key shares one cache: more hits, but cached_tokens and TTFT tell a "
        "caller whether another sent the same prefix). An open API (no keys) always shares; "
        "a request's cache_salt separates it further either way. Applies to new requests. "
        "Figures: docs/benchmarks.md#prefix-caching.",
        "key",
        choices=PREFIX_CACHE_ISOLATIONS,
    )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def live_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["live"])

    def live_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.live_fields()}


def check(settings: EngineSettings) -> EngineSettings:
    """Validate every field and the relations between them; return the settings unchanged.

    Each field's range or choices (and a bool's type) is checked from its declaration, in field
    order; below are only the rules a declaration cannot say."""
    s = settings
    check_declared(s)
    if not isinstance(s.speculative_draft_model, str):
        raise InvalidSettingError(
            "speculative_draft_model", f"must be a path string, got {s.speculative_draft_model!r}"
        )
    if s.speculative_method == "draft" and not s.speculative_draft_model:
        raise InvalidSettingError(
            "speculative_method",
            "draft needs speculative_draft_model, which is restart-only: set both and restart",
        )
    if s.speculative_ngram_max < s.speculative_ngram_min:
        raise InvalidSettingError(
            "speculative_ngram_max",
            f"must be >= speculative_ngram_min ({s.speculative_ngram_min}), "
            f"got {s.speculative_ngram_max}",
        )
    if s.max_num_batched_tokens < s.max_num_seqs:
        # Every running sequence must be able to decode one token per step.
        raise InvalidSettingError(
            "max_num_batched_tokens",
            f"must be >= max_num_seqs ({s.max_num_seqs}), got {s.max_num_batched_tokens}",
        )
    if s.compile_max_rows and s.cuda_graph_max_rows > s.compile_max_rows:
        # A graph replays the compiled step: it cannot cover rows the step does not.
        raise InvalidSettingError(
            "cuda_graph_max_rows",
            f"must be <= compile_max_rows ({s.compile_max_rows}), got {s.cuda_graph_max_rows}",
        )
    return s


def decode_row_ceilings(s: EngineSettings) -> tuple[int, int]:
    """(the compiled decode step's rows, the CUDA graphs' rows) as compile_max_rows and
    cuda_graph_max_rows resolve at start: 0 follows max_num_seqs (at least MIN_COMPILED_ROWS,
    at most MAX_DECODE_ROWS) and, for the graphs, the compiled step's ceiling."""
    compiled = s.compile_max_rows or min(
        MAX_DECODE_ROWS, max(MIN_COMPILED_ROWS, s.max_num_seqs, s.cuda_graph_max_rows)
    )
    return compiled, s.cuda_graph_max_rows or compiled


def validate_changes(
    current: EngineSettings, changes: dict[str, Any], *, live_only: bool = True
) -> EngineSettings:
    """Return `current` with `changes` applied, or raise naming the first bad field.

    All or nothing: the caller gets either a fully valid new settings object or an error,
    never a half-applied one.
    """
    names = EngineSettings.field_names()
    live = EngineSettings.live_fields()
    for key in changes:
        if key not in names:
            raise InvalidSettingError(key, f"unknown setting; known settings: {', '.join(names)}")
        if live_only and key not in live and changes[key] != getattr(current, key):
            raise RestartRequiredError(key, "cannot change on a running engine; restart needed")
    return check(dataclasses.replace(current, **changes))
