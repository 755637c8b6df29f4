"""Weight-only INT8 / INT4 matmul kernels on this CPU vs the float linears they replace.

What is measured
----------------
For each shape (M tokens x K in-features -> N out-features) and each candidate kernel: the
best time of one call over ``--reps`` calls (after warmup; the median is in the JSON), the candidate's weight bytes
(packed weights + scales + zero points, what a decode step streams from memory), the
"GB/s-equivalent" = weight bytes / time (the figure to hold against memory bandwidth at M=1),
GFLOP/s = 2*M*K*N / time (the figure that matters for prefill), and the relative error of its
output against the float32 linear on the same float weights.

Shapes: batch-1 decode (M=1) for SmolLM2-135M (hidden 576, intermediate 1536, vocab 49152) and
a 1.1B Llama (hidden 2048, intermediate 5632), and prefill chunks (M=128, 512).

Candidates (a row is skipped, with the reason, where this torch build lacks the op). Not
measured: ``torch._dyn_quant_matmul_4bit`` (W4A8, int8 activations; outside ARM's KleidiAI it is
a scalar reference loop) and torch.ao's quantized ``nn.Linear`` (int8 activations too).

* ``f32`` / ``bf16``: ``F.linear`` on a plain float weight; ``f32-packed`` / ``bf16-packed``:
  the oneDNN pre-packed weight the engine uses today (controlplane/engine/model/linear.py).
* ``int8-mm/<act>``: ``torch._weight_int8pack_mm`` (int8 [N, K] + per-channel scales), with
  float32 or bfloat16 activations.
* ``int8-deq/f32``: dequantize the int8 weight to float32 every call, then ``F.linear``.
* ``int4-mm/<act>``: ``torch._weight_int4pack_mm_for_cpu`` on a weight packed by
  ``torch._convert_weight_to_int4pack_for_cpu`` (group-wise scales and zeros), float32 or
  bfloat16 activations.
* ``int4-deq/f32``: unpack + dequantize every call, then ``F.linear``.
* ``torchao-int8`` / ``torchao-int4``: torchao's ``Int8WeightOnlyConfig`` /
  ``Int4WeightOnlyConfig`` applied to an ``nn.Linear`` (only if ``import torchao`` works; it is
  not a dependency: put a ``pip install --no-deps --target DIR torchao`` on ``PYTHONPATH``).
* ``engine-int8`` / ``engine-int4``: the engine's own modules (controlplane/engine/model/quant/)
  in the automatic activation dtype, i.e. what ``engine.quantization`` runs.

bf16 rows are measured only where the CPU has native bf16 (AVX512-BF16 or AMX) unless
``--force-bf16``: elsewhere they are emulated and many times slower.

These are figures to read, never timed assertions. The machine may be shared: compare rows of
one run, not runs.

    python -m benchmarks.quant_kernels                       # all shapes, ~2 minutes
    python -m benchmarks.quant_kernels --shapes decode --reps 50
    python -m benchmarks.quant_kernels --json /tmp/quant_kernels.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from controlplane.engine.model import quant
from controlplane.engine.model.linear import (
    PackedLinear,
    cpu_has_native_bf16,
    cpu_packing_supported,
)

DECODE_SHAPES = [
    # (M, K, N, what)
    (1, 576, 576, "smollm2 q/o_proj"),
    (1, 576, 1536, "smollm2 gate/up"),
    (1, 1536, 576, "smollm2 down"),
    (1, 576, 49152, "smollm2 lm_head"),
    (1, 2048, 2048, "1.1b q/o_proj"),
    (1, 2048, 5632, "1.1b gate/up"),
    (1, 5632, 2048, "1.1b down"),
]
PREFILL_SHAPES = [
    (128, 576, 1536, "smollm2 gate/up"),
    (512, 576, 1536, "smollm2 gate/up"),
    (128, 2048, 5632, "1.1b gate/up"),
    (512, 2048, 5632, "1.1b gate/up"),
]
GROUP_SIZE = 32

Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Row:
    shape: str
    what: str
    candidate: str
    ms: float | None = None  # best of --reps
    median_ms: float | None = None
    weight_bytes: int | None = None
    gb_per_s: float | None = None
    gflop_per_s: float | None = None
    rel_error: float | None = None
    skipped: str | None = None


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def time_call(fn: Forward, x: torch.Tensor, reps: int, warmup: int = 3) -> tuple[float, float]:
    """(best, median) seconds of one call over `reps`. On a shared machine the best is the
    figure least disturbed by other processes; the median is kept in the JSON rows."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn(x)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def int8_parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = quant.quantize_int8(w)
    return q.qweight, q.scales


