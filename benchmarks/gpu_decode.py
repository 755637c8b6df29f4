"""The engine on an NVIDIA GPU: decode speed of the ~1.1B Llama under each GPU path, against
the eager PyTorch attention measured in the same run.

What is measured
----------------
The ~1.1B random-weight Llama of `benchmarks.decode_latency` (bf16, generated once into
`.bench/llama-1b`), on `cuda`, one engine per variant (default order; the first is the
baseline every ratio is against):

* `torch`: `attention_backend = torch`, eager, no CUDA graphs, 16-bit KV cache;
* `triton`: the Triton paged-attention kernels, eager;
* `triton+graphs`: Triton, `compile = on`, `cuda_graphs = auto` (decode steps replayed from
  graphs captured at start);
* `triton+graphs+int8kv`: the same over an int8 KV cache;
* `triton+graphs+int8w`, `triton+graphs+int4w`: the same with weight-only int8 / int4 linears
  (and an int8 lm_head): torch's `_weight_int8pack_mm` and tinygemm's `_weight_int4pack_mm`.

Per variant: start-up (construction, compile and capture included), batch-1 decode tokens/s
(one request, a 32-token prompt, `--new-tokens` greedy tokens, EOS ignored, (n - 1) / decode
time from the request's own metrics, best of `--repeats`), and aggregate output tokens/s of
`--batch` such requests of `--prompt-len` tokens each, queued at once. Batch-1 is also shown
against the memory-bandwidth limit: device-to-device copy bandwidth (measured here, bytes
read + written) over the weight bytes read per token (`loaded_weight_bytes`). Figures to read, never assertions.

    python -m benchmarks.gpu_decode --json /tmp/gpu.json
    python -m benchmarks.gpu_decode --variants torch,triton+graphs --batch 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.decode_latency import ensure_checkpoint, loaded_weight_bytes, log

REPO = Path(__file__).resolve().parent.parent
VARIANTS: dict[str, dict[str, Any]] = {
    "torch": dict(attention_backend="torch", compile="off", cuda_graphs="off"),
    "triton": dict(attention_backend="triton", compile="off", cuda_graphs="off"),
    "triton+graphs": dict(attention_backend="triton", compile="on", cuda_graphs="auto"),
    "triton+graphs+int8kv": dict(
        attention_backend="triton", compile="on", cuda_graphs="auto", kv_cache_dtype="int8"
    ),
    # Weight-only quantized linears (lm_head int8 too): torch's int8 kernel and tinygemm.
    **{
        f"triton+graphs+{kind}w": dict(
            attention_backend="triton",
            compile="on",
            cuda_graphs="auto",
            quantization=kind,
            quantize_lm_head=True,
        )
        for kind in ("int8", "int4")
    },
}


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10 after warm-up)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / sorted(times)[len(times) // 2]


def run_variant(model: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    from controlplane.engine import Engine, SamplingParams

    t0 = time.perf_counter()
    eng = Engine(
        model=str(model),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=max(args.batch, 1),
        max_num_batched_tokens=max(2048, args.batch),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        **VARIANTS[name],
    )
    torch.cuda.synchronize()
    startup = time.perf_counter() - t0
    vocab = eng.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, vocab - 100, (n,), generator=gen).tolist()

    best1, tokens1 = 0.0, None
    for _ in range(args.repeats):
        rid = eng.add_request(prompt(32), params)
        metrics = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished and out.request_id == rid:
                    metrics, tokens1 = out.metrics, out.token_ids
        n = metrics.num_output_tokens
        best1 = max(best1, (n - 1) / (metrics.finish_time - metrics.first_token_time))
    best_n = 0.0
    for _ in range(args.repeats):
        for _ in range(args.batch):
            eng.add_request(prompt(args.prompt_len), params)
        produced, t1 = 0, time.perf_counter()
        while eng.has_unfinished_requests():
            produced += sum(len(o.new_token_ids) for o in eng.step())
        best_n = max(best_n, produced / (time.perf_counter() - t1))
    row = {
        "variant": name,
        "startup_s": startup,
        "batch1_tok_s": best1,
        f"batch{args.batch}_tok_s": best_n,
        "weight_bytes": loaded_weight_bytes(eng.model)[0],
        "kv_cache_dtype": str(eng.kv_cache.spec.dtype).removeprefix("torch."),
        "graph_replays": eng.runner.graphs.replays if eng.runner.graphs else 0,
        "first_tokens": list(tokens1[:8]) if tokens1 else [],
    }
    del eng
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, first is the baseline"
    )
    p.add_argument("--batch", type=int, default=32, help="requests in the aggregate run")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens in the aggregate run")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs per figure")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.8,
        help="KV cache: fraction of free memory",
    )
    p.add_argument("--model-dir", type=Path, default=REPO / ".bench" / "llama-1b")
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device", file=sys.stderr)
        return 2
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    model = ensure_checkpoint(args.model_dir)
    bw = copy_bandwidth()
    log(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for name in names:
        log(f"[{name}] ...")
        rows.append(run_variant(model, name, args))
        log(json.dumps(rows[-1]))
        if args.json:
            args.json.write_text(json.dumps({"copy_bandwidth": bw, "rows": rows}, indent=2))
    base = rows[0]
    key_n = f"batch{args.batch}_tok_s"
    print(f"\n{torch.cuda.get_device_name()}, bf16 ~1.1B Llama, copy {bw / 1e12:.2f} TB/s")
    print(f"{'variant':24s} {'start s':>8s} {'bs1 tok/s':>10s} {'x':>6s} {'of limit':>9s} "
          f"{f'bs{args.batch} tok/s':>11s} {'x':>6s}")  # fmt: skip
    for r in rows:
        limit = bw / r["weight_bytes"]
        print(
            f"{r['variant']:24s} {r['startup_s']:8.1f} {r['batch1_tok_s']:10.1f} "
            f"{r['batch1_tok_s'] / base['batch1_tok_s']:6.2f} {r['batch1_tok_s'] / limit:9.0%} "
            f"{r[key_n]:11.1f} {r[key_n] / base[key_n]:6.2f}"
        )
    # Quantized weights are another model: their tokens may differ, so only variants that
    # serve the baseline's weights are held to its tokens.
    same_weights = [r for r in rows if r["weight_bytes"] == base["weight_bytes"]]
    same = all(r["first_tokens"] == base["first_tokens"] for r in same_weights)
    print(f"greedy first tokens identical across the {len(same_weights)} variants "
          f"with the baseline's weights: {same}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
