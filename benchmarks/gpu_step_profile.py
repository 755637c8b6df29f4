"""Where a decode step's time goes on a GPU: the serving path (bf16, Triton attention, the
compiled step, CUDA graphs) under `torch.profiler`, one user and a batch.

Why
---
On the H200 (docs/benchmarks.md#gpu-seeds) one user's decode of the 8B and of the ~1.1B ran
short of issue 54's 85% of the copy-bandwidth limit. Reading the weights is the floor;
the rest is kernels that read less than they could, the gaps between kernels (launch and
dependency latency, even inside a CUDA graph), and host time the device waits for. This says
which, per step, so that the next change is aimed rather than guessed.

What it does
------------
Builds the engine as `gpu_seeds` does (`--shape`, `--weights`: the same random-weight model
directories), starts `rows` requests (`--rows`, default 1 and 32; 32-token prompts, EOS
ignored), steps until every one decodes, warms `--warmup` steps, then profiles `--steps`
decode steps (CPU and CUDA activity; kernels a CUDA graph launches included). Per step:

* wall: the `Engine.step()` calls' time (the host's view);
* GPU busy: the union of the kernels' intervals (and copies'); GPU span: first kernel start
  to last kernel end; idle = span - busy: gaps between kernels;
* kernels and copies a step;
* the kernels by total time (name, calls a step, µs a step, share of busy), top `--top`.

On a CPU (`--device cpu`, the tiny shape: the CI's smoke run) there are no kernels: the top
list is the CPU operators by self time, and busy/span/idle are empty.

    python -m benchmarks.gpu_step_profile                      # on the device: 1b shape
    python -m benchmarks.gpu_step_profile --shape 8b --rows 1 --steps 10
    python -m benchmarks.gpu_step_profile --device cpu --shape tiny --json -
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_seeds import REPO, SHAPES, WEIGHTS, device_defaults, ensure_random_model


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (µs)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize(events: Any, steps: int, wall_s: float, top: int) -> dict[str, Any]:
    """The per-step figures of a profile's events (`prof.events()`)."""
    from torch.autograd import DeviceType

    gpu = [e for e in events if e.device_type == DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in gpu]
    copies = [e for e in gpu if "memcpy" in e.name.lower() or "memset" in e.name.lower()]
    row: dict[str, Any] = {
        "steps": steps,
        "wall_us": round(wall_s * 1e6 / steps, 1),
        "kernels": round((len(gpu) - len(copies)) / steps, 1),
        "copies": round(len(copies) / steps, 1),
    }
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    if gpu:
        busy = union_us(spans)
        span = max(e for _, e in spans) - min(s for s, _ in spans)
        row.update(
            gpu_busy_us=round(busy / steps, 1),
            gpu_span_us=round(span / steps, 1),
            gpu_idle_us=round((span - busy) / steps, 1),
        )
        for e in gpu:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.time_range.end - e.time_range.start
        basis = busy
    else:  # a CPU: the operators by their own time
        row.update(gpu_busy_us=None, gpu_span_us=None, gpu_idle_us=None)
        for e in events:
            if e.device_type == DeviceType.CPU:
                by_name[e.name][0] += 1
                by_name[e.name][1] += e.self_cpu_time_total
        basis = sum(us for _, us in by_name.values()) or 1.0
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    row["top"] = [
        {
            "name": name[:120],
            "calls": round(calls / steps, 2),
            "us": round(us / steps, 2),
            "share": round(us / basis, 4),
        }
        for name, (calls, us) in ranked
    ]
    return row


