"""Weight-only int4 / int8 linears on an NVIDIA GPU against bf16 `F.linear`, per call.

What is measured
----------------
For each shape of an 8B Llama's linears (K in-features -> N out-features: 4096 -> 4096,
4096 -> 14336, 14336 -> 4096, 4096 -> 1024) and each row count (1, 4, 16, 32, 64, 256 by
default), microseconds per call of:

* ``bf16``: ``F.linear`` on the bf16 weight (the baseline, measured in the same run);
* ``tinygemm-int4``: torch's ``_weight_int4pack_mm`` (group ``--group``, the engine's packing);
* ``int8pack_mm``: torch's ``_weight_int8pack_mm`` (per-channel scales);
* ``triton-int4`` / ``triton-int8``: ours (controlplane/engine/model/quant/triton_linear.py),
  with the variant `plan` picks for the row count (int4: gemv up to 4 rows, split-K to 16,
  the weight dequantized then one matmul beyond; int8: split-K up to 16 rows, tiles beyond);
* ``triton-int4-dot``: our int4 kernel as int8's rule runs it (split-K, then tiles: both on
  tl.dot), the int4 choice before the H200 run of 2026-11-30, so one run shows both;
* ``fp8-scaled_mm``: an FP8 (e4m3, per-channel) linear through torch's ``_scaled_mm``, its
  activations quantized per token in the call (Fp8Linear's ``scaled_mm`` at every row count);
* ``triton-fp8``: the same e4m3 weight through our W8A16 kernel (what Fp8Linear runs up to 16
  rows where triton serves).

Each figure is the GPU time of one call inside a CUDA graph of many calls (the engine's decode
step replays CUDA graphs, so Python and launch overheads are not what it pays), the calls
cycling over enough distinct copies of the weight that none is read from L2. Each row also
prints the candidate's speed against bf16 (bf16's time / its time: above 1, faster) and, for
ours, the relative error against the dequantized weight's bf16 `F.linear` (a check that the
figure is of a right answer, not a bound).

Without CUDA it prints that it needs CUDA and exits 0 (benchmarks/gpu_check.sh calls it).

    python -m benchmarks.quant_gpu_kernels
    python -m benchmarks.quant_gpu_kernels --rows 1,16 --json /tmp/quant_gpu_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024)]  # (K, N)
CANDIDATES = [
    "bf16",
    "tinygemm-int4",
    "int8pack_mm",
    "triton-int4",
    "triton-int4-dot",
    "triton-int8",
    "fp8-scaled_mm",
    "triton-fp8",
]
L2_FLUSH_BYTES = 256 << 20  # distinct weight copies per candidate add up to at least this


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def gpu_us(calls: list[Callable[[], Any]], reps: int) -> float:
    """GPU microseconds per call: `calls` (one per weight copy) captured `reps` times over in
    a CUDA graph, replayed, timed with events; eager (events around the same loop) when the
    capture fails."""
    for fn in calls:  # warm-up: compiles, allocations
        fn()
    torch.cuda.synchronize()
    n = len(calls) * reps
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in calls:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                for fn in calls:
                    fn()
        run = graph.replay
    except Exception as exc:  # reported, then timed eagerly
        log(f"  CUDA graph capture failed ({type(exc).__name__}: {exc}); timing eagerly")

        def run() -> None:
            for _ in range(reps):
                for fn in calls:
                    fn()

    run()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / n)
    return best


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.float(), ref.float()
    return float((y - ref).norm() / ref.norm())


def measure_shape(
    k: int,
    n: int,
    rows_list: list[int],
    group: int,
    reps: int,
    dev: torch.device | None = None,
    timer: Callable[[list[Callable[[], Any]], int], float] = gpu_us,
) -> list[dict]:
    """The rows of one shape (`dev`, `timer`: another device and clock, to try the script
    without a GPU under Triton's interpreter; torch's CUDA kernels then fail, as NaN)."""
    from controlplane.engine.model import quant
    from controlplane.engine.model.quant import triton_linear

    dev = dev or torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(k * 31 + n)
    w = torch.randn(n, k, device=dev, generator=gen) * 0.02
    bf16 = torch.bfloat16

    def copies(nbytes: int) -> int:
        return max(2, min(64, -(-L2_FLUSH_BYTES // nbytes)))

    # The engine's modules pack each candidate's weight; the calls below use their buffers.
    cuda = dev.type == "cuda"
    tinygemm = "int4pack_mm_cuda" if cuda else "dequant"
    mods = {
        "tinygemm-int4": quant.Int4Linear(w, None, group, bf16, kernel=tinygemm),
        "triton-int4": quant.Int4Linear(w, None, group, bf16, kernel="int4_triton"),
        "triton-int4-dot": quant.Int4Linear(w, None, group, bf16, kernel="int4_triton"),
        "int8pack_mm": quant.Int8Linear(quant.quantize_int8(w), None, bf16, kernel="int8pack_mm"),
        "triton-int8": quant.Int8Linear(quant.quantize_int8(w), None, bf16, kernel="int8_triton"),
        "fp8-scaled_mm": quant.Fp8Linear(
            quant.quantize_fp8(w), None, bf16, "scaled_mm" if cuda else "dequant", triton_rows=0
        ),
        "triton-fp8": quant.Fp8Linear(quant.quantize_fp8(w), None, bf16, "dequant", triton_rows=0),
    }
    weights: dict[str, list[Any]] = {}
    nbytes = n * k * 2
    weights["bf16"] = [w.to(bf16) for _ in range(copies(nbytes))]
    for name, mod in mods.items():
        size = sum(b.numel() * b.element_size() for b in mod.buffers())
        weights[name] = [mod] + [_clone_module(mod) for _ in range(copies(size) - 1)]
    int4_ref = mods["triton-int4"].dequantize()[:, :k].to(bf16)
    q8 = mods["triton-int8"]
    int8_ref = (q8.qweight.float() * q8.scales.float()[:, None]).to(bf16)
    fp8_ref = mods["triton-fp8"].weight_dequantized(bf16)
    out = []
    for rows in rows_list:
        x = torch.randn(rows, k, device=dev, generator=gen).to(bf16)

        times = {}
        for name in CANDIDATES:
            try:
                times[name] = timer([call(name, m, x, group) for m in weights[name]], reps)
            except Exception as exc:  # a failing candidate is a finding
                log(f"  {name} at {k} -> {n}, {rows} rows failed: {type(exc).__name__}: {exc}")
                times[name] = float("nan")
        errs = {}
        refs = (
            ("triton-int4", int4_ref),
            ("triton-int4-dot", int4_ref),
            ("triton-int8", int8_ref),
            ("triton-fp8", fp8_ref),
        )
        for name, ref_w in refs:
            try:
                errs[name] = rel_err(call(name, mods[name], x, group)(), F.linear(x, ref_w))
            except Exception as exc:  # reported with the timing's failure above
                log(f"  {name}: no output to check ({type(exc).__name__})")
                errs[name] = float("nan")
        periods = k // triton_linear.PERIOD
        w8a16 = triton_linear.plan(rows, n, -(-k // triton_linear.INT8_BLOCK_K), dev).variant
        variants = {
            "triton-int4": triton_linear.plan(rows, n, periods, dev, int4=True).variant,
            "triton-int4-dot": triton_linear.plan(rows, n, periods, dev).variant,
            "triton-int8": w8a16,  # the same kernel and rule for both 8-bit weights
            "triton-fp8": w8a16,
        }
        for name in CANDIDATES:
            out.append(
                dict(
                    k=k,
                    n=n,
                    rows=rows,
                    candidate=name,
                    us=times[name],
                    speed_vs_bf16=times["bf16"] / times[name],
                    rel_err=errs.get(name),
                    variant=variants.get(name),
                )
            )
        log(
            f"{k:>6} -> {n:<6} {rows:>3} rows: "
            + ", ".join(f"{c} {times[c]:.1f} us" for c in CANDIDATES)
        )
    return out


def call(name: str, m: Any, x: torch.Tensor, group: int) -> Callable[[], Any]:
    """One call of candidate `name` on `x` with weight `m` (a tensor or a quantized module)."""
    from controlplane.engine.model.quant import triton_linear

    if name == "bf16":
        return lambda: F.linear(x, m)
    if name == "tinygemm-int4":
        return lambda: torch._weight_int4pack_mm(x, m.packed, group, m.scales_and_zeros)
    if name == "triton-int4":
        return lambda: triton_linear.run_int4(x, m.packed, m.scales_and_zeros, group)
    if name == "triton-int4-dot":
        periods = m.packed.shape[0] // triton_linear.PLANE
        launch = triton_linear.plan(x.shape[0], m.packed.shape[1], periods, x.device)
        return lambda: triton_linear.run_int4(x, m.packed, m.scales_and_zeros, group, launch)
    if name == "fp8-scaled_mm":
        return lambda: m(x)
    if name == "triton-fp8":
        return lambda: triton_linear.run_int8(x, m.qweight, m.scales)
    if name == "int8pack_mm":
        return lambda: torch._weight_int8pack_mm(x, m.qweight, m.scales)
    return lambda: triton_linear.run_int8(x, m.qweight, m.scales)


def _clone_module(mod: Any) -> Any:
    """Another copy of a quantized module's weight (same values, other memory)."""
    import copy

    twin = copy.copy(mod)
    twin._buffers = {k: (v.clone() if v is not None else None) for k, v in mod._buffers.items()}
    return twin


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,32,64,256", help="comma-separated row counts")
    p.add_argument("--group", type=int, default=128, help="int4 group size")
    p.add_argument("--reps", type=int, default=20, help="passes over the weight copies a graph")
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("quant_gpu_kernels: needs CUDA (no CUDA device here); nothing measured")
        return 0
    rows_list = [int(r) for r in args.rows.split(",")]
    device = torch.cuda.get_device_name()
    log(f"{device}, torch {torch.__version__}")
    results = []
    for k, n in SHAPES:
        results += measure_shape(k, n, rows_list, args.group, args.reps)
        if args.json:
            args.json.write_text(json.dumps({"device": device, "rows": results}, indent=2))
    print(f"\n{device}: us per call (speed against bf16 F.linear: bf16's time / its time)")
    print(f"{'K -> N':>16} {'rows':>4} " + " ".join(f"{c:>20}" for c in CANDIDATES))
    for i in range(0, len(results), len(CANDIDATES)):
        group_rows = results[i : i + len(CANDIDATES)]
        r0 = group_rows[0]
        cells = [f"{r['us']:8.1f} ({r['speed_vs_bf16']:5.2f}x)" for r in group_rows]
        print(
            f"{r0['k']:>7} -> {r0['n']:<6} {r0['rows']:>4} " + " ".join(f"{c:>20}" for c in cells)
        )
    errs = [r["rel_err"] for r in results if r["rel_err"] is not None]
    worst = max(errs, key=lambda e: (e != e, e), default=0.0)  # NaN (a failure) first
    print(f"ours against the dequantized weight's bf16 F.linear: worst relative error {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
