"""The seeds' table, measured: a Llama-3-8B-shaped model on one device, beside the seeds' H100
figures scaled to the device.

What is measured
----------------
A model of `--shape` (default `8b`: Llama-3-8B's 32 layers, hidden 4096, intermediate 14336,
32 heads, 8 KV heads, head_dim 128, 128,256-token vocabulary, untied, rope theta 500,000, 8K
context; `1b`: benchmarks.decode_latency's ~1.1B Llama with an 8K context so that the 2K + 512
workload fits; `tiny`: hidden 64, 2 layers, for the CPU smoke run) with random weights that
the engine generates on the device at load (a model directory holding config.json, the tiny
demo model's tokenizer and `random_weights.json` instead of weights: loader.random_state; no
checkpoint on disk), served by the engine's real step loop (`Engine.add_request` / `step`) with
`--weights` bf16 (no quantization), int8, int4 or fp8 (weight-only; reported "not available"
where the engine refuses the setting or cannot build it here), Triton attention, `compile = on` and `cuda_graphs =
auto` on CUDA (torch attention, eager, on a CPU). Phases, in order:

* start-up: the engine's construction (weights generated, KV cache planned and allocated, the
  decode step compiled, CUDA graphs captured), with the weights' share from the engine's own
  "loaded" log line; then one untimed warm-up request (a `--ttft-prompt-len` prompt, a few
  tokens: the prefill kernels' first launches);
* copy bandwidth (measured before the engine is built, so that its memory is free):
  `dst.copy_(src)` on 2 GiB (CUDA; 256 MiB on a CPU, 64 MiB with `--quick`), bytes read + written
  per second, median of 10 after 3 warm-ups;
* batch 1: one request, a 32-token prompt, `--b1-tokens` greedy tokens (EOS ignored), decode
  tokens/s = (n - 1) / (finish - first token) from the request's metrics, best of `--repeats`;
  its fraction of the limit = tok/s / (copy bandwidth / weight bytes read a token), weight
  bytes as loaded (benchmarks.decode_latency.loaded_weight_bytes: every parameter, buffer and
  packed weight but the embedding table). Target: at least 85% (issue 54);
* TTFT: one request of `--ttft-prompt-len` (2,048) tokens and one output token, time to first
  token from its metrics, median of `--repeats`;
* the largest batch at `--kv-context` (4,096) tokens for a bfloat16, int8 and fp8 KV cache:
  the engine's KV budget (its blocks x bytes a block, as planned at start from
  `--gpu-memory-utilization` of the free memory) divided by each cache dtype's bytes a block,
  then by the blocks one sequence of that context needs. Computed, not run. The plan counts
  only memory free at that point: what the load left in torch's allocator cache (the unfused
  projections' copies) is not in it; `reserved_unallocated_bytes` in the JSON says how much;
* batches (`--batches`, 32 and 64): that many requests of `--prompt-len` (2,048) random tokens
  and `--new-tokens` (512) outputs each, queued at once; output tokens/s over the whole run
  (first add to last finish, prefill included), total (prompt + output) tokens/s, and the
  decode phase's tokens/s (after every request's first token).

Beside each figure: the seeds' H100 figure where the seeds give one (8B only: 6,100 / 9,800
output tok/s at batch 32 / 64 in FP16, 7,800 / 13,500 with FP8 weights; ~120 / ~240 sequences at
4K context with a 16-bit / 8-bit KV cache) and that figure scaled to this device: throughput by
the measured copy bandwidth over an H100's, assumed 3.0e12 B/s (what gpu_decode measured on an
H100 80GB HBM3, SXM, 3.35 TB/s nominal: docs/benchmarks.md, reference machines); capacity by
the memory left beside the weights, (device memory - weight bytes) / (80 GB H100's 85.5e9 B -
weight bytes). Figures to read, never assertions.

`--budget-s` (default 360) bounds the whole run: a phase whose estimate no longer fits is
skipped (the JSON says so), and a batch run still going at the deadline is aborted and reported
as partial; a phase that raises (out of memory, say) is recorded under `errors` and the next one
runs. The JSON (`--json PATH`) is rewritten after every phase, so a run killed by a timeout
keeps what it measured.

    python -m benchmarks.gpu_seeds --json /tmp/seeds-8b.json                 # 8B bf16, <= 6 min
    python -m benchmarks.gpu_seeds --weights int4 --budget-s 150
    python -m benchmarks.gpu_seeds --shape 1b
    python -m benchmarks.gpu_seeds --shape tiny --device cpu --quick --json -  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.decode_latency import LLAMA_1B

REPO = Path(__file__).resolve().parent.parent

# Hugging Face config.json fields of each shape (the architecture and the rest are added).
SHAPES: dict[str, dict[str, Any]] = {
    "8b": {  # Meta-Llama-3-8B
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    # benchmarks.decode_latency's ~1.1B Llama (the figures measured before), with an 8K context
    "1b": {**LLAMA_1B, "max_position_embeddings": 8192},
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
    },
}
WEIGHTS = {"bf16": "none", "int8": "int8", "int4": "int4", "fp8": "fp8"}

# The seeds' H100 figures (issue 54), for the 8B shape only.
SEED_TOK_S = {"bf16": {32: 6100, 64: 9800}, "fp8": {32: 7800, 64: 13500}}
SEED_KV_BATCH_4K = {"bfloat16": 120, "int8": 240, "fp8_e4m3": 240}
# Assumed H100 (80GB HBM3, SXM): copy bandwidth as gpu_decode measured it (bytes read +
# written; 3.35 TB/s nominal) and its memory as torch reports it (81,559 MiB).
H100_COPY_BW = 3.0e12
H100_NOMINAL_BW = 3.35e12
H100_MEMORY = 85_520_809_984
KV_DTYPES = ("bfloat16", "int8", "fp8_e4m3")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the model directory -------------------------------------------------------------------------


def ensure_random_model(shape: str, root: Path, seed: int = 0) -> Path:
    """`root/random-<shape>`: config.json, the tiny demo model's tokenizer files and
    random_weights.json (the engine generates the weights on its device at load). Cheap: the
    tokenizer is trained once into `root/demo-tiny` (~2 s)."""
    from controlplane.engine.demo_model import write_demo_model
    from controlplane.engine.loader import RANDOM_WEIGHTS_FILE

    path = root / f"random-{shape}"
    demo = write_demo_model(root / "demo-tiny", size="tiny")
    demo_cfg = json.loads((demo / "config.json").read_text())
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "bos_token_id": demo_cfg["bos_token_id"],
        "eos_token_id": demo_cfg["eos_token_id"],
        **SHAPES[shape],
    }
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if not (path / name).is_file():
            shutil.copyfile(demo / name, path / name)
    (path / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed, "std": 0.02}) + "\n")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def device_defaults(device: str) -> dict[str, str]:
    """The engine settings of the GPU serving path on CUDA (bf16, Triton attention, the
    compiled step, CUDA graphs); the engine's CPU defaults elsewhere."""
    on_cuda = device == "cuda"
    return dict(
        dtype="bfloat16" if on_cuda else "auto",
        attention_backend="triton" if on_cuda else "torch",
        compile="on" if on_cuda else "off",
        cuda_graphs="auto" if on_cuda else "off",
    )


