"""The decode step's forward, compiled with `torch.compile`.

The model's forward is traced with attention as one opaque op, the backend's `graph_op`
(`attention.paged_attention`, or the CPU kernel's own C++ op, which finds the step's metadata
without Python: the graph is split around it, as vLLM does), so the compiler
fuses what lies between: norms, rotary, residual adds, SiLU x up, the dtype glue around the
quantized matmuls, while the paged KV cache, its Python metadata and the matmul kernels stay
as they are. Only decode-only steps (every row one sequence's next token: the steady state of
serving) of up to `max_rows` rows take it; prefill chunks and speculative verification run
eagerly, as before.

Shapes: the row count is a dynamic dimension, so one graph serves 2..max_rows rows and one
(torch specializes size 1) serves a single user; int4 linears branch at 16 rows to their dense
copy (Int4Linear.dense_min_rows) or, without one, at 16 or 32 rows to our int4 kernel
(Int4Linear.many_rows, measured per machine; 64 where ours never wins: no branch), which splits
the dynamic graph in two (2..15 and 16..max_rows, say; Int4Linear.one_row only picks the
kernel of the size-1 graph); with `quantize_activations`, or `bf16_dot` on a CPU with
AVX512-BF16, they take one kernel at every row count (no branch without the dense copy).
Warm-up compiles them all (and runs every row count once), and after it a recompile is an
error that sends the step down the eager path, so a step that would need another graph (a
shape or dtype never seen) never compiles in the hot path. It runs at start (`compile = on`,
and `auto` on CUDA) or, with `auto` on a CPU in the daemon, in a thread of its own while the
step thread serves eagerly: the compiled step takes over once every graph is warm (`ready`).
That thread runs its forwards with its own attention backend (the step state is per thread:
attention.attention_step) and writes its dummy K/V into a block the engine holds for it.
Live knobs (`max_num_seqs`, the token budget) change the row count only, never the graph;
rows beyond `max_rows` (engine.compile_max_rows: max_num_seqs at start, at least 32) run
eagerly. Int8Linear's dequantized branch (from dequant_min_rows, 64 rows) is one more split of
the dynamic graph where `max_rows` reaches it, as int4's are.

On a GPU, `cuda_graphs.CudaGraphDecode` captures this step as CUDA graphs for padded batch
sizes; torch.compile's graph is device-neutral, so what compiles on CPU compiles on CUDA.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from types import FunctionType, MethodType

import torch

from controlplane.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    SeqSpan,
    attention_step,
)
from controlplane.engine.model.llama import CausalLM, set_graph_attention
from controlplane.engine.sequence import new_block_table
from controlplane.engine.settings import MIN_COMPILED_ROWS

log = logging.getLogger(__name__)

# The GIL's switch interval while the decode step compiles in the background (below).
WARM_UP_SWITCH_INTERVAL_S = 1e-4


def prime_fx_tracer() -> None:
    """Run, now, the one symbolic trace inductor makes while lowering (a cached trace of an
    identity function, its loop bodies' interpreter). torch.fx's tracer patches
    torch.nn.Module.__call__ for the whole process while it traces, so an eager step on
    another thread at that moment fails (`NameError: module is not installed as a
    submodule`): seen as 4 failed requests a few seconds into a background compile under
    load. Traced before the warm-up thread starts, it is cached and never traced again."""
    try:
        from torch._inductor.loop_body import InterpreterShim

        InterpreterShim._dummy_gm()
    except (ImportError, AttributeError):  # another torch: nothing known to prime
        pass


class CompiledDecode:
    def __init__(
        self,
        model: CausalLM,
        attention_op: object = None,
        max_rows: int = MIN_COMPILED_ROWS,
        cpp_wrapper: bool = False,
    ) -> None:
        """`attention_op`: the engine's backend's graph_op (default: the Python custom op).
        `cpp_wrapper`: the graph's calls made from C++ (engine.compile_cpp_wrapper)."""
        self.model = model
        if attention_op is not None:
            set_graph_attention(model, attention_op)
        self.max_rows = max_rows
        self.warmup_s = 0.0
        self.steps = 0  # steps that ran compiled
        self.warm_rows: tuple[int, ...] = ()  # the row counts the warm-up ran
        self.state = "cold"  # cold | warming | ready | failed (warm-up raised: eager for good)
        self._eager_rows: set[int] = set()  # row counts the warmed-up graphs did not cover
        self._warm_up_thread: threading.Thread | None = None
        self._stop_warm_up = threading.Event()
        # emulate_precision_casts: inductor rounds fused intermediates to bf16 where eager
        # does, so outputs are the eager path's token for token. Without it SmolLM2's greedy
        # output differed from the third token on, for 77 instead of 71 tok/s at batch 1.
        # size_asserts off: the graph's inputs are fresh contiguous index tensors and fixed
        # weights, and checking ~640 sizes and strides took 0.43 ms of a 12 ms step.
        options = {
            "emulate_precision_casts": True,
            "size_asserts": False,
            "guard_filter_fn": _input_guards_only,
        }
        # The Python wrapper's buffer bookkeeping and ~150 op calls cost ~0.7 ms of SmolLM2's
        # 10 ms one-row step (2-core Xeon, interleaved rounds); the C++ one takes longer to
        # build. Not on CUDA: the CUDA graphs replay the step without either wrapper.
        self.cpp_wrapper = cpp_wrapper
        if cpp_wrapper:
            options["cpp_wrapper"] = True
        # Names this step's graphs in inductor's cache: once warm, the marker says so to a
        # one-off engine (LLM), which compiles only then (cache_warm).
        self.key = warm_key(model, attention_op, cpp_wrapper, max_rows)
        forward = _own_code(self._forward)
        self._code = forward.__code__
        self._fn = torch.compile(forward, dynamic=True, fullgraph=True, options=options)

    @property
    def num_graphs(self) -> int:
        """Graphs compiled for this engine's decode step (1 row, then 1 or 2 for 2..max_rows)."""
        return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(self._code))

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        return self.model(input_ids, positions, None, None, logits_indices)

    def applies(self, meta: AttentionMetadata, rows: int) -> bool:
        """Whether a step with this metadata and row count runs compiled."""
        return self.state == "ready" and not meta.prefills and 0 < rows <= self.max_rows

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        rows = input_ids.shape[0]
        with attention_step(backend, meta):
            if rows not in self._eager_rows:
                if self.state == "ready":  # not while warming up, on the warm-up's thread
                    _forbid_recompiles_on_this_thread()
                try:
                    logits = self._fn(input_ids, positions, logits_indices)
                    self.steps += 1
                    return logits
                except torch._dynamo.exc.RecompileError as exc:
                    # Guards are checked before anything runs: nothing was written yet.
                    self._eager_rows.add(rows)
                    log.warning("decode steps of %d rows run eagerly: %s", rows, exc)
            return self.model(input_ids, positions, backend, meta, logits_indices)

    def warm_up_in_background(
        self, backend: AttentionBackend, device: torch.device, block: int
    ) -> None:
        """Warm up in a daemon thread ("compile-warm-up"); the compiled step applies once it
        is done. `backend`:
        one the step thread does not use. `block`: a KV block held for the dummy rows' K/V.
        A failure (no C++ compiler for inductor, say) is logged and leaves the step eager."""

        def run() -> None:
            # Dynamo and inductor hold the GIL for long stretches, and every torch op of the
            # eager step releases it, then waits a switch interval (5 ms) to get it back:
            # SmolLM2 decoded at ~900 ms a token while compiling. At 0.1 ms, 40-67 ms (14 ms
            # without a compile; 0.02 ms was no better); the warm-up took 31 s with inductor's
            # cache warm, 162 s cold, serving all along. Restored once warm.
            interval = sys.getswitchinterval()
            sys.setswitchinterval(WARM_UP_SWITCH_INTERVAL_S)
            try:
                self.warm_up(backend, device, block)
            except Exception as exc:
                self.state = "failed"
                # One line that says why, what runs instead and what it costs (inductor needs
                # a C++ compiler on a CPU: `controlplane kernels status`); the traceback at
                # debug level.
                log.error(
                    "compiling the decode step failed; every step stays eager (%s: %s), slower "
                    "than compiled (see docs/benchmarks.md#compiled-decode-step)",
                    type(exc).__name__,
                    str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "",
                )
                log.debug("the decode step's compile failed", exc_info=True)
            finally:
                sys.setswitchinterval(interval)

        self.state = "warming"
        prime_fx_tracer()
        self._warm_up_thread = threading.Thread(target=run, name="compile-warm-up", daemon=True)
        self._warm_up_thread.start()

    def stop_warm_up(self) -> None:
        """Stop a background warm-up at its next row count and wait for it (at most the graph
        it is compiling: seconds, a minute cold). The engine's shutdown calls this: a daemon
        thread still inside the compiler when the interpreter exits is torn down in C++ frames
        that cannot unwind ("terminate called without an active exception", exit code 134:
        CI's quickstart daemon, stopped 27 s after it was ready)."""
        thread = self._warm_up_thread
        if thread is None or not thread.is_alive():
            return
        self._stop_warm_up.set()
        log.info("stopping the decode step's compile (waiting for the graph it is on)")
        thread.join()

    @torch.inference_mode()
    def warm_up(
        self,
        backend: AttentionBackend,
        device: torch.device,
        block: int = 0,
        only: Collection[int] = (),
    ) -> None:
        """Compile the graphs for 1 row and for 2..max_rows rows; once `ready`, each thread
        that runs the step forbids compiling more on itself (_forbid_recompiles...).

        `only`: the row counts steps will come in, when not every one up to max_rows (the
        CUDA graphs' padded sizes, when they cover every decode step the step runs): those
        are run, not every count (512 forwards of an 8B model at start, else).

        The dummy rows write their K/V into slot 0 of `block`: at start, before any request,
        block 0, which holds nothing yet (and, as the decode buckets' padding block, is never
        read unmasked); in the background, a block the engine holds for this.
        """
        self.state = "warming"
        t0 = time.perf_counter()
        # After warm-up a recompile is an error (caught in __call__: those steps run eagerly),
        # never a compile in the hot path: set per calling thread (_forbid_recompiles...),
        # hence its patch here for an engine warming up on a thread that forbade them for
        # another. (The compiler's "eager_on_recompile" stance does the same but cost every
        # compiled call here: 78 -> 57 tok/s at batch 1.)
        # specialize_float: the model's float attributes (61 RMSNorm eps on SmolLM2) are
        # constants of the graph, not tensors built from Python floats before every call.
        with torch._dynamo.config.patch(error_on_recompile=False, specialize_float=True):
            # 1, 2 and max_rows compile the graphs; every other row count then runs once, so
            # that whatever bounds the graphs got (a shape branch in the model, guards a
            # cached graph brought from an earlier version of the code) are all covered here.
            rest = sorted(set(only) - {1, 2, self.max_rows}) if only else range(3, self.max_rows)
            self.warm_rows = (1, 2, self.max_rows, *rest)
            for rows in self.warm_rows:
                if self._stop_warm_up.is_set():
                    self.state = "cold"
                    log.info("compiling the decode step stopped; every step stays eager")
                    return
                spans = [SeqSpan(1, 1, new_block_table([block])) for _ in range(rows)]
                # Three distinct tensors: dynamo guards on aliasing between inputs too.
                ids, positions = (torch.zeros(rows, dtype=torch.long, device=device) for _ in "ip")
                meta = backend.prepare(spans, device)
                self(ids, positions, torch.arange(rows, device=device), backend, meta)
        self.steps = 0
        self.warmup_s = time.perf_counter() - t0
        self.state = "ready"
        mark_warm(self.key)
        log.info(
            "compiled the decode step (%d graphs: 1 row, and 2..%d rows as dynamic shapes%s) "
            "in %.1fs; other steps run eagerly",
            self.num_graphs,
            self.max_rows,
            ", C++ wrapper" if self.cpp_wrapper else "",
            self.warmup_s,
        )


