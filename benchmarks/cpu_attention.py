"""Decode attention on this CPU: our kernel (attention_backend cpu) against the torch backend.

One layer's decode attention as the engine calls it (`backend.forward`: the new rows' K/V
written, then attention over the paged cache), for SmolLM2-135M's shape (9 query heads, 3 KV
heads, head_dim 64) and a 1.1B Llama's (32 / 4 / 64), bf16 queries and a bf16 or int8 cache,
1 to 16 rows of 64 to 2,048 tokens of context. Every row reads its own scattered blocks, and
each call goes to the next of `--layers` caches in turn, so the cache is read from memory as
in a real step (one layer's cache stays in L3 otherwise).

Prints microseconds a call (best of `--reps` rounds) and torch / ours, measured in the same
run. Figures to read, never timed assertions.

    python -m benchmarks.cpu_attention [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from controlplane.engine.attention.backend import AttentionBackend, SeqSpan
from controlplane.engine.attention.torch_paged import TorchPagedAttention
from controlplane.engine.kernels import cpu_ops
from controlplane.engine.kv_cache import KVCache, KVCacheSpec

BLOCK = 16
SHAPES = {"smollm2": (9, 3, 64), "llama-1.1b": (32, 4, 64)}
CASES = [(1, 64), (1, 256), (1, 1024), (1, 2048), (4, 256), (16, 256), (16, 1024)]


def _time(backend: AttentionBackend, spans: list[SeqSpan], layers: int, heads: int, reps: int):
    kv_heads, dim = backend.kv.spec.num_kv_heads, backend.kv.spec.head_dim
    meta = backend.prepare(spans, torch.device("cpu"))
    n = len(spans)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, dim, generator=g).bfloat16()
    k, v = (torch.randn(n, kv_heads, dim, generator=g).bfloat16() for _ in range(2))
    for layer in range(layers):  # warm-up
        backend.forward(layer, q, k, v, meta)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for layer in range(layers):
            backend.forward(layer, q, k, v, meta)
        best = min(best, (time.perf_counter() - t0) / layers)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layers", type=int, default=24, help="caches cycled through")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_ops.available():
        raise SystemExit(f"our CPU kernels did not build: {cpu_ops.build_error()}")
    from controlplane.engine.attention.cpu import CpuPagedAttention

    print(f"{args.threads} threads; us per layer call, best of {args.reps}")
    print(f"{'model':<11} {'cache':<9} {'rows':>4} {'context':>7} {'torch':>9} {'ours':>9} ratio")
    for model, (heads, kv_heads, dim) in SHAPES.items():
        for kv_dtype in (torch.bfloat16, torch.int8):
            for rows, ctx in CASES:
                need = rows * -(-ctx // BLOCK) + 1
                spec = KVCacheSpec(args.layers, kv_heads, dim, BLOCK, kv_dtype)
                kv = KVCache(spec, need, 0, torch.device("cpu"))
                perm = torch.randperm(need).tolist()
                per = -(-ctx // BLOCK)
                spans = [SeqSpan(1, ctx, perm[i * per : (i + 1) * per]) for i in range(rows)]
                t_torch = _time(TorchPagedAttention(kv), spans, args.layers, heads, args.reps)
                t_ours = _time(CpuPagedAttention(kv), spans, args.layers, heads, args.reps)
                name = str(kv_dtype).removeprefix("torch.")
                print(
                    f"{model:<11} {name:<9} {rows:>4} {ctx:>7} {t_torch:>9.1f} {t_ours:>9.1f} "
                    f"{t_torch / t_ours:.2f}x",
                    flush=True,
                )
                del kv
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
