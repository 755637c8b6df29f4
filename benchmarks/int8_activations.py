"""Int8-activation kernels on this CPU (`engine.quantize_activations`) against the 16-bit ones.

SmolLM2-135M's int4 linears (q/k/v fused 576 -> 960, o 576 -> 576, gate/up fused 576 -> 3072,
down 1536 -> 576, group 32): `w4a8_linear` against torch's `_weight_int4pack_mm_for_cpu` (bf16
activations, the W4A16 default below `many_rows`). Its int8 lm_head (576 -> 49152):
`w8a8_linear` against our `int8_linear` (float32 sums, the default). 1 to 32 rows, each call
on the next of as many copies of the weight as fill `--cycle-mb`, so that weights come from
memory as in a real step, not from a cache: a 2-core Xeon VM here reports 480 MB of L3, and
the lm_head read 28 MB in 0.99 ms cycling over 2 copies, 2.30 ms over 4 (in the model: ~2 ms).

Prints microseconds a call (best of `--reps` rounds) and the ratio baseline / int8
activations, measured in the same run. Figures to read, never timed assertions.

    python -m benchmarks.int8_activations [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.int4_linear import _time
from controlplane.engine.model import quant

INT4_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LM_HEAD = (576, 49152)
ROWS = [1, 4, 16, 32]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cycle-mb", type=int, default=1024, help="weight copies cycled through, in MB")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not quant.int8_activations_available():
        raise SystemExit("our int8-activation kernels do not run here (AVX2 / AVX512 and a build)")
    ops = torch.ops.controlplane_cpu
    print(f"{'linear':<22}{'rows':>5}{'16-bit us':>12}{'int8 act. us':>14}{'ratio':>8}")
    for k, n in [*INT4_SHAPES, LM_HEAD]:
        lm_head = (k, n) == LM_HEAD
        lin = torch.nn.Linear(k, n, bias=False)
        torch.nn.init.normal_(lin.weight, std=0.05, generator=torch.Generator().manual_seed(0))
        if lm_head:
            mod = quant.quantize_linear(lin, "int8", 32)
            base, a8 = (mod.qweight, mod.scales), (mod.qweight, mod.scales)
        else:
            w4 = quant.Int4Linear(lin.weight, None, 32, torch.float32, "int4pack_mm_cpu")
            w8 = quant.Int4Linear(lin.weight, None, 32, torch.float32, "w4a8_cpu")
            base, a8 = (w4.packed, w4.scales_and_zeros), (w8.packed, w8.scales, w8.mins)
        copies = -(-(args.cycle_mb << 20) // sum(t.nbytes for t in a8))
        base = [tuple(t.clone() for t in base) for _ in range(copies)]
        a8 = [tuple(t.clone() for t in a8) for _ in range(copies)]
        for rows in ROWS:
            x = torch.randn(rows, k)
            if lm_head:
                t_base = _time(ops.int8_linear, base, x, args.reps)
                t_a8 = _time(ops.w8a8_linear, a8, x, args.reps)
                name = f"lm_head {k}->{n}"
            else:

                def torch_int4(xb: torch.Tensor, p: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
                    return torch._weight_int4pack_mm_for_cpu(xb, p, 32, sz)

                t_base = _time(torch_int4, base, x.bfloat16(), args.reps)
                t_a8 = _time(ops.w4a8_linear, a8, x, args.reps)
                name = f"int4 {k}->{n}"
            print(f"{name:<22}{rows:>5}{t_base:>12.0f}{t_a8:>14.0f}{t_base / t_a8:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
