"""Our int4 kernels on this CPU, checked and timed once per process: whether `int4_linear`
gives torch's kernel's results bit for bit on torch's packed layout (`int4_layout`), whether
`int4_linear_bf16` agrees with it within bf16 rounding in VDPBF16PS dot products or AMX tiles,
and from how many rows ours beats torch's (`int4_many_rows`, `int4_one_row`). Int4Linear asks
these when it is built on a CPU (int4.py)."""

from __future__ import annotations

import functools
import logging
import time

import torch

from controlplane.engine.kernels import cpu_ops
from controlplane.engine.model.quant.weights import quantize_int4

log = logging.getLogger(__name__)

# Int4Linear.many_rows where it cannot be measured (see there): ours from 16 rows.
DEFAULT_MANY_ROWS = 16


@functools.cache
def int4_layout() -> tuple[int, bool] | None:
    """The (block_n, split) arguments of `int4_linear` for the layout this torch packs int4
    weights in on this CPU (csrc/int4_linear.cpp), or None where our kernels are not built or
    do not return torch's kernel's results bit for bit: checked once per process on a weight
    of one full and one partial block, so another torch or CPU keeps torch's kernel."""
    if not cpu_ops.available():
        return None
    # torch's BLOCK_N is 4 float vectors; its AVX512 and AVX2 kernels split full blocks.
    layout = {"AVX512": (64, True), "AVX2": (32, True)}.get(
        torch.backends.cpu.get_cpu_capability(), (32, False)
    )
    x, packed, scales, group = int4_probe(layout[0])
    ours = torch.ops.controlplane_cpu.int4_linear(x, packed, scales, group, *layout)
    if not torch.equal(ours, torch._weight_int4pack_mm_for_cpu(x, packed, group, scales)):
        log.warning("our int4 kernel does not match torch's on this CPU; keeping torch's")
        return None
    return layout


def int4_probe(block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(x, packed, scales, group) for the start-up checks of our int4 kernels: 7 rows against
    a weight of one full and one partial block of `block_n` rows, group 64, bf16 scales."""
    gen = torch.Generator().manual_seed(0)
    n, k, group = block_n + 48, 256, 64
    q = quantize_int4(torch.randn(n, k, generator=gen), group)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.qvalues, 2)
    scales = q.scales_and_zeros.to(torch.bfloat16)
    x = torch.randn(7, k, generator=gen).to(torch.bfloat16)
    return x, packed, scales, group


@functools.cache
def int4_bf16_dot_available() -> bool:
    """Whether `int4_linear_bf16` serves here: our kernels built for AVX512, on a CPU with
    AVX512-BF16, and its results within bf16 rounding of torch's kernel (checked once per
    process, on the weight `int4_layout` checks)."""
    layout = int4_layout()
    if layout is None or layout[0] != 64 or not cpu_ops.bf16_dot_available():
        return False
    return _int4_bf16_agrees_with_torch(layout, amx=False)


@functools.cache
def int4_amx_available() -> bool:
    """Whether `int4_linear_bf16` can take its AMX tiles here (`amx=True`): a CPU with
    AMX-BF16 whose kernel lets this process use them, and the tiles' results within bf16
    rounding of torch's kernel (checked once per process, as `int4_bf16_dot_available`)."""
    if not int4_bf16_dot_available() or not torch.ops.controlplane_cpu.amx_supported():
        return False
    return _int4_bf16_agrees_with_torch(int4_layout(), amx=True)


def _int4_bf16_agrees_with_torch(layout: tuple[int, bool], amx: bool) -> bool:
    """Whether `int4_linear_bf16` (its tiles with `amx`) gives torch's kernel's results within
    bf16 rounding on the start-up probe weight; warns when it does not."""
    x, packed, scales, group = int4_probe(layout[0])
    ours = torch.ops.controlplane_cpu.int4_linear_bf16(x, packed, scales, group, *layout, amx)
    ref = torch._weight_int4pack_mm_for_cpu(x, packed, group, scales).float()
    if not torch.allclose(ours.float(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item()):
        kind = "AMX" if amx else "bf16-dot"
        log.warning("our %s int4 kernel disagrees with torch's on this CPU; not using it", kind)
        return False
    return True


# Where our int4 kernel may take over: at 16 or 32 rows (decode batches; a compiled decode
# graph splits there), else from 64 (prompt chunks only).
MANY_ROWS_CHOICES = (16, 32, 64)


def pick_many_rows(timings: dict[int, tuple[float, float]]) -> int:
    """The fewest rows, of MANY_ROWS_CHOICES, from which ours is faster: `timings` maps a row
    count to (torch's time, ours) at it; the last choice when ours never wins."""
    for rows in MANY_ROWS_CHOICES[:-1]:
        torch_s, ours_s = timings[rows]
        if ours_s < torch_s:
            return rows
    return MANY_ROWS_CHOICES[-1]


@functools.cache
def _int4_timings() -> dict[int, tuple[float, float]]:
    """Both kernels timed once per process (~10 ms) on a SmolLM2-sized weight (576 -> 1536,
    group 32), best of 10 calls at 1, 16 and 32 rows: {rows: (torch's seconds, ours)}; empty
    where ours does not serve."""
    layout = int4_layout()
    if layout is None:
        return {}
    gen = torch.Generator().manual_seed(0)
    n, k, group = 1536, 576, 32
    q = quantize_int4(torch.randn(n, k, generator=gen), group)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.qvalues, 2)
    scales = q.scales_and_zeros.to(torch.bfloat16)

    def best(fn, x) -> float:
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
        return min(times)

    timings = {}
    for rows in (1, *MANY_ROWS_CHOICES[:-1]):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        timings[rows] = (
            best(lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, group, scales), x),
            best(
                lambda x: torch.ops.controlplane_cpu.int4_linear(x, packed, scales, group, *layout),
                x,
            ),
        )
    log.info(
        "int4: torch's kernel / ours, us: %s",
        ", ".join(f"{r} rows {a * 1e6:.0f} / {b * 1e6:.0f}" for r, (a, b) in timings.items()),
    )
    return timings


def int4_many_rows() -> int:
    """Int4Linear.many_rows on this machine (from _int4_timings)."""
    timings = _int4_timings()
    return pick_many_rows(timings) if timings else DEFAULT_MANY_ROWS


def int4_one_row() -> bool:
    """Int4Linear.one_row on this machine: whether ours beat torch's at one row (it does where
    it has a one-row path, csrc/int4_linear.cpp's AVX2 build)."""
    torch_s, ours_s = _int4_timings().get(1, (0.0, 0.0))
    return ours_s < torch_s