# Dynamo's config is per thread (torch 2.13: a value set on one thread is not seen on
# another), and the step runs on the engine's step thread, not the one that warmed up: so
# each thread that calls the compiled step forbids recompiles on itself first. (Set only at
# warm-up, the step thread of a daemon compiled whatever new shape reached it.)
_no_recompile = threading.local()


def _forbid_recompiles_on_this_thread() -> None:
    if not getattr(_no_recompile, "set", False):
        torch._dynamo.config.error_on_recompile = True
        _no_recompile.set = True


def _own_code(method: MethodType) -> MethodType:
    """`method` with a code object of its own.

    Dynamo keeps compiled graphs on the code object, so every engine in a process would share
    `_forward`'s cache (and its limit of 8 graphs: the fifth compiled engine of a test process
    ran eagerly) and tell its graphs apart only by guards on `self`."""
    func = method.__func__
    own = FunctionType(func.__code__.replace(), func.__globals__, func.__name__)
    return MethodType(own, method.__self__)


def _input_guards_only(entries: list) -> list[bool]:
    """Keep the guards on the step's inputs; drop those on the model (`self`'s attributes).

    Dynamo guards every parameter's identity, size and aliasing before each call (5,910 guards
    on SmolLM2, 0.68 ms of a ~7 ms batch-1 step here; 36 and 0.04 ms kept). The model is fixed
    once loaded and each CompiledDecode has its code (`_own_code`), hence its graphs, to
    itself, so only what varies from step to step is checked: the inputs' dtypes and sizes
    (the row count picks the graph).
    """
    return [not entry.name.startswith("self.") for entry in entries]


