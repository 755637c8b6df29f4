"""bf16 linears on this CPU: our VDPBF16PS kernel (csrc/bf16_linear.cpp) against oneDNN's packed
matmul.

The linears of a 1.1B Llama (q/k/v fused 2048 -> 3072, o 2048 -> 2048, gate/up fused
2048 -> 16384, down 8192 -> 2048, lm_head 2048 -> 32000), bf16 activations, 1 to 512 rows. Each
call goes to the next of enough copies of the weight to fill `--gb` GB, so weights are read from
memory as in a real step. Both kernels are timed in turn in the same rounds (this VM's memory
bandwidth moves by half within minutes: only ratios measured together mean anything).

(Where the weights lie, 4 KB or 2 MB pages: benchmarks/weight_placement.py.)

Prints microseconds a call (best of `--reps` rounds), GB/s of weight read, and oneDNN / ours.
Needs a CPU with AVX512-BF16 and our kernels built. Figures to read, never timed assertions.

    python -m benchmarks.bf16_linear [--rows 1,4,16,64,512] [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from controlplane.engine.model.linear import PackedLinear, bf16_linear_available

SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 32000)]


def _pair(in_features: int, out_features: int) -> tuple[PackedLinear, PackedLinear]:
    lin = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    return PackedLinear(lin, bf16_dot=True), PackedLinear(lin, bf16_dot=False)


def kernels(rows: list[int], gb: float, reps: int) -> None:
    print(
        f"{'shape':>12} {'rows':>5} {'oneDNN us':>10} {'GB/s':>6} {'ours us':>9} {'GB/s':>6} {'ratio':>6}"
    )
    for k, n in SHAPES:
        nbytes = k * n * 2
        copies = max(2, int(gb * 1e9 // nbytes))
        pairs = [_pair(k, n) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            best = {"ours": float("inf"), "onednn": float("inf")}
            for _ in range(reps + 1):  # the first round warms up
                for name, i in (("onednn", 1), ("ours", 0)):
                    t0 = time.perf_counter()
                    for pair in pairs:
                        pair[i](x)
                    best[name] = min(best[name], (time.perf_counter() - t0) / copies)
            o, d = best["ours"], best["onednn"]
            print(
                f"{k:>5}x{n:<6} {m:>5} {d * 1e6:>10.1f} {nbytes / d / 1e9:>6.1f} "
                f"{o * 1e6:>9.1f} {nbytes / o / 1e9:>6.1f} {d / o:>5.2f}x",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,64,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--gb", type=float, default=1.0, help="GB of weight copies a shape cycles")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not bf16_linear_available():
        raise SystemExit("our bf16 kernel does not serve here (needs AVX512-BF16, no AMX)")
    kernels([int(r) for r in args.rows.split(",")], args.gb, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
