"""The KV cache in 8 bits against 16: how many blocks and sequences a fixed KV budget holds, and
the throughput of a workload that is KV-bound in 16 bits.

What is measured
----------------
For each `--kv-dtypes` entry (default: bfloat16, the 16-bit baseline, then int8 and
fp8_e4m3), one engine on SmolLM2 (its defaults otherwise: quantization and dtype auto) with
`kv_cache_memory_bytes = --budget-mib` MiB, `max_num_seqs = --requests` (the KV cache, not
the batch cap, decides how many run), swap preemption. `--requests` prompts of `--prompt-len`
random tokens, each generating `--new-tokens` (EOS ignored), all queued at once and stepped to
the end. Figures: KV blocks (and the tokens they hold), the most sequences running at once,
preemptions, wall time and output tokens/s; ratios against the first entry, measured in the
same run. Figures to read, never timed assertions.

    python -m benchmarks.kv_cache_dtype
    python -m benchmarks.kv_cache_dtype --kv-dtypes auto,int8 --budget-mib 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.llamacpp_compare import gguf_model, log


def run(model: str, kv_dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    from controlplane.engine import Engine, SamplingParams

    eng = Engine(
        model=model,
        kv_cache_dtype=kv_dtype,
        kv_cache_memory_bytes=args.budget_mib << 20,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(1024, args.requests),
        preemption_mode="swap",
        swap_space_bytes=1 << 30,
        enable_prefix_caching=False,
    )
    gen = torch.Generator().manual_seed(args.seed)
    vocab = eng.model_config.vocab_size
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(args.requests):
        prompt = torch.randint(100, vocab - 100, (args.prompt_len,), generator=gen).tolist()
        eng.add_request(prompt, params)
    peak = out_tokens = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            out_tokens += len(o.new_token_ids)
        peak = max(peak, len(eng.scheduler.running))
    wall = time.perf_counter() - t0
    spec = eng.kv_cache.spec
    row = {
        "kv_cache_dtype": str(spec.dtype).removeprefix("torch."),
        "blocks": eng.block_pool.num_blocks,
        "tokens": eng.block_pool.num_blocks * spec.block_size,
        "bytes_per_block": spec.bytes_per_block,
        "peak_running": peak,
        "preemptions": eng.scheduler.num_preemptions,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
    }
    log(
        f"{row['kv_cache_dtype']:>14}: {row['blocks']} blocks ({row['tokens']} tokens), "
        f"peak {peak} running, {row['preemptions']} preemptions, {wall:.1f} s, "
        f"{row['output_tok_s']:.1f} tok/s"
    )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="KV cache 16-bit vs 8-bit at a fixed budget (figures).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="a .gguf file or model dir (default: SmolLM2)")
    p.add_argument("--kv-dtypes", default="bfloat16,int8,fp8_e4m3")
    p.add_argument("--budget-mib", type=int, default=48)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = gguf_model(args.model)
    need = args.requests * (args.prompt_len + args.new_tokens)
    log(
        f"model {model}; KV budget {args.budget_mib} MiB; {args.requests} requests x "
        f"({args.prompt_len} + {args.new_tokens}) tokens = {need} tokens of KV to hold at once"
    )
    rows = [run(model, d, args) for d in args.kv_dtypes.split(",") if d]
    base = rows[0]
    log("")
    log(f"{'kv cache':>14} {'blocks':>8} {'peak running':>13} {'wall s':>8} {'tok/s':>8}")
    for r in rows:
        log(
            f"{r['kv_cache_dtype']:>14} {r['blocks']:>8} {r['peak_running']:>13} "
            f"{r['wall_s']:>8.1f} {r['output_tok_s']:>8.1f}   blocks "
            f"{r['blocks'] / base['blocks']:.2f}x, running {r['peak_running'] / base['peak_running']:.2f}x, "
            f"throughput {r['output_tok_s'] / base['output_tok_s']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps({"model": model, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
