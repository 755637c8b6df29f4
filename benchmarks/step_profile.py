"""Where a decode step's time goes: torch's profiler over steps of 1 and of 16 decoding
sequences, eager and compiled, on SmolLM2's GGUF (or --model).

    python -m benchmarks.step_profile [--rows 1,16] [--steps 20] [--context 8]

For each configuration: the step's wall time (plain, then under the profiler), and the ops
with the most self CPU time per step; what the ops do not account for is Python and metadata
(the runner's tensors, the scheduler, sampling).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.llamacpp_compare import gguf_model, log


def decode_steps(llm, rows: int, steps: int, around=None, context: int = 8) -> float:
    """Run `rows` sequences of `context`-token prompts to steady decode, then `steps` decode
    steps (inside `around`, a profiler, when given); ms per step."""
    from controlplane.engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=1_000, temperature=0.0, ignore_eos=True)
    # Distinct prompts (no prefix-cache hits), ids well inside any vocabulary.
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(context)] for i in range(rows)]
    ids = [eng.add_request(prompt, params) for prompt in prompts]
    # Prefill (chunks of up to 128 tokens a sequence, 2,048 a step by default), then a few
    # decode steps.
    for _ in range(4 + -(-context // 128) + -(-rows * context // 2048)):
        eng.step()
    with around or contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        ms = 1000 * (time.perf_counter() - t0) / steps
    for i in ids:
        eng.abort(i)
    eng.step()
    return ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2's)")
    p.add_argument("--rows", default="1,16", help="decoding sequences per step, comma-separated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--context",
        type=int,
        default=8,
        help="prompt tokens per sequence: decode attention's cost grows with it",
    )
    p.add_argument("--top", type=int, default=12, help="ops listed per configuration")
    args = p.parse_args(argv)
    from controlplane.engine import LLM

    torch.set_num_threads(2)
    model = gguf_model(args.model)
    step_ms: dict[tuple[str, int], float] = {}
    for compile_mode in ("off", "on"):
        llm = LLM(model, device="cpu", max_num_seqs=32, compile=compile_mode)
        for rows in map(int, args.rows.split(",")):
            plain = step_ms[compile_mode, rows] = decode_steps(
                llm, rows, args.steps, context=args.context
            )
            prof = profile(activities=[ProfilerActivity.CPU])
            profiled = decode_steps(llm, rows, args.steps, around=prof, context=args.context)
            events = prof.key_averages()
            log(
                f"\ncompile={compile_mode}, {rows} rows: {plain:.2f} ms a step "
                f"({profiled:.2f} under the profiler)"
            )
            top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
            ops_ms = 0.0
            for e in top[: args.top]:
                ms = e.self_cpu_time_total / 1000 / args.steps
                ops_ms += ms
                log(f"  {ms:7.3f} ms  {e.count / args.steps:6.1f} calls  {e.key[:70]}")
            log(f"  {ops_ms:7.3f} ms in these ops; {profiled - ops_ms:.3f} ms elsewhere")
    log("")
    for rows in map(int, args.rows.split(",")):
        off, on = step_ms["off", rows], step_ms["on", rows]
        log(f"{rows} rows: eager {off:.2f} ms, compiled {on:.2f} ms a step ({off / on:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
