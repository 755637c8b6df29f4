"""Decode steps past 32 rows, compiled against eager: what `engine.compile_max_rows` buys.

Until 32d26c1 the compiled decode step (and its CUDA graphs) stopped at 32 rows whatever
`max_num_seqs` was; larger decode steps ran eagerly (an 8B model's 64-row steps at half the
32-row step's speed on an H200, docs/benchmarks.md#gpu-seeds). Now the ceiling follows
`max_num_seqs` at start. This measures both on SmolLM2's GGUF (or --model) on this machine:
for each --rows R, two engines with `compile = on` and `max_num_seqs = R`, one with
`compile_max_rows = 32` (the old ceiling: R-row steps eager, the baseline) and one with the
default (R-row steps compiled), R sequences of --context-token prompts decoded to steady
state, then --steps decode steps timed; ms a step, tokens per second, and the ratio. The two
engines' steps are interleaved in --repeats rounds (the best round each): a shared machine's
noise only adds.

    python -m benchmarks.compiled_rows                    # rows 48 and 64, ~5 minutes cold
    python -m benchmarks.compiled_rows --rows 64 --steps 10 --repeats 2
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.llamacpp_compare import gguf_model, log
from benchmarks.step_profile import decode_steps
from controlplane.common import cpu_name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2's)")
    p.add_argument("--rows", default="48,64", help="decoding sequences, comma-separated (> 32)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps a round")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (best of)")
    p.add_argument("--context", type=int, default=64, help="prompt tokens a sequence")
    a = p.parse_args(argv)
    from controlplane.engine import LLM

    model = gguf_model(a.model)
    log(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    for rows in (int(r) for r in a.rows.split(",")):
        engines = {}
        for name, ceiling in (("eager past 32 (baseline)", 32), ("compiled", 0)):
            t0 = time.perf_counter()
            llm = LLM(
                model,
                compile="on",
                max_num_seqs=rows,
                max_num_batched_tokens=max(2048, rows * a.context),
                compile_max_rows=ceiling,
            )
            step = llm.engine.runner.compiled
            log(f"{rows} rows, {name}: compiled up to {step.max_rows} rows, "
                f"built in {time.perf_counter() - t0:.0f} s")  # fmt: skip
            engines[name] = llm
        best = {name: float("inf") for name in engines}
        for _ in range(a.repeats):
            for name, llm in engines.items():
                before = llm.engine.runner.compiled.steps
                ms = decode_steps(llm, rows, a.steps, context=a.context)
                compiled = llm.engine.runner.compiled.steps - before
                best[name] = min(best[name], ms)
                log(f"  {name}: {ms:.1f} ms a step ({compiled} steps of the round ran compiled)")
        base, ours = best["eager past 32 (baseline)"], best["compiled"]
        log(
            f"{rows} rows: eager {base:.1f} ms a step ({rows * 1000 / base:.0f} tok/s), "
            f"compiled {ours:.1f} ms ({rows * 1000 / ours:.0f} tok/s): {base / ours:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