def profile_rows(eng: Any, rows: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """`rows` requests decoding: warm up, profile `args.steps` steps, abort them."""
    from torch.profiler import ProfilerActivity, profile

    from controlplane.engine import SamplingParams

    gen = torch.Generator().manual_seed(rows)
    params = SamplingParams(
        max_tokens=args.warmup + args.steps + 64, temperature=0.0, ignore_eos=True
    )
    for _ in range(rows):
        eng.add_request(torch.randint(100, vocab - 1, (32,), generator=gen).tolist(), params)
    sch = eng.scheduler
    for _ in range(64):  # the prompts' steps, until every request decodes
        eng.step()
        if (
            len(sch.running) == rows
            and not sch.waiting
            and all(s.num_computed_tokens >= len(s.prompt_token_ids) for s in sch.running)
        ):
            break
    for _ in range(args.warmup):
        eng.step()
    cuda = eng.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    for rid in list(eng.requests):
        eng.abort(rid)
    while eng.has_unfinished_requests():
        eng.step()
    row = {"rows": rows, **summarize(prof.events(), args.steps, wall, args.top)}
    log(
        f"[{rows} rows] {row['wall_us']:,.0f} us a step; {row['kernels']:g} kernels, "
        f"{row['copies']:g} copies; GPU busy {row['gpu_busy_us']} us, idle {row['gpu_idle_us']} us"
    )
    return row


def print_table(out: dict[str, Any], stream: Any) -> None:
    def p(line: str) -> None:
        print(line, file=stream)

    p(f"\n{out['device']}, {out['shape']} shape, {out['weights']} weights: a decode step")
    for r in out["profiles"]:
        p(
            f"  {r['rows']:>3} rows: wall {r['wall_us']:,.1f} us; GPU busy {r['gpu_busy_us']} us,"
            f" span {r['gpu_span_us']} us, idle {r['gpu_idle_us']} us; {r['kernels']:g} kernels,"
            f" {r['copies']:g} copies a step"
        )
        for t in r["top"]:
            p(f"      {t['us']:>10,.1f} us {t['share']:>6.1%} x{t['calls']:<6g} {t['name']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--weights", choices=sorted(WEIGHTS), default="bf16")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--rows", default="1,32", help="comma-separated decoding rows")
    p.add_argument("--steps", type=int, default=20, help="profiled steps a row count")
    p.add_argument("--warmup", type=int, default=10, help="decode steps before the profile")
    p.add_argument("--top", type=int, default=15, help="kernels listed a row count")
    p.add_argument("--cuda-graphs", default=None, help="default: auto on CUDA (off: compare)")
    p.add_argument("--model-root", type=Path, default=REPO / ".bench", help="model directories")
    p.add_argument("--json", default=None, help="write the figures here ('-': to stdout only)")
    args = p.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",") if r]
    for name in ("steps", "warmup", "top"):
        if getattr(args, name) < (1 if name != "warmup" else 0):
            p.error(f"--{name} must be at least {1 if name != 'warmup' else 0}")
    if not args.rows or min(args.rows) < 1:
        p.error("--rows must list row counts of at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step_profile: no CUDA device (try --device cpu --shape tiny)", file=sys.stderr)
        return 0
    from controlplane.engine import Engine

    d = device_defaults(args.device)
    model_dir = ensure_random_model(args.shape, args.model_root)
    settings = dict(
        model=str(model_dir),
        device=args.device,
        quantization=WEIGHTS[args.weights],
        max_num_seqs=max(args.rows),
        enable_prefix_caching=False,
        **{**d, **({"cuda_graphs": args.cuda_graphs} if args.cuda_graphs else {})},
    )
    if args.device != "cuda":
        settings["kv_cache_memory_bytes"] = 64 << 20
    t0 = time.perf_counter()
    eng = Engine(**settings)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "shape": args.shape,
        "weights": args.weights,
        "engine_settings": settings,
        "startup_s": round(time.perf_counter() - t0, 2),
        "cuda_graphs": eng.runner.graphs is not None,
        "profiles": [],
    }
    log(f"{name}: engine ready in {out['startup_s']} s (CUDA graphs: {out['cuda_graphs']})")
    for rows in args.rows:
        out["profiles"].append(profile_rows(eng, rows, args, eng.model_config.vocab_size))
    if args.json and args.json != "-":
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print_table(out, sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
