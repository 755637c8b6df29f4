"""Offline mixed workload on one model in float32 / int8 / int4 weights, at several batch sizes.

What is measured
----------------
The workload of offline_throughput.py (``--num-requests`` requests arriving at once, prompts
uniform in [32, 512] tokens of random non-special ids, outputs uniform in [16, 512] tokens, EOS
ignored, greedy) run by ``controlplane.engine.LLM`` with ``engine.quantization`` = each of
``--quantizations`` (dtype float32 for ``none``, auto otherwise, lm_head kept float) and
``max_num_seqs`` = each of ``--batch-sizes`` (a live setting: one engine per quantization,
retuned between runs). Figures: useful output tokens/s (output tokens / wall time from
submission to the last completion), its ratio to float32 at the same batch size, TTFT and
inter-token latency p50. Configurations are interleaved (the order rotates every repeat),
medians over ``--repeats``. Figures to read, never timed assertions.

    python -m benchmarks.quant_offline                                   # SmolLM2, ~15 minutes
    python -m benchmarks.quant_offline --num-requests 16 --repeats 1     # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.offline_throughput import make_workload
from benchmarks.quant_decode import CONFIGS, log, resolve_model
from controlplane.common import percentile


class Facts:
    """The two fields make_workload reads, from a loaded engine."""

    def __init__(self, engine: Any) -> None:
        self.vocab_size = engine.model_config.vocab_size
        specials = set(getattr(engine.tokenizer, "all_special_ids", ()) or ())
        self.special_ids = sorted(specials | set(engine.model_config.eos_token_ids or ()))


def run_once(llm: Any, workload: Any) -> dict[str, float]:
    from controlplane.engine import SamplingParams

    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.out_lens
    ]
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    itl = [
        (o.metrics.finish_time - o.metrics.first_token_time) / (o.metrics.num_output_tokens - 1)
        for o in outs
        if o.metrics.num_output_tokens > 1
    ]
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "tok_s": tokens / wall,
        "wall_s": wall,
        "ttft_p50_s": percentile(ttft, 50) or 0.0,
        "itl_p50_s": percentile(itl, 50) or 0.0,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="engine.model value, or llama-1b")
    p.add_argument("--quantizations", default="none,int8,int4")
    p.add_argument("--batch-sizes", default="16,64")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from controlplane.engine import LLM

    args = parse_args(argv)
    model = resolve_model(args.model)
    kinds = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llms: dict[str, Any] = {}
    for kind in kinds:
        cfg = CONFIGS["float32"] if kind == "none" else CONFIGS[kind]
        log(f"[{kind}] loading {model} ({cfg})")
        llms[kind] = LLM(
            model,
            device="cpu",
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(args.max_num_batched_tokens, max(batches)),
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            **cfg,
        )
    workload = make_workload(Facts(llms[kinds[0]].engine), args.num_requests, args.seed)
    log(f"workload: {args.num_requests} requests, {sum(workload.out_lens)} output tokens")
    combos = [(k, b) for b in batches for k in kinds]
    results: dict[str, list[dict[str, float]]] = {f"{k}@{b}": [] for k, b in combos}
    for r in range(args.repeats):
        order = combos[r % len(combos) :] + combos[: r % len(combos)]
        for kind, batch in order:
            llm = llms[kind]
            llm.engine.update_settings(max_num_seqs=batch)
            res = run_once(llm, workload)
            results[f"{kind}@{batch}"].append(res)
            log(f"[{kind} batch {batch}] repeat {r + 1}/{args.repeats}: {res['tok_s']:.1f} tok/s")

    summary: dict[str, Any] = {"model": model, "num_requests": args.num_requests, "rows": []}
    print("\n" + "=" * 78)
    print(f"offline mixed workload, {args.num_requests} requests, medians of {args.repeats}")
    print(f"{'quant':<8}{'batch':>6}{'tok/s':>10}{'vs none':>9}{'TTFT p50':>11}{'ITL p50':>10}")
    print("-" * 78)
    for batch in batches:
        base = None
        for kind in kinds:
            runs = results[f"{kind}@{batch}"]
            med = {key: statistics.median(x[key] for x in runs) for key in runs[0]}
            base = med["tok_s"] if kind == "none" else base
            ratio = f"{med['tok_s'] / base:.2f}x" if base else "-"
            print(
                f"{kind:<8}{batch:>6}{med['tok_s']:>10.1f}{ratio:>9}"
                f"{med['ttft_p50_s']:>10.2f}s{1e3 * med['itl_p50_s']:>8.1f}ms"
            )
            summary["rows"].append({"quantization": kind, "batch": batch, **med})
    print("=" * 78)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
        log(f"summary written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