def candidates(w: torch.Tensor, bf16: bool) -> dict[str, Callable[[], tuple[Forward, int, str]]]:
    """name -> builder returning (forward, weight bytes, activation dtype name)."""
    n, k = w.shape
    out: dict[str, Callable[[], tuple[Forward, int, str]]] = {}

    def plain(dtype: torch.dtype) -> tuple[Forward, int, str]:
        wd = w.to(dtype)
        return (lambda x: F.linear(x, wd)), nbytes(wd), str(dtype)[6:]

    def packed(dtype: torch.dtype) -> tuple[Forward, int, str]:
        if not cpu_packing_supported(dtype):
            raise RuntimeError("oneDNN packing unsupported for this dtype on this CPU")
        lin = nn.Linear(k, n, bias=False, dtype=dtype)
        lin.weight.data.copy_(w)
        return PackedLinear(lin), nbytes(lin.weight), str(dtype)[6:]

    def int8_mm(dtype: torch.dtype) -> tuple[Forward, int, str]:
        q, s = int8_parts(w)
        s = s.to(dtype)
        return (lambda x: torch._weight_int8pack_mm(x, q, s)), nbytes(q, s), str(dtype)[6:]

    def int8_deq() -> tuple[Forward, int, str]:
        q, s = int8_parts(w)
        return (lambda x: F.linear(x, q.float() * s[:, None])), nbytes(q, s), "float32"

    def int4_mm(dtype: torch.dtype) -> tuple[Forward, int, str]:
        q = quant.quantize_int4(w, GROUP_SIZE)
        packed_w = torch._convert_weight_to_int4pack_for_cpu(q.qvalues, 2)
        sz = q.scales_and_zeros.to(dtype)
        return (
            lambda x: torch._weight_int4pack_mm_for_cpu(x, packed_w, GROUP_SIZE, sz),
            nbytes(packed_w, sz),
            str(dtype)[6:],
        )

    def int4_deq() -> tuple[Forward, int, str]:
        q = quant.quantize_int4(w, GROUP_SIZE)
        # Two nibbles per byte, as a real fallback would store them.
        lo, hi = q.qvalues[:, 0::2].to(torch.uint8), q.qvalues[:, 1::2].to(torch.uint8)
        nib = lo | (hi << 4)
        scales = q.scales_and_zeros[..., 0].t().contiguous()  # [N, K/g]
        zeros = q.scales_and_zeros[..., 1].t().contiguous()

        def fwd(x: torch.Tensor) -> torch.Tensor:
            vals = torch.stack(((nib & 15), (nib >> 4)), dim=-1).view(n, k // GROUP_SIZE, -1)
            wf = (vals.float() - 8) * scales[..., None] + zeros[..., None]
            return F.linear(x, wf.view(n, k))

        return fwd, nbytes(nib, scales, zeros), "float32"

    def torchao(kind: str) -> tuple[Forward, int, str]:
        import torchao.quantization as tq  # optional; see the module docstring

        dtype = torch.bfloat16 if bf16 else torch.float32
        lin = nn.Linear(k, n, bias=False, dtype=dtype)
        lin.weight.data.copy_(w)
        if kind == "int8":
            cfg = tq.Int8WeightOnlyConfig()
        else:
            cfg = tq.Int4WeightOnlyConfig(group_size=GROUP_SIZE, int4_packing_format="opaque")
        tq.quantize_(lin, cfg)
        wt = lin.weight
        size = sum(nbytes(getattr(wt, a)) for a in wt.__tensor_flatten__()[0])
        return lin, size, str(dtype)[6:]

    def engine(kind: str) -> tuple[Forward, int, str]:
        dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        lin = nn.Linear(k, n, bias=False, dtype=dtype)
        lin.weight.data.copy_(w)
        mod = quant.quantize_linear(lin, kind, GROUP_SIZE)
        return mod, quant.weight_bytes(mod), str(dtype)[6:]

    out["f32"] = lambda: plain(torch.float32)
    out["f32-packed"] = lambda: packed(torch.float32)
    if bf16:
        out["bf16"] = lambda: plain(torch.bfloat16)
        out["bf16-packed"] = lambda: packed(torch.bfloat16)
    out["int8-mm/f32"] = lambda: int8_mm(torch.float32)
    if bf16:
        out["int8-mm/bf16"] = lambda: int8_mm(torch.bfloat16)
    out["int8-deq/f32"] = int8_deq
    out["int4-mm/f32"] = lambda: int4_mm(torch.float32)
    if bf16:
        out["int4-mm/bf16"] = lambda: int4_mm(torch.bfloat16)
    out["int4-deq/f32"] = int4_deq
    out["torchao-int8"] = lambda: torchao("int8")
    out["torchao-int4"] = lambda: torchao("int4")
    out["engine-int8"] = lambda: engine("int8")
    out["engine-int4"] = lambda: engine("int4")
    return out


def measure_shape(
    m: int, k: int, n: int, what: str, reps: int, bf16: bool, only: set[str] | None
) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    x = torch.randn(m, k, generator=gen)
    ref = F.linear(x, w)
    shape = f"{m}x{k}x{n}"
    rows = []
    for name, build in candidates(w, bf16).items():
        if only and name not in only:
            continue
        row = Row(shape, what, name)
        try:
            fwd, size, act = build()
            xa = x.to(getattr(torch, act))
            with torch.inference_mode():
                y = fwd(xa).float()
            sec, median = time_call(fwd, xa, reps)
        except Exception as exc:  # a kernel this build lacks: report, keep going
            row.skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
            rows.append(row)
            continue
        row.ms, row.median_ms = sec * 1e3, median * 1e3
        row.weight_bytes = size
        row.gb_per_s = size / sec / 1e9
        row.gflop_per_s = 2 * m * k * n / sec / 1e9
        row.rel_error = float((y - ref).norm() / ref.norm())
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(r: Row) -> str:
    head = f"{r.shape:<16} {r.what:<18} {r.candidate:<14}"
    if r.skipped:
        return f"{head} skipped: {r.skipped}"
    return (
        f"{head} {r.ms:>9.3f} {r.weight_bytes / 1e6:>9.2f} {r.gb_per_s:>8.1f} "
        f"{r.gflop_per_s:>8.1f} {r.rel_error:>9.2e}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Weight-only INT8/INT4 CPU matmul candidates vs float linears (figures).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--shapes", choices=("decode", "prefill", "all"), default="all")
    p.add_argument("--reps", type=int, default=30, help="timed calls per row (best)")
    p.add_argument("--only", default="", help="comma-separated candidate names")
    p.add_argument("--force-bf16", action="store_true", help="bf16 rows without native bf16")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); 1 on a shared machine, where a second thread "
        "waiting for a busy core costs whole scheduler time slices",
    )
    p.add_argument("--json", type=Path, default=None, help="write all rows as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bf16 = cpu_has_native_bf16() or args.force_bf16
    shapes = {"decode": DECODE_SHAPES, "prefill": PREFILL_SHAPES}.get(
        args.shapes, DECODE_SHAPES + PREFILL_SHAPES
    )
    only = {s for s in args.only.split(",") if s} or None
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, native bf16: "
        f"{cpu_has_native_bf16()}, int4 group size {GROUP_SIZE}, best of {args.reps}"
    )
    print(
        f"{'M x K x N':<16} {'layer':<18} {'candidate':<14} {'ms/call':>9} {'weight MB':>9} "
        f"{'GB/s':>8} {'GFLOP/s':>8} {'rel err':>9}"
    )
    rows: list[Row] = []
    for m, k, n, what in shapes:
        rows += measure_shape(m, k, n, what, args.reps, bf16, only)
    skipped = {r.candidate: r.skipped for r in rows if r.skipped}
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
