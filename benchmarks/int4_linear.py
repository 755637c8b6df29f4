"""Int4 linears on this CPU: our kernels against torch's `_weight_int4pack_mm_for_cpu`.

The int4 linears of SmolLM2-135M (q/k/v fused 576 -> 960, o 576 -> 576, gate/up fused
576 -> 3072, down 1536 -> 576) and a 1.1B Llama (2048 -> 2560, 2048 -> 11264, 5632 -> 2048),
group size 32, bf16 activations, 1 to 512 rows (decode batches to prompt chunks). Each call
goes to the next of `--weights` copies of the weight in turn, so weights are read from
memory as in a real step. `int4_linear` returns torch's kernel's bits (the run checks it);
where the CPU has AVX512-BF16, `int4_linear_bf16` (the engine's default there) is timed too,
its results checked within bf16 rounding of torch's, and where it has AMX tiles, the same op
with `amx=True` (the engine's default there) against it.

Prints microseconds a call (best of `--reps` rounds) and torch / ours (and torch / bf16),
measured in the same run. Figures to read, never timed assertions.

    python -m benchmarks.int4_linear [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from controlplane.engine.kernels import cpu_ops
from controlplane.engine.model import quant

SHAPES = {
    "smollm2": [(576, 960), (576, 576), (576, 3072), (1536, 576)],
    "llama-1.1b": [(2048, 2560), (2048, 11264), (5632, 2048)],
}
ROWS = [1, 4, 8, 16, 32, 128, 512]
GROUP = 32


def _time(fn, weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, reps: int):
    for w in weights:  # warm-up
        fn(x, *w)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in weights:
            fn(x, *w)
        best = min(best, (time.perf_counter() - t0) / len(weights))
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--weights", type=int, default=8, help="copies of each weight cycled through")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    layout = quant.int4_layout() if cpu_ops.available() else None
    if layout is None:
        raise SystemExit(f"our int4 kernel is not in use here: {cpu_ops.build_error() or 'layout'}")

    def torch_kernel(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)

    def ours(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return torch.ops.controlplane_cpu.int4_linear(x, packed, sz, GROUP, *layout)

    def bf16(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return torch.ops.controlplane_cpu.int4_linear_bf16(x, packed, sz, GROUP, *layout)

    def amx(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return torch.ops.controlplane_cpu.int4_linear_bf16(x, packed, sz, GROUP, *layout, True)

    dot = quant.int4_bf16_dot_available()
    tiles = dot and quant.int4_amx_available()
    print(f"{args.threads} threads; us per call, best of {args.reps}")
    header = f"{'model':<11} {'K -> N':>13} {'rows':>5} {'torch':>9} {'ours':>9} ratio"
    header += f" {'bf16':>9} ratio" if dot else ""
    print(header + (f" {'amx':>9} bf16/amx" if tiles else ""))
    g = torch.Generator().manual_seed(0)
    for model, shapes in SHAPES.items():
        for k, n in shapes:
            weights = []
            for _ in range(args.weights):
                q = quant.quantize_int4(torch.randn(n, k, generator=g), GROUP)
                packed = torch._convert_weight_to_int4pack_for_cpu(q.qvalues, 2)
                weights.append((packed, q.scales_and_zeros.to(torch.bfloat16)))
            for rows in ROWS:
                x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
                if not torch.equal(torch_kernel(x, *weights[0]), ours(x, *weights[0])):
                    raise SystemExit(f"{model} {k}->{n} rows {rows}: results differ")
                t_torch = _time(torch_kernel, weights, x, args.reps)
                t_ours = _time(ours, weights, x, args.reps)
                line = (
                    f"{model:<11} {f'{k} -> {n}':>13} {rows:>5} {t_torch:>9.1f} {t_ours:>9.1f} "
                    f"{t_torch / t_ours:.2f}x"
                )
                if dot:
                    ref = torch_kernel(x, *weights[0]).float()
                    err = (bf16(x, *weights[0]).float() - ref).norm() / ref.norm()
                    if err > 1e-2:
                        raise SystemExit(f"{model} {k}->{n} rows {rows}: bf16 error {err:.2e}")
                    t_bf16 = _time(bf16, weights, x, args.reps)
                    line += f" {t_bf16:>9.1f} {t_torch / t_bf16:.2f}x"
                if tiles:
                    t_amx = _time(amx, weights, x, args.reps)
                    line += f" {t_amx:>9.1f} {t_bf16 / t_amx:.2f}x"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
