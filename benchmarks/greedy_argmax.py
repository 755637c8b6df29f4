"""Greedy tokens on a CPU: `argmax_rows` (the sampler's, NumPy's argmax for float32 logits)
against torch's ``max(dim=-1).indices`` (what the sampler called before), in the same run.

What is measured
----------------
Random float32 logits of ``--shapes`` (rows x vocabulary: SmolLM2's 49,152 at 1, 16 and 64 rows,
Llama 3's 128,256 at 16, the tiny demo model's 1,024 at 256), each call on the same tensor, on
``--threads`` torch threads (1: an engine on a busy CPU; the sampler runs on the step thread).
Both give the same tokens (checked before timing). Microseconds a call, the median of
``--repeats`` runs of ``--calls`` calls; above 1 the ratio favours argmax_rows.

How to run
----------
    python -m benchmarks.greedy_argmax                  # ~20 s
    python -m benchmarks.greedy_argmax --threads 2 --shapes 16x49152
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from controlplane.common import cpu_name
from controlplane.engine.sampler import argmax_rows

DEFAULT_SHAPES = "1x49152,16x49152,64x49152,16x128256,256x1024"


def per_call_us(fn, x: torch.Tensor, calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="ROWSxVOCAB, comma-separated")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--calls", type=int, default=50, help="calls a run")
    p.add_argument("--repeats", type=int, default=5, help="runs (median kept)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# {cpu_name()}, torch {torch.__version__}, {args.threads} thread(s)")
    print("shape | torch max(dim=-1).indices us | argmax_rows us | ratio")
    print("--- | --- | --- | ---")
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        rows, vocab = map(int, shape.split("x"))
        x = torch.randn(rows, vocab, generator=gen)
        if not torch.equal(argmax_rows(x), x.max(dim=-1).indices):
            raise SystemExit(f"{shape}: the tokens differ")
        base = per_call_us(lambda t: t.max(dim=-1).indices, x, args.calls, args.repeats)
        ours = per_call_us(argmax_rows, x, args.calls, args.repeats)
        print(f"{shape} | {base:.1f} | {ours:.1f} | {base / ours:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