# -- measurements --------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """`dst.copy_(src)` on `device`, bytes read + written per second (median of 10 after 3)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.zeros_like(src)
    times = []
    for i in range(13):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        if i >= 3:
            times.append(seconds)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


class LogLines(logging.Handler):
    """The engine's INFO lines during construction (its load time, KV plan, compile)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.load_s: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.lines.append(f"{record.name}: {msg}")
        if msg.startswith("loaded ") and isinstance(record.args, tuple) and record.args:
            last = record.args[-1]
            if isinstance(last, float):
                self.load_s = last


class Run:
    """One engine and the figures measured on it; `out` is the JSON written after each phase."""

    def __init__(self, args: argparse.Namespace, out: dict[str, Any], t_start: float) -> None:
        self.args, self.out, self.t_start = args, out, t_start
        self.deadline = t_start + args.budget_s  # from the process's start: imports included
        self.gen = torch.Generator().manual_seed(0)
        self.eng: Any = None
        self.vocab = 0
        self.step_s: float | None = None  # one batch-1 decode step, once measured

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        self.out["elapsed_s"] = round(time.perf_counter() - self.t_start, 2)
        write_json(self.args.json, self.out)

    def skip(self, phase: str, why: str) -> None:
        log(f"[{phase}] skipped: {why}")
        self.out["skipped"][phase] = why
        self.save()

    def recover(self) -> None:
        """After a phase raised: abort what it left queued, free the allocator's cache."""
        for rid in list(self.eng.requests):
            self.eng.abort(rid)
        if self.args.device == "cuda":
            torch.cuda.empty_cache()

    def prompt(self, n: int) -> list[int]:
        return torch.randint(100, self.vocab - 1, (n,), generator=self.gen).tolist()

    def drain(self, rids: set[str]) -> tuple[int, dict[str, Any], bool]:
        """Step until every request in `rids` finished or the deadline passed (then abort the
        rest). Returns output tokens produced, the finished requests' metrics, and whether the
        run was cut short."""
        eng, produced, metrics, cut = self.eng, 0, {}, False
        while eng.has_unfinished_requests():
            if time.perf_counter() > self.deadline:
                for rid in list(eng.requests):
                    eng.abort(rid)
                cut = True
                break
            for o in eng.step():
                produced += len(o.new_token_ids)
                if o.finished and o.request_id in rids:
                    metrics[o.request_id] = o.metrics
        return produced, metrics, cut

    # -- phases ----------------------------------------------------------------------------------

    def build(self, model_dir: Path) -> bool:
        from controlplane.engine import Engine, InvalidSettingError

        a = self.args
        on_cuda = a.device == "cuda"
        d = device_defaults(a.device)
        settings = dict(
            model=str(model_dir),
            device=a.device,
            dtype=a.dtype or d["dtype"],
            quantization=WEIGHTS[a.weights],
            quantize_lm_head=a.quantize_lm_head,
            kv_cache_dtype=a.kv_cache_dtype,
            attention_backend=a.attention_backend or d["attention_backend"],
            compile=a.compile or d["compile"],
            cuda_graphs=d["cuda_graphs"],
            max_num_seqs=max(a.batches),
            max_num_batched_tokens=max(a.max_num_batched_tokens, max(a.batches)),
            prefill_chunk_size=a.prefill_chunk_size,
            gpu_memory_utilization=a.gpu_memory_utilization,
            kv_cache_memory_bytes=a.cpu_kv_bytes,
            enable_prefix_caching=False,
        )
        self.out["engine_settings"] = settings
        lines = LogLines()
        logger = logging.getLogger("controlplane")
        logger.addHandler(lines)
        old_level = logger.level
        logger.setLevel(logging.INFO)
        t0 = time.perf_counter()
        try:
            self.eng = Engine(**settings)
        except Exception as exc:
            # A format the engine refuses (a setting it does not know yet) or cannot build here
            # (no kernel for this device): reported, not raised. The bf16 model must build.
            refused = isinstance(exc, InvalidSettingError) and exc.field in (
                "quantization",
                "quantize_lm_head",
            )
            if not refused and a.weights == "bf16":
                raise
            why = f"{exc.field}: {exc.message}" if refused else f"{type(exc).__name__}: {exc}"
            self.out["available"] = False
            self.out["not_available"] = why
            log(f"--weights {a.weights}: not available ({why})")
            self.save()
            return False
        finally:
            logger.removeHandler(lines)
            logger.setLevel(old_level)
        if on_cuda:
            torch.cuda.synchronize()
        startup = time.perf_counter() - t0
        eng = self.eng
        self.vocab = eng.model_config.vocab_size
        from benchmarks.decode_latency import loaded_weight_bytes

        wbytes, wdtypes = loaded_weight_bytes(eng.model)
        spec = eng.kv_cache.spec
        self.out.update(
            available=True,
            startup_s=round(startup, 2),
            weights_load_s=lines.load_s,
            compile_and_capture_s=None
            if lines.load_s is None
            else round(startup - lines.load_s, 2),
            cuda_graphs=eng.runner.graphs is not None,
            weight_bytes=wbytes,
            weight_dtypes=wdtypes,
            params=eng.model_config.num_params,
            kv_cache_dtype=str(spec.dtype).removeprefix("torch."),
            kv_blocks=eng.block_pool.num_blocks,
            block_size=spec.block_size,
            engine_log=lines.lines[-12:],
        )
        if on_cuda:
            free, total = torch.cuda.mem_get_info()
            self.out.update(
                device_memory_bytes=total,
                free_after_start_bytes=free,
                reserved_unallocated_bytes=torch.cuda.memory_reserved()
                - torch.cuda.memory_allocated(),
            )
        log(
            f"[start-up] {startup:.1f} s (weights {lines.load_s or float('nan'):.1f} s, the rest "
            f"compile + capture); {wbytes / 1e9:.2f} GB of weights ({wdtypes}) read a token; "
            f"{eng.block_pool.num_blocks} KV blocks of {spec.block_size} tokens"
        )
        self.save()
        return True

    def warm_up(self) -> None:
        from controlplane.engine import SamplingParams

        t0 = time.perf_counter()
        n = min(self.args.ttft_prompt_len, self.eng.max_model_len - 8)
        self.eng.add_request(self.prompt(n), SamplingParams(max_tokens=4, ignore_eos=True))
        rids = {
            self.eng.add_request(self.prompt(32), SamplingParams(max_tokens=8, ignore_eos=True))
        }
        self.drain(rids)
        self.out["warmup_s"] = round(time.perf_counter() - t0, 2)
        log(f"[warm-up] {self.out['warmup_s']} s")
        self.save()

    def batch1(self, bandwidth: float) -> None:
        from controlplane.engine import SamplingParams

        a = self.args
        best, runs = 0.0, []
        params = SamplingParams(max_tokens=a.b1_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(a.repeats):
            if self.left() < 5:
                break
            rid = self.eng.add_request(self.prompt(32), params)
            _, metrics, cut = self.drain({rid})
            m = metrics.get(rid)
            if cut or m is None or m.num_output_tokens < 2:
                break
            tok_s = (m.num_output_tokens - 1) / (m.finish_time - m.first_token_time)
            runs.append(round(tok_s, 2))
            best = max(best, tok_s)
        if not runs:
            self.skip("batch1", "no complete run inside the time budget")
            return
        limit = bandwidth / self.out["weight_bytes"]
        self.step_s = 1 / best
        self.out["batch1"] = {
            "new_tokens": a.b1_tokens,
            "tok_s": round(best, 2),
            "runs": runs,
            "limit_tok_s": round(limit, 2),
            "of_limit": round(best / limit, 4),
            "target_of_limit": 0.85,
        }
        log(f"[batch 1] {best:.1f} tok/s = {best / limit:.1%} of the limit ({limit:.1f} tok/s)")
        self.save()

    def ttft(self) -> None:
        from controlplane.engine import SamplingParams

        a = self.args
        n = min(a.ttft_prompt_len, self.eng.max_model_len - 1)
        runs = []
        for _ in range(a.repeats):
            if self.left() < 5:
                break
            rid = self.eng.add_request(
                self.prompt(n), SamplingParams(max_tokens=1, ignore_eos=True)
            )
            _, metrics, cut = self.drain({rid})
            if cut or rid not in metrics:
                break
            runs.append(metrics[rid].ttft)
        if not runs:
            self.skip("ttft", "no complete run inside the time budget")
            return
        self.out["ttft"] = {
            "prompt_len": n,
            "s": round(statistics.median(runs), 4),
            "runs": [round(r, 4) for r in runs],
        }
        log(f"[TTFT] {n}-token prompt: {statistics.median(runs) * 1e3:.1f} ms")
        self.save()

    def kv_capacity(self) -> None:
        from controlplane.engine.kv_cache import STORAGE_DTYPES, KVCacheSpec

        eng, a = self.eng, self.args
        spec = eng.kv_cache.spec
        budget = eng.block_pool.num_blocks * spec.bytes_per_block
        per_seq_blocks = -(-a.kv_context // spec.block_size)
        rows = []
        memory = self.out.get("device_memory_bytes")
        w = self.out["weight_bytes"]
        mem_scale = (memory - w) / (H100_MEMORY - w) if memory else None
        for name in KV_DTYPES:
            s = KVCacheSpec.for_model(eng.model_config, spec.block_size, STORAGE_DTYPES[name])
            blocks = budget // s.bytes_per_block
            seed = SEED_KV_BATCH_4K[name] if a.shape == "8b" else None
            rows.append(
                {
                    "kv_dtype": name,
                    "bytes_per_token": s.bytes_per_block // spec.block_size,
                    "blocks": blocks,
                    "max_batch": blocks // per_seq_blocks,
                    "seed_h100": seed,
                    "seed_scaled": None
                    if seed is None or mem_scale is None
                    else round(seed * mem_scale, 1),
                }
            )
        self.out["kv_capacity"] = {"context": a.kv_context, "kv_budget_bytes": budget, "rows": rows}
        log(
            f"[KV] at {a.kv_context} tokens: "
            + ", ".join(f"{r['kv_dtype']} {r['max_batch']} seqs" for r in rows)
        )
        self.save()

    def batch(self, b: int, scale: float | None) -> None:
        from controlplane.engine import SamplingParams

        a = self.args
        key = f"batch{b}"
        if self.step_s is not None and "ttft" in self.out:
            per_prompt = self.out["ttft"]["s"] * a.prompt_len / self.out["ttft"]["prompt_len"]
            estimate = b * per_prompt + a.new_tokens * self.step_s * (1 + b / 32)
            if estimate > self.left():
                self.skip(key, f"estimated {estimate:.0f} s, {self.left():.0f} s left")
                return
        params = SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
        prompts = [self.prompt(a.prompt_len) for _ in range(b)]
        t0, w0 = time.perf_counter(), time.time()
        rids = {self.eng.add_request(p, params) for p in prompts}
        produced, metrics, cut = self.drain(rids)
        wall = time.perf_counter() - t0
        first = [m.first_token_time for m in metrics.values() if m.first_token_time]
        finish = [m.finish_time for m in metrics.values() if m.finish_time]
        decode_tok_s = None
        if not cut and first and finish and max(finish) > max(first):
            after = sum(m.num_output_tokens - 1 for m in metrics.values())
            decode_tok_s = round(after / (max(finish) - max(first)), 1)
        seed = SEED_TOK_S.get(a.weights, {}).get(b) if a.shape == "8b" else None
        seed_scaled = None if seed is None or scale is None else round(seed * scale, 1)
        out_tok_s = produced / wall
        row = {
            "batch": b,
            "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens,
            "output_tok_s": round(out_tok_s, 1),
            "total_tok_s": round((produced + b * a.prompt_len) / wall, 1) if not cut else None,
            "decode_tok_s": decode_tok_s,
            "wall_s": round(wall, 2),
            "first_token_after_s": round(max(first) - w0, 2) if first and not cut else None,
            "partial": cut,
            "seed_h100_tok_s": seed,
            "seed_scaled_tok_s": seed_scaled,
            "of_seed_scaled": None if not seed_scaled else round(out_tok_s / seed_scaled, 3),
        }
        self.out["batches"].append(row)
        log(
            f"[batch {b}] {out_tok_s:.0f} output tok/s over {wall:.1f} s"
            + (" (cut at the time budget)" if cut else "")
            + (f"; seeds' H100 {seed}, scaled {seed_scaled}" if seed else "")
        )
        self.save()


def write_json(dest: str | None, out: dict[str, Any]) -> None:
    if not dest or dest == "-":
        return
    Path(dest).write_text(json.dumps(out, indent=2) + "\n")


def commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except Exception:  # no git, or not a checkout (the device gets a copy of the tree)
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--weights", choices=sorted(WEIGHTS), default="bf16")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument(
        "--dtype", default=None, help="default: bfloat16 on CUDA, the engine's auto on a CPU"
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="the served cache (auto: the dtype)")
    p.add_argument("--quantize-lm-head", action="store_true", help="with --weights int8/int4")
    p.add_argument(
        "--attention-backend", default=None, help="default: triton on CUDA, torch on CPU"
    )
    p.add_argument("--compile", default=None, help="default: on on CUDA, off on a CPU")
    p.add_argument("--batches", default="32,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=None, help="2048; 64 with --quick")
    p.add_argument("--new-tokens", type=int, default=None, help="512; 8 with --quick")
    p.add_argument(
        "--b1-tokens", type=int, default=None, help="batch-1 tokens: 256; 16 with --quick"
    )
    p.add_argument("--ttft-prompt-len", type=int, default=None, help="2048; 64 with --quick")
    p.add_argument("--kv-context", type=int, default=4096, help="context of the capacity figure")
    p.add_argument("--repeats", type=int, default=2, help="batch-1 and TTFT: best / median of")
    p.add_argument("--quick", action="store_true", help="short prompts and outputs (smoke run)")
    p.add_argument("--budget-s", type=float, default=360.0, help="the whole run's time budget")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--cpu-kv-bytes", type=int, default=64 << 20, help="KV budget on a CPU")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--prefill-chunk-size", type=int, default=2048)
    p.add_argument("--model-root", type=Path, default=REPO / ".bench", help="model directories")
    p.add_argument("--json", default=None, help="write the figures here ('-': to stdout only)")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, short in (
        ("prompt_len", 2048, 64),
        ("new_tokens", 512, 8),
        ("b1_tokens", 256, 16),
        ("ttft_prompt_len", 2048, 64),
    ):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_seeds: no CUDA device (try --device cpu --shape tiny --quick)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "commit": commit(),
        "shape": args.shape,
        "weights": args.weights,
        "quick": args.quick,
        "budget_s": args.budget_s,
        "available": None,
        "skipped": {},
        "errors": {},
        "batches": [],
        "assumed_h100": {
            "copy_bandwidth_Bps": H100_COPY_BW,
            "nominal_bandwidth_Bps": H100_NOMINAL_BW,
            "memory_bytes": H100_MEMORY,
        },
    }
    cpu_bytes = (64 << 20) if args.quick else (256 << 20)  # past the last-level cache either way
    bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else cpu_bytes)
    scale = bw / H100_COPY_BW if device.type == "cuda" else None
    out.update(
        copy_bandwidth_Bps=round(bw), bandwidth_scale=None if scale is None else round(scale, 3)
    )
    log(
        f"{name}: copy bandwidth {bw / 1e9:.0f} GB/s"
        + (f" = {scale:.2f}x the assumed H100's {H100_COPY_BW / 1e12:.1f} TB/s" if scale else "")
    )
    run = Run(args, out, t_start)
    model_dir = ensure_random_model(args.shape, args.model_root)
    if run.build(model_dir):
        phases = [
            ("warm-up", run.warm_up),
            ("batch1", lambda: run.batch1(bw)),
            ("ttft", run.ttft),
            ("kv_capacity", run.kv_capacity),
            *((f"batch{b}", lambda b=b: run.batch(b, scale)) for b in args.batches),
        ]
        for phase, fn in phases:
            if run.left() <= 0 and phase != "kv_capacity":  # arithmetic: always
                run.skip(phase, "time budget spent")
                continue
            try:
                fn()
            except Exception as exc:  # say, out of memory at batch 64: the next phases still run
                log(f"[{phase}] failed: {type(exc).__name__}: {exc}")
                out["errors"][phase] = f"{type(exc).__name__}: {str(exc)[:500]}"
                run.recover()
                run.save()
    out["total_s"] = round(time.perf_counter() - t_start, 2)
    write_json(args.json, out)
    # With `--json -` the JSON alone goes to stdout, the table to stderr.
    print_table(out, sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        print(json.dumps(out, indent=2))
    return 0


def _fmt(v: Any, spec: str = ",.1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(out: dict[str, Any], stream: Any) -> None:
    def p(line: str) -> None:
        print(line, file=stream)

    p(f"\n{out['device']}, {out['shape']} shape, {out['weights']} weights")
    if not out.get("available"):
        p(f"  not available: {out.get('not_available', 'the engine was not built')}")
        return
    p(
        f"  start-up {out['startup_s']:.1f} s (weights {_fmt(out.get('weights_load_s'))} s), "
        f"warm-up {_fmt(out.get('warmup_s'))} s; copy {out['copy_bandwidth_Bps'] / 1e12:.3f} TB/s"
    )
    b1 = out.get("batch1")
    if b1:
        p(
            f"  batch 1: {b1['tok_s']:,.1f} tok/s, {b1['of_limit']:.1%} of the limit "
            f"({b1['limit_tok_s']:,.1f} tok/s; target 85%)"
        )
    if out.get("ttft"):
        p(f"  TTFT, {out['ttft']['prompt_len']}-token prompt: {out['ttft']['s'] * 1e3:,.1f} ms")
    for r in out["batches"]:
        p(
            f"  batch {r['batch']} ({r['prompt_len']} + {r['new_tokens']}): "
            f"{r['output_tok_s']:,.1f} output tok/s{' (partial)' if r['partial'] else ''}; "
            f"seeds' H100 {_fmt(r['seed_h100_tok_s'], ',')}, scaled {_fmt(r['seed_scaled_tok_s'])}"
        )
    kv = out.get("kv_capacity")
    if kv:
        for r in kv["rows"]:
            p(
                f"  KV {r['kv_dtype']}: {r['max_batch']:,} seqs at {kv['context']} tokens; "
                f"seeds' H100 {_fmt(r['seed_h100'], ',')}, scaled {_fmt(r['seed_scaled'])}"
            )
    for phase, why in out["skipped"].items():
        p(f"  {phase}: skipped ({why})")
    for phase, why in out["errors"].items():
        p(f"  {phase}: failed ({why})")


if __name__ == "__main__":
    sys.exit(main())
