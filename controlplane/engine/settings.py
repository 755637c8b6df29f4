"""Engine settings: one typed model, one validator, shared by every caller.

`Engine.update_settings`, the admin API, the TUI and config reload all go through
`validate_changes`, so a value is judged by the same rule wherever it comes from.
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
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
SPECULATIVE_METHODS = ("off", "ngram", "draft")
PREFIX_CACHE_ISOLATIONS = ("key", "none")
COMPILE_MODES = ("auto", "on", "off")
CUDA_GRAPH_MODES = ("auto", "off")
# The compiled decode step's largest batch (compiled.MAX_ROWS; here because settings stay
# torch-free and cuda_graph_max_rows is checked against it).
MAX_DECODE_ROWS = 32
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
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
    model: str = _restart("Path of a Hugging Face-format model directory.", "")
    dtype: str = _restart(
        "Weights and KV dtype: auto (bfloat16 where the CPU has native bf16 and the checkpoint is "
        "16-bit, float32 on other CPUs; the checkpoint's on GPU), float32, bfloat16, float16.",
        "auto",
        choices=DTYPES,
    )
    device: str = _restart("auto (cuda if available), cpu or cuda.", "auto", choices=DEVICES)
    block_size: int = _restart("Tokens per KV block.", 16, Range(1, 1024))
    kv_cache_dtype: str = _restart(
        "KV cache storage: auto (the model's dtype), float32, bfloat16, float16, or 8 bits: "
        "int8 or fp8_e4m3, with a float32 scale per token and KV head (2x the blocks of a "
        "16-bit cache in the same memory, less the scales; perplexity within 1%).",
        "auto",
        choices=KV_CACHE_DTYPES,
    )
    attention_backend: str = _restart(
        "Paged attention kernels: auto (triton on CUDA; on CPU, cpu where its kernels build, "
        "torch otherwise), torch (runs anywhere), cpu (our C++ decode kernel, built at first "
        "start for this CPU: needs a C++ compiler and ninja), triton (needs the triton "
        "package; on CPU it runs under Triton's interpreter, for tests and debugging only: "
        "very slow).",
        "auto",
        choices=ATTENTION_BACKENDS,
    )
    kv_cache_memory_bytes: int = _restart(
        "KV cache budget on CPU, in bytes.", 1 << 30, Range(1, 1 << 50)
    )
    gpu_memory_utilization: float = _restart(
        "KV cache budget on GPU: fraction of free memory.", 0.8, Range(0, 1, lo_open=True)
    )
    num_kv_blocks: int | None = _restart(
        "Exact number of KV blocks (overrides the budgets).", None, Range(1, 1 << 40)
    )
    swap_space_bytes: int = _restart(
        "Host memory for swapped-out KV blocks, in bytes.", 1 << 28, Range(0, 1 << 50)
    )
    max_model_len: int | None = _restart(
        "Longest prompt + output; default: the model's.", None, Range(1, 1 << 24)
    )
    seed: int = _restart("Seed of the engine's shared sampling generator.", 0, Range(0, 2**63 - 1))
    cpu_weight_packing: bool = _restart(
        "On CPU, pre-pack linear weights for oneDNN (faster).", True
    )
    huge_pages: bool = _restart(
        "On CPU, the weights a decode step streams (quantized ones, and bf16 ones packed for "
        "our kernel) are copied at load into one region, in the order a step reads them, on "
        "2 MB pages where Linux grants them (transparent huge pages in madvise or always "
        "mode): the hardware prefetcher stops at each page's end. SmolLM2's one-user decode "
        "1.06-1.10x on a 2-core Zen 4. Off: where the loader left them, on 4 KB pages.",
        True,
    )
    quantization: str = _restart(
        "Weight-only quantization of the linear layers, done at load: auto (what a GGUF file "
        "stores quantized stays quantized: 4-bit linears as int4, 5- to 8-bit ones as int8, "
        "a quantized embedding table and lm_head as int8, one table when tied; float "
        "checkpoints: none), none, int8 (per output channel) or int4 (group-wise). Norms stay "
        "float, and embeddings unless auto keeps the file's.",
        "auto",
        choices=QUANTIZATIONS,
    )
    quantization_group_size: int = _restart(
        "int4: input features sharing one scale and zero point (32, 64, 128 or 256).",
        32,
        choices=INT4_GROUP_SIZES,
    )
    quantize_lm_head: bool = _restart(
        "With quantization on, quantize lm_head too, to int8 (a tied one becomes an int8 copy: "
        "the embedding table stays float). Faster decode, some quality. Under auto, a GGUF "
        "file's quantized lm_head is int8 whatever this says.",
        False,
    )
    int4_dense_copy: bool = _restart(
        "On a CPU with native bf16, int4 linears also keep their dequantized weights in bf16, "
        "packed for oneDNN, for steps of 16 rows or more (prompt chunks, batched decode), "
        "instead of our int4 kernel (~1.7x prompt processing on SmolLM2). Costs 2 bytes a "
        "weight (SmolLM2: +200 MiB), and a prompt's logits then depend "
        "on how many rows its step carries (a prefix-cache hit or a chunk boundary can change a "
        "greedy answer at a near-tie), hence off by default. Needs cpu_weight_packing.",
        False,
    )
    bf16_dot: bool = _restart(
        "On a CPU with AVX512-BF16 (Zen 4, Sapphire Rapids), the quantized linears multiply "
        "their int4 / int8 values, exact in bf16, by bf16 activations with VDPBF16PS "
        "(csrc/int4_linear_bf16.cpp, csrc/int8_linear.cpp): on a 2-core Zen 4 SmolLM2's prompts "
        "1.50x, one user 1.33x, 16 sequences 1.19x; the same results at every row count "
        "(batch invariant). The CPU decode attention takes its scores and the weighted sum of V "
        "from VDPBF16PS too, the probabilities rounded to bf16 (16 rows of 200 tokens 1.6x). "
        "Off: torch's int4 kernel's float32 results bit for bit, the int8 lm_head in float32 "
        "FMAs, attention in float32 sums. Where the CPU has no AMX tiles, a bf16 model's "
        "linears take our VDPBF16PS kernel too (csrc/bf16_linear.cpp): a 1.1B Llama's one-user "
        "decode 1.38-1.80x oneDNN's on a 2-core Zen 4; off, oneDNN's.",
        True,
    )
    amx: bool = _restart(
        "With bf16_dot, on a CPU with AMX tiles (Sapphire Rapids and later Xeons), the int4 "
        "linears multiply in the tiles (TDPBF16PS) at every row count: on a 2-core Emerald "
        "Rapids Xeon, SmolLM2, one run against `false`: 512-token prompts 846.6 vs 414.2 tok/s, "
        "16 sequences 419.7 vs 266.8, one user 72.6 vs 82.3 (off suits a single user's "
        "latency there). The tiles round their sums their own way, so a model's logits differ "
        "from `false`'s in the last bits (batch invariant either way). Off: VDPBF16PS only.",
        True,
    )
    quantize_activations: bool = _restart(
        "On an x86 CPU (AVX2 or AVX512), the quantized linears (int4 ones and the int8 "
        "lm_head) round their activations to int8 per 32 values and multiply in integers, as "
        "llama.cpp does (csrc/int8_activations.cpp): SmolLM2 batch-1 decode 1.23x, 16 sequences "
        "1.29x, prompts 0.91x on an AVX2 EPYC (no gain on a Xeon with native bf16: batch-1 0.99x, "
        "prompts 0.63x), at some quality (perplexity +0.15%; greedy "
        "replies agree with float32's for 31% of their tokens instead of 54%), hence off by "
        "default.",
        False,
    )
    compile: str = _restart(
        "Compile the decode step's forward with torch.compile (attention stays an opaque op): "
        "auto (on CUDA, compiled at start; on a CPU, in the daemon, compiled in the "
        "background while steps run eagerly, taking over once warm: SmolLM2 batch-1 decode "
        "1.35-1.6x faster; a one-off LLM() stays eager), on (compiled at start, before "
        "serving: 11-160 s on 2 cores) or off. "
        "Later steps never compile.",
        "auto",
        choices=COMPILE_MODES,
    )
    compile_cpp_wrapper: str = _restart(
        "On a CPU, the compiled decode step's graph calls its kernels and ops from C++ "
        "(inductor's cpp_wrapper) instead of from Python: one user's step 1.08x faster on a "
        "2-core Xeon, 1.12-1.14x on a 2-core Zen 5 (SmolLM2 one user 1.39-1.45x llama.cpp "
        "there, 1.22-1.29x without), but its first warm-up also builds the wrapper (100-198 s "
        "cold against 53-162 s; 12-30 s either way once inductor's cache is warm). auto (the "
        "C++ wrapper where the step compiles in the background, the daemon's default on a "
        "CPU, which serves eagerly meanwhile; not under compile = on, whose warm-up delays "
        "serving), on, or off. Ignored on CUDA, where CUDA graphs take that cost away.",
        "auto",
        choices=COMPILE_MODES,
    )
    cuda_graphs: str = _restart(
        "CUDA graphs for decode steps: auto (captured once at start on CUDA when "
        "attention_backend is triton and the decode step is compiled; off otherwise) or off. "
        "Replaying a graph saves the per-kernel launch cost of every step.",
        "auto",
        choices=CUDA_GRAPH_MODES,
    )
    cuda_graph_max_rows: int = _restart(
        f"Largest decode batch captured as a CUDA graph (1 to {MAX_DECODE_ROWS}): batch sizes "
        "1, 2, 4, 8, 16, 24, 32 below it, and it, are captured at start (a step pads to the "
        "next one); larger decode steps, e.g. after max_num_seqs is raised, run compiled "
        "without a graph.",
        MAX_DECODE_ROWS,
        Range(1, MAX_DECODE_ROWS),
    )
    speculative_draft_model: str = _restart(
        "Draft model for speculative_method = draft: a path like `model` (safetensors "
        "directory, .gguf file or alias) sharing the target's tokenizer. Empty: none loaded.",
        "",
    )
    speculative_draft_quantization: str = _restart(
        "The draft model's weight-only quantization (auto, none, int8, int4), as `quantization`.",
        "auto",
        choices=QUANTIZATIONS,
    )
    # Live: applied at the next step boundary.
    max_num_seqs: int = _live("Most sequences in one batch.", 32, Range(1, 4096))
    # 2048: at 16 streaming clients (SmolLM2 on 2 Xeon cores, benchmarks/server_compare.py, two
    # runs each) 1024 gave 1.41-1.46x llama-server's throughput with ITL p99 404-442 ms, 2048
    # gave 1.51-1.53x with 138-140 ms: a burst of 16 prompts is prefilled in 2 steps, not 4, so
    # fewer streams see a stalled step. TTFT p50 rose from 2.6 to 3.5 s (llama-server: 5.7 s).
    max_num_batched_tokens: int = _live(
        "Token budget of one step (prefill + decode).", 2048, Range(1, 1 << 20)
    )
    # 128: at 16 streaming clients (SmolLM2, 2 cores) a step carrying a 512-token chunk made the
    # ITL p99 489-503 ms; 128-token chunks made it 240-242 ms for ~3% of throughput
    # (benchmarks/server_compare.py, docs/benchmarks.md).
    prefill_chunk_size: int = _live(
        "Most prompt tokens one request may prefill in one step: smaller chunks stall the "
        "decoding streams less (ITL p99), larger ones reach the first token sooner.",
        128,
        Range(1, 1 << 20),
    )
    preemption_mode: str = _live(
        "What to do when KV blocks run out: recompute or swap.",
        "recompute",
        choices=PREEMPTION_MODES,
    )
    speculative_method: str = _live(
        "Speculative decoding: off; ngram (prompt lookup: propose what followed the last n "
        "tokens earlier in the prompt or output); draft (a small model proposes, needs "
        "speculative_draft_model). Outputs keep the target's distribution exactly.",
        "off",
        choices=SPECULATIVE_METHODS,
    )
    speculative_num_tokens: int = _live(
        "Tokens proposed per sequence and step (k).", 3, Range(1, MAX_SPECULATIVE_TOKENS)
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
        "schema is cached skips the compile.",
        256,
        Range(0, 100_000),
    )
    enable_prefix_caching: bool = _live(
        "Reuse the KV blocks of prompt prefixes computed before (full blocks, matched by a "
        "chained hash of their tokens). Off: no matching and no new entries; nothing in use "
        "is freed.",
        True,
    )
    prefix_cache_isolation: str = _live(
        "Who shares cached prefixes when API keys are configured: key (each API key has its "
        "own partition: a tenant's cache hits say nothing about other tenants' prompts) or "
        "none (every key shares one cache: more hits, but cached_tokens and TTFT tell a "
        "caller whether another sent the same prefix). An open API (no keys) always shares; "
        "a request's cache_salt separates it further either way. Applies to new requests.",
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
    return s


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
