"""How far the simulator's figures are from a real replay's (issue 57), over a sweep of configs:
the same workload replayed through the engine and simulated on a cost model calibrated in the
same run, side by side, and how fast the simulator runs.

What is measured
----------------
The `--size` demo model in float32, `engine.compile` off. A cost model is calibrated first
(planning/costmodel.py: the engine served a designed mix; each step's scheduler output and
loop period fit by least squares). The workload: `--requests` requests arriving as a Poisson
process at `--rate` a second, prompts of 16-200 tokens, 8-48 completion tokens, every fourth
request sharing a 64-token prefix with the one before. The sweep: max_num_seqs {2, 4, 16} x
token budget (= prefill chunk) {64, 512} x preemption {recompute, swap}, with a KV cache of
`--blocks` blocks so that preemption happens. For each config the real replay (in-process, the
arrivals in real time) and the simulation; then each figure's mean absolute percentage error
over the configs and the simulator's configs per second.

    python -m benchmarks.simulator_accuracy
    python -m benchmarks.simulator_accuracy --size tiny --requests 60   # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import random
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from controlplane.engine.demo_model import write_demo_model
from controlplane.engine.settings import EngineSettings
from controlplane.planning.costmodel import calibrate
from controlplane.planning.replay import engine_for, replay
from controlplane.planning.simulate import simulate
from controlplane.planning.summary import Slo, replay_figures
from controlplane.planning.window import Recorded, Window
from controlplane.planning.workload import build_workload

FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "throughput_tok_s")


def window(requests: int, rate: float, seed: int) -> Window:
    rng = random.Random(seed)
    rows, t = [], 1.0e9
    for i in range(requests):
        t += rng.expovariate(rate)
        prompt, completion = rng.randint(16, 200), rng.randint(8, 48)
        cached = 64 if i % 4 == 3 and prompt > 64 else 0
        rows.append(
            Recorded(f"r{i}", t, None, "success", prompt, cached, completion, 1, completion,
                     None, None, None, None, None, 0, 0, 0, None)
        )  # fmt: skip
    now = datetime.now(UTC)
    return Window(now, now, "demo", rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--blocks", type=int, default=32)
    args = parser.parse_args()
    model = write_demo_model(Path(tempfile.mkdtemp(prefix="sim-accuracy-")) / "model", args.size)
    base = EngineSettings(model=str(model), compile="off", dtype="float32")
    t0 = time.perf_counter()
    engine = engine_for(base)
    cost = calibrate(engine)
    engine.close()
    print(
        f"calibrated in {time.perf_counter() - t0:.1f} s: base {cost.base_s * 1e3:.2f} ms, "
        f"{cost.per_prefill_token_s * 1e6:.1f} us a prompt token, {cost.per_decode_row_s * 1e6:.1f} "
        f"us a decode row, {cost.per_context_kilotoken_s * 1e3:.3f} ms a thousand context tokens "
        f"(rms {cost.rms_error_s * 1e3:.2f} ms over {cost.samples} steps)",
        flush=True,
    )
    win = window(args.requests, args.rate, 1)
    errors: dict[str, list[float]] = {name: [] for name in FIGURES}
    sim_s = 0.0
    configs = list(itertools.product((2, 4, 16), (64, 512), ("recompute", "swap")))
    header = f"{'seqs':>4} {'budget':>6} {'preempt':>9} " + " ".join(f"{n:>22}" for n in FIGURES)
    print(header + "   (real / simulated)")
    for seqs, budget, mode in configs:
        s = dataclasses.replace(
            base,
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            prefill_chunk_size=budget,
            preemption_mode=mode,
            num_kv_blocks=args.blocks,
        )
        engine = engine_for(s)
        work = build_workload(win, engine.model_config.vocab_size, engine.max_model_len)
        real = replay_figures(asyncio.run(replay(work, engine, "real")), Slo(), 1.0)
        t1 = time.perf_counter()
        sim = replay_figures(simulate(work, s, cost, "sim"), Slo(), 1.0)
        sim_s += time.perf_counter() - t1
        cells = []
        for name in FIGURES:
            a, b = getattr(real, name), getattr(sim, name)
            errors[name].append(abs(b - a) / a if a else 0.0)
            cells.append(f"{a:>10.1f} / {b:>9.1f}")
        print(
            f"{seqs:>4} {budget:>6} {mode:>9} "
            + " ".join(cells)
            + f"  preempt {real.preemptions}/{sim.preemptions}",
            flush=True,
        )
    print(
        "mean absolute error: " + ", ".join(f"{n} {sum(e) / len(e):.0%}" for n, e in errors.items())
    )
    print(f"simulator: {len(configs) / sim_s:.1f} configs/s ({args.requests} requests each)")


if __name__ == "__main__":
    main()
