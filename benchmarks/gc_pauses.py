"""Garbage-collection pauses in the engine's step: the collector as Python leaves it against
the start-up objects frozen (controlplane/runtime/collector.py, what the daemon does once
ready).

What is measured
----------------
The setup of `host_overhead` (the tiny demo model, float32, eager, one torch thread, `--rows`
requests of 8 distinct prompt tokens decoding greedily), run for `--steps` steady decode steps
in a fresh child process per mode and repeat: `default` (the collector untouched) and `frozen`
(`freeze_startup_objects()` once the engine is built and its requests added). Each step's host
time (step - forward) is recorded, and the collections of each generation over the run
(`gc.get_stats`). A full (generation 2) collection walks every tracked object; frozen, the
start-up's are not among them. Printed: host time p50, p99 and max per mode, the collections,
and frozen / default for each figure (the default run is the baseline, in the same run).

How to run
----------
    python -m benchmarks.gc_pauses                      # ~1 minute on 2 cores
    python -m benchmarks.gc_pauses --rows 64 --steps 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from typing import Any

import torch

from benchmarks.host_overhead import (
    DEFAULT_MODEL_DIR,
    REPO_ROOT,
    Timers,
    ensure_model,
    instrument,
    log,
    timed_steps,
)
from controlplane.common import cpu_name, percentile

MODES = ("default", "frozen")


def measure(mode: str, rows: int, steps: int) -> dict[str, Any]:
    """One run in this process: host time a step (µs) and the collections over `steps`."""
    from controlplane.engine import Engine, SamplingParams
    from controlplane.runtime.collector import freeze_startup_objects

    torch.set_num_threads(1)
    new_tokens = steps + 16
    engine = Engine(
        model=str(ensure_model(DEFAULT_MODEL_DIR)),
        dtype="float32",
        device="cpu",
        compile="off",
        attention_backend="cpu",
        max_num_seqs=rows,
        max_num_batched_tokens=max(2048, rows * 8),
        block_size=16,
        num_kv_blocks=rows * (-(-(8 + new_tokens) // 16)) + 8,
        seed=0,
    )
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(rows):
        engine.add_request([(97 * i + 13 * j) % (vocab - 16) + 8 for j in range(8)], params)
    frozen = freeze_startup_objects() if mode == "frozen" else 0
    for _ in range(4):  # the prefill, then every row decoding
        engine.step()
    timers = Timers()
    instrument(engine, timers, phases=False)
    before = [g["collections"] for g in gc.get_stats()]
    records = timed_steps(engine, timers, steps)
    after = [g["collections"] for g in gc.get_stats()]
    host = sorted(1e6 * (r["step"] - r["forward"]) for r in records)
    return {
        "mode": mode,
        "rows": rows,
        "steps": steps,
        "frozen_objects": frozen,
        "tracked_objects": len(gc.get_objects()),
        "collections": [b - a for a, b in zip(before, after, strict=True)],
        "p50_us": percentile(host, 50),
        "p99_us": percentile(host, 99),
        "max_us": host[-1],
    }


def run_child(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.gc_pauses", "--child", mode]
    cmd += ["--rows", str(args.rows), "--steps", str(args.steps)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=256, help="decoding requests (default 256)")
    p.add_argument("--steps", type=int, default=600, help="timed steps a run (default 600)")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating (default 2)")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.rows, args.steps)))
        return 0
    log(f"CPU: {cpu_name()}; torch {torch.__version__}, 1 thread")
    log(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            res = run_child(mode, args)
            runs[mode].append(res)
            log(
                f"repeat {r + 1}/{args.repeats} {mode:7} {args.rows} rows, {args.steps} steps: "
                f"host p50 {res['p50_us']:,.0f} us, p99 {res['p99_us']:,.0f}, "
                f"max {res['max_us']:,.0f}; collections by generation {res['collections']}; "
                f"tracked objects {res['tracked_objects']:,}, frozen {res['frozen_objects']:,}"
            )
    log(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    log("\nmode | host p50 us | p99 | max | full collections (all runs)")
    log("--- | --- | --- | --- | ---")
    worst = {}
    for mode in MODES:
        worst[mode] = {k: max(x[k] for x in runs[mode]) for k in ("p50_us", "p99_us", "max_us")}
        full = sum(x["collections"][2] for x in runs[mode])
        w = worst[mode]
        log(f"{mode} | {w['p50_us']:,.0f} | {w['p99_us']:,.0f} | {w['max_us']:,.0f} | {full}")
    log(
        "\nfrozen / default, the worst run of each: "
        + ", ".join(
            f"{k[:-3]} {worst['frozen'][k] / worst['default'][k]:.2f}"
            for k in ("p50_us", "p99_us", "max_us")
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