# What `auto` does on a CPU in a long-running engine: "background" or "off". tests/conftest.py
# sets "off" for the suite, whose dozens of short-lived daemons would each compile for 10-160 s
# on two cores; tests/engine/test_compiled.py runs the background path itself.
CPU_AUTO = "background"


def compile_mode(mode: str, device: torch.device, long_running: bool = False) -> str:
    """What `engine.compile` means on `device`: "start" (warm up before serving: `on`, and
    `auto` on CUDA), "background" (`auto` on a CPU in a long-running engine, the daemon's:
    serve eagerly until warm) or "off" (also `auto` on a CPU in a one-off engine, `LLM` or a
    benchmark's: the 20-160 s compile would slow its work 3-5x and seldom pay back)."""
    if mode == "auto":
        if device.type == "cuda":
            return "start"
        return CPU_AUTO if long_running else "off"
    return "start" if mode == "on" else "off"


# Under inductor's cache directory: one empty file per decode step whose graphs are in it.
WARM_MARKERS = "controlplane-decode"


def warm_key(
    model: CausalLM, attention_op: object, cpp_wrapper: bool, max_rows: int = MIN_COMPILED_ROWS
) -> str:
    """What a decode step's graphs depend on, hashed: torch's version, the wrapper, the row
    bound, the attention op, and the model's modules with every parameter's and buffer's name,
    shape and dtype. A key that matches where inductor's cache misses anyway (a kernel choice
    held in a Python attribute, say) costs one cold compile, never a wrong graph: inductor
    keys its own cache on the graph itself."""
    h = hashlib.sha256()
    op = getattr(attention_op, "__name__", None) or str(attention_op)
    h.update(f"{torch.__version__} {cpp_wrapper} {max_rows} {op}\n".encode())
    h.update(str(model).encode())
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        h.update(f"{name} {tuple(t.shape)} {t.dtype} {t.device.type}\n".encode())
    return h.hexdigest()[:24]


def _marker(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / WARM_MARKERS / key


def mark_warm(key: str) -> None:
    """Record that inductor's cache now holds the graphs of the step `key` (beside them, so
    that clearing the cache clears the marker too)."""
    try:
        path = _marker(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as exc:  # a read-only cache: the next one-off engine runs eagerly
        log.warning("could not mark the compiled decode step's cache warm: %s", exc)


def cache_warm(key: str) -> bool:
    """Whether a decode step with this key compiled to the end with this inductor cache."""
    return _marker(key).is_file()
