"""Offline mixed-workload throughput: our engine vs. transformers static and continuous batching.

What is measured
----------------
One synthetic offline workload (default: 128 requests, seed 0) on one model, all requests
arriving at once: prompt lengths uniform in [32, 512] tokens (random token ids drawn with the
seed from the vocabulary, special ids excluded), output lengths uniform in [16, 512] tokens, EOS
ignored, greedy decoding. Three contenders run on the same weights, in the same dtype and with
the same number of torch threads, interleaved, ``--repeats`` times (medians are reported):

* ``engine``: ``controlplane.engine.LLM.generate`` (constructed once, outside the timed region).
* ``static``: transformers ``generate`` in static batches of ``--batch-size`` requests, in
  order, left-padded, each batch running until its longest member is done.
* ``cb``: transformers continuous batching (``init_continuous_batching`` manager, one
  ``add_request`` per request with that request's own ``max_new_tokens``).

Figures, per contender: useful output tokens/s (sum of every request's own output length divided
by the wall time from first submission to last completion), the ratios engine/static and
engine/cb, TTFT p50/p99, inter-token latency (ITL) p50/p99, and the achieved model FLOP/s as a
fraction of a matmul peak measured in the same run (best of a few 2048x2048x2048 ``torch.matmul``
in the benchmark dtype). Model FLOPs are counted over useful tokens only: per token,
2 x non-embedding parameters (lm_head included) + 4 x layers x hidden x context length.

These are figures to read, never timed assertions: the machine is shared and noisy, which is why
the contenders are interleaved and compared within one run.

How to run
----------
    python -m benchmarks.offline_throughput                        # full run, ~tens of minutes
    python -m benchmarks.offline_throughput --num-requests 16 --repeats 1   # smoke run
    python -m benchmarks.offline_throughput --contenders static,cb --json /tmp/offline.json

The default model directory ``.bench/small`` (repo root) is created on first use with
``controlplane.engine.demo_model.write_demo_model(path, size="small")``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / ".bench" / "small"
ALL_CONTENDERS = ("engine", "static", "cb")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def auto_dtype() -> str:
    """The engine's dtype "auto" for a 16-bit checkpoint on this CPU: bfloat16 only where the CPU
    has native bf16 (AVX512-BF16 or AMX), float32 elsewhere (emulated bf16 is many times slower
    and would make the figures meaningless)."""
    try:
        from controlplane.engine.model.linear import cpu_has_native_bf16
    except Exception:  # the engine does not import: its contender is reported as skipped
        return "float32"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------- #
# Workload and model facts
# --------------------------------------------------------------------------------------------- #


@dataclass
class Workload:
    prompts: list[list[int]]
    out_lens: list[int]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def useful_output_tokens(self) -> int:
        return sum(self.out_lens)


@dataclass
class ModelFacts:
    vocab_size: int
    special_ids: list[int]
    num_layers: int
    hidden_size: int
    non_embedding_params: int
    pad_token_id: int

    def flops(self, prompt_len: int, out_len: int) -> float:
        """Model FLOPs for one request: every prompt and output token at its own context length."""
        n = prompt_len + out_len
        dense = 2.0 * self.non_embedding_params * n
        # Token at position t (1-based) attends to t tokens: sum_{t=1..n} t = n(n+1)/2.
        attention = 4.0 * self.num_layers * self.hidden_size * n * (n + 1) / 2.0
        return dense + attention


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def _safetensors_shapes(model_dir: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    shapes: dict[str, list[int]] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                shapes[key] = list(f.get_slice(key).get_shape())
    return shapes


def load_model_facts(model_dir: Path) -> ModelFacts:
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    vocab = int(text_config["vocab_size"])
    hidden = int(text_config["hidden_size"])
    layers = int(text_config["num_hidden_layers"])

    special: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        special.update(_ids(text_config.get(key)))
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.exists():
        gen = json.loads(gen_cfg.read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            special.update(_ids(gen.get(key)))
    tok_json = model_dir / "tokenizer.json"
    if tok_json.exists():
        tok = json.loads(tok_json.read_text())
        special.update(int(t["id"]) for t in tok.get("added_tokens", []) if t.get("special"))
        tok_vocab = len(tok.get("model", {}).get("vocab", {})) + len(tok.get("added_tokens", []))
        if 0 < tok_vocab < vocab:
            # Stay inside what the tokenizer can detokenize (an engine may decode text).
            vocab = tok_vocab
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.exists():
        decoder = json.loads(tok_cfg.read_text()).get("added_tokens_decoder", {})
        special.update(int(k) for k, v in decoder.items() if v.get("special"))

    shapes = _safetensors_shapes(model_dir)
    non_embedding = 0
    has_lm_head = False
    for key, shape in shapes.items():
        if key.endswith("embed_tokens.weight"):
            continue
        has_lm_head |= key.endswith("lm_head.weight")
        non_embedding += math.prod(shape)
    if not has_lm_head:  # tied embeddings: the lm_head matmul still runs over the whole table
        non_embedding += int(text_config["vocab_size"]) * hidden

    pad = _ids(text_config.get("pad_token_id")) or _ids(text_config.get("eos_token_id")) or [0]
    return ModelFacts(
        vocab_size=vocab,
        special_ids=sorted(special),
        num_layers=layers,
        hidden_size=hidden,
        non_embedding_params=non_embedding,
        pad_token_id=pad[0],
    )


def make_workload(facts: ModelFacts, num_requests: int, seed: int) -> Workload:
    rng = random.Random(seed)
    special = set(facts.special_ids)
    allowed = [i for i in range(facts.vocab_size) if i not in special]
    prompt_lens = [rng.randint(32, 512) for _ in range(num_requests)]
    out_lens = [rng.randint(16, 512) for _ in range(num_requests)]
    prompts = [[rng.choice(allowed) for _ in range(n)] for n in prompt_lens]
    return Workload(prompts=prompts, out_lens=out_lens)


def ensure_model_dir(model_dir: Path) -> Path:
    if model_dir.resolve() != DEFAULT_MODEL_DIR:
        if not (model_dir / "config.json").exists():
            sys.exit(f"--model-dir {model_dir}: no config.json there")
        return model_dir
    path = DEFAULT_MODEL_DIR
    try:
        from controlplane.engine.demo_model import write_demo_model
    except Exception as exc:
        if (path / "config.json").exists():
            log(f"warning: cannot import write_demo_model ({exc!r}); using {path} as it is")
            return path
        sys.exit(f"{path} does not exist and write_demo_model cannot be imported ({exc!r})")
    # Idempotent: returns at once when the directory already holds the complete demo model.
    t0 = time.perf_counter()
    write_demo_model(path, size="small")
    if time.perf_counter() - t0 > 1.0:
        log(f"wrote demo model (size=small) to {path} in {time.perf_counter() - t0:.0f}s")
    return path


# --------------------------------------------------------------------------------------------- #
# Statistics
# --------------------------------------------------------------------------------------------- #


def median_or_none(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def measure_matmul_peak(dtype: torch.dtype, size: int = 2048, reps: int = 6) -> float:
    """Best-of-`reps` FLOP/s of a size^3 torch.matmul in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    for _ in range(2):
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


# --------------------------------------------------------------------------------------------- #
# Contenders
# --------------------------------------------------------------------------------------------- #


@dataclass
class RunResult:
    wall_s: float
    ttft_s: list[float | None]
    itl_s: list[float | None]
    output_lens: list[int]  # generated tokens per request, as returned
    first_tokens: list[int | None]
    num_preemptions: int | None = None
    notes: list[str] = field(default_factory=list)


class EngineContender:
    name = "engine"

    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        from controlplane.engine import LLM, SamplingParams

        self._sampling_params = SamplingParams
        t0 = time.perf_counter()
        self.llm = LLM(
            str(model_dir),
            dtype=args.dtype,
            device="cpu",
            max_num_seqs=args.batch_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefill_chunk_size=args.prefill_chunk_size,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        )
        log(f"  [engine] LLM constructed in {time.perf_counter() - t0:.1f}s")
        self.describe = (
            f"controlplane.engine.LLM(max_num_seqs={args.batch_size}, "
            f"max_num_batched_tokens={args.max_num_batched_tokens}, "
            f"prefill_chunk_size={args.prefill_chunk_size}, "
            f"kv_cache_memory_bytes={args.kv_cache_memory_bytes})"
        )

    def run(self, workload: Workload) -> RunResult:
        params = [
            self._sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
            for n in workload.out_lens
        ]
        t0 = time.perf_counter()
        outs = self.llm.generate(workload.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ttft, itl, lens, first, preempt = [], [], [], [], 0
        for out in outs:
            m = out.metrics
            ttft.append(m.first_token_time - m.arrival_time)
            n = m.num_output_tokens
            itl.append((m.finish_time - m.first_token_time) / (n - 1) if n > 1 else None)
            lens.append(len(out.token_ids))
            first.append(out.token_ids[0] if len(out.token_ids) else None)
            preempt += m.num_preemptions
        return RunResult(wall, ttft, itl, lens, first, num_preemptions=preempt)


class _StepTimer:
    """LogitsProcessor-compatible hook: records perf_counter() at every generation step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


class StaticContender:
    name = "static"

    def __init__(self, args: argparse.Namespace, model_dir: Path, facts: ModelFacts) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=DTYPES[args.dtype], attn_implementation="sdpa"
        ).eval()
        self.batch_size = args.batch_size
        self.pad_id = facts.pad_token_id
        self.describe = (
            f"transformers generate, static batches of {args.batch_size}, left padding, sdpa, "
            "max_new_tokens=min_new_tokens=max of batch"
        )

    def run(self, workload: Workload) -> RunResult:
        from transformers import GenerationConfig, LogitsProcessorList

        n = len(workload.prompts)
        ttft: list[float | None] = [None] * n
        itl: list[float | None] = [None] * n
        lens = [0] * n
        first: list[int | None] = [None] * n
        t_start = time.perf_counter()
        for lo in range(0, n, self.batch_size):
            idx = list(range(lo, min(lo + self.batch_size, n)))
            width = max(len(workload.prompts[i]) for i in idx)
            input_ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                p = workload.prompts[i]
                input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p) :] = 1
            steps = max(workload.out_lens[i] for i in idx)
            timer = _StepTimer()
            gen_cfg = GenerationConfig(
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                pad_token_id=self.pad_id,
            )
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                generation_config=gen_cfg,
                logits_processor=LogitsProcessorList([timer]),
            )
            new = out[:, width:]
            batch_ttft = timer.times[0] - t_start
            batch_itl = (timer.times[-1] - timer.times[0]) / (steps - 1) if steps > 1 else None
            for row, i in enumerate(idx):
                ttft[i] = batch_ttft
                itl[i] = batch_itl
                # Every row runs for the batch's `steps`; a request's useful part is its own
                # out_len. -1 flags a batch that stopped short of `steps`.
                lens[i] = workload.out_lens[i] if new.shape[1] == steps else -1
                first[i] = int(new[row, 0]) if new.shape[1] else None
        wall = time.perf_counter() - t_start
        return RunResult(wall, ttft, itl, lens, first)


class CBContender:
    name = "cb"

    def __init__(
        self, args: argparse.Namespace, model_dir: Path, facts: ModelFacts, workload: Workload
    ) -> None:
        import transformers.generation.continuous_batching  # noqa: F401 - check it exists
        from transformers import AutoModelForCausalLM

        try:
            import psutil  # noqa: F401 - transformers' CB needs it on CPU
        except ImportError as exc:
            raise RuntimeError("transformers continuous batching needs psutil") from exc

        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=DTYPES[args.dtype], attn_implementation=args.cb_attn
        ).eval()
        self.batch_size = args.batch_size
        self.max_batch_tokens = args.max_num_batched_tokens
        self.page_size = args.cb_page_size
        max_seq = max(len(p) for p in workload.prompts) + max(workload.out_lens)
        blocks_per_req = math.ceil(max_seq / self.page_size) + 1
        # Room for B concurrent longest requests, doubled so the FIFO scheduler's safety margin
        # (15% free blocks) never throttles prefill and nothing is ever evicted.
        self.num_blocks = args.cb_num_blocks or 2 * args.batch_size * blocks_per_req
        self.describe = (
            f"transformers continuous batching (manager API: init_continuous_batching + "
            f"add_request(max_new_tokens=<per request>)), attn={args.cb_attn}, "
            f"max_requests_per_batch={args.batch_size}, max_batch_tokens={self.max_batch_tokens}, "
            f"num_blocks={self.num_blocks}, page_size={self.page_size}"
        )

    def run(self, workload: Workload) -> RunResult:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        if torch.is_inference_mode_enabled():
            raise RuntimeError("CB returns empty results under torch.inference_mode()")
        n = len(workload.prompts)
        gen_cfg = GenerationConfig(
            do_sample=False, max_new_tokens=max(workload.out_lens), eos_token_id=-1
        )
        cb_cfg = ContinuousBatchingConfig(
            page_size=self.page_size,
            num_blocks=self.num_blocks,
            max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.batch_size,
            allow_block_sharing=False,  # random prompts share no prefix; keep it off for fairness
            auto_switch_to_flash=False,
            seed=0,
        )
        hints = WorkloadHints(
            max_prompt_length=max(len(p) for p in workload.prompts),
            max_generated_length=max(workload.out_lens),
            num_requests=n,
        )
        # Manager construction, cache allocation (warmup) and thread start are outside the timing.
        manager = self.model.init_continuous_batching(
            generation_config=gen_cfg, continuous_batching_config=cb_cfg, workload_hints=hints
        )
        results: dict[str, Any] = {}
        try:
            manager.warmup()
            manager.start()
            t0 = time.perf_counter()
            for i, (prompt, max_new) in enumerate(
                zip(workload.prompts, workload.out_lens, strict=True)
            ):
                manager.add_request(
                    prompt,
                    request_id=f"req{i}",
                    max_new_tokens=max_new,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
            while len(results) < n:
                res = manager.get_result(timeout=1.0)
                if res is None:
                    if not manager.is_running():
                        break
                    continue
                if res.is_finished():
                    results[res.request_id] = res
            wall = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()

        notes = []
        if len(results) < n:
            notes.append(f"only {len(results)}/{n} results came back")
        ttft: list[float | None] = []
        itl: list[float | None] = []
        lens: list[int] = []
        first: list[int | None] = []
        for i in range(n):
            res = results.get(f"req{i}")
            if res is None or res.error is not None:
                if res is not None:
                    notes.append(f"req{i} failed: {res.error}")
                ttft.append(None)
                itl.append(None)
                lens.append(0)
                first.append(None)
                continue
            toks = list(res.generated_tokens)
            stamps = res.timestamps or []
            lens.append(len(toks))
            first.append(toks[0] if toks else None)
            ttft.append(stamps[0] - t0 if stamps else None)
            itl.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None)
        return RunResult(wall, ttft, itl, lens, first, notes=notes)


# --------------------------------------------------------------------------------------------- #
# Driver
# --------------------------------------------------------------------------------------------- #


def warmup_workload(facts: ModelFacts, batch_size: int) -> Workload:
    rng = random.Random(1234)
    special = set(facts.special_ids)
    allowed = [i for i in range(facts.vocab_size) if i not in special]
    n = min(4, batch_size)
    prompts = [[rng.choice(allowed) for _ in range(rng.randint(16, 64))] for _ in range(n)]
    return Workload(prompts=prompts, out_lens=[rng.randint(4, 12) for _ in range(n)])


def summarize(
    name: str, runs: list[RunResult], workload: Workload, total_flops: float, peak: float
) -> dict[str, Any]:
    # Here, not at the top: the baselines still run when controlplane fails to import.
    from controlplane.common import percentile

    useful = workload.useful_output_tokens
    walls = [r.wall_s for r in runs]
    tps = [useful / w for w in walls]
    per_run = []
    for r in runs:
        ttft = [v for v in r.ttft_s if v is not None]
        itl = [v for v in r.itl_s if v is not None]
        per_run.append(
            {
                "wall_s": r.wall_s,
                "useful_tokens_per_s": useful / r.wall_s,
                "ttft_p50_s": percentile(ttft, 50),
                "ttft_p99_s": percentile(ttft, 99),
                "itl_p50_s": percentile(itl, 50),
                "itl_p99_s": percentile(itl, 99),
                "num_preemptions": r.num_preemptions,
                "valid": all(
                    n == want for n, want in zip(r.output_lens, workload.out_lens, strict=True)
                ),
                "notes": r.notes,
            }
        )
    med_wall = statistics.median(walls)
    return {
        "name": name,
        "useful_tokens_per_s": statistics.median(tps),
        "wall_s": med_wall,
        "ttft_p50_s": median_or_none([p["ttft_p50_s"] for p in per_run]),
        "ttft_p99_s": median_or_none([p["ttft_p99_s"] for p in per_run]),
        "itl_p50_s": median_or_none([p["itl_p50_s"] for p in per_run]),
        "itl_p99_s": median_or_none([p["itl_p99_s"] for p in per_run]),
        "model_flops_per_s": total_flops / med_wall,
        "fraction_of_matmul_peak": total_flops / med_wall / peak,
        "num_preemptions": [p["num_preemptions"] for p in per_run],
        "all_valid": all(p["valid"] for p in per_run),
        "runs": per_run,
    }


def _fmt(v: float | None, scale: float = 1.0, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v * scale, spec)


def print_table(summary: dict[str, Any]) -> None:
    rows = summary["contenders"]
    log("")
    log("=" * 100)
    log(
        f"Offline throughput, {summary['workload']['num_requests']} requests, "
        f"dtype={summary['dtype']}, threads={summary['torch_threads']}, "
        f"medians of {summary['repeats']} repeats"
    )
    log(
        f"matmul peak ({summary['dtype']}, 2048^3, best of 6): "
        f"{summary['matmul_peak_flops'] / 1e9:.1f} GFLOP/s; "
        f"useful output tokens per run: {summary['workload']['useful_output_tokens']}"
    )
    header = (
        f"{'contender':<9} {'tok/s':>9} {'wall s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'MFU':>7} {'preempt':>8} {'valid':>6}"
    )
    log(header + "   (latencies in ms)")
    log("-" * len(header))
    for name, row in rows.items():
        if "error" in row:
            log(f"{name:<9} skipped: {row['error']}")
            continue
        pre = row["num_preemptions"]
        pre_s = "n/a" if all(p is None for p in pre) else str(max(p or 0 for p in pre))
        log(
            f"{name:<9} {row['useful_tokens_per_s']:>9.1f} {row['wall_s']:>8.1f} "
            f"{_fmt(row['ttft_p50_s'], 1e3):>9} {_fmt(row['ttft_p99_s'], 1e3):>9} "
            f"{_fmt(row['itl_p50_s'], 1e3):>8} {_fmt(row['itl_p99_s'], 1e3):>8} "
            f"{row['fraction_of_matmul_peak'] * 100:>6.1f}% {pre_s:>8} "
            f"{'yes' if row['all_valid'] else 'NO':>6}"
        )
    for key, val in summary["ratios"].items():
        log(f"ratio {key}: {'n/a' if val is None else f'{val:.2f}x'}")
    for name, row in rows.items():
        if "describe" in row:
            log(f"  {name}: {row['describe']}")
    for key, val in summary.get("first_token_agreement", {}).items():
        log(f"  first-token agreement {key}: {val * 100:.0f}% (informational; bf16 ties differ)")
    log("=" * 100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Offline mixed-workload throughput of controlplane's engine vs. transformers static "
            "batching and transformers continuous batching (figures, not assertions)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="model directory; the default one is created with write_demo_model(size='small')",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=auto_dtype(),
        help="weights dtype (default: bfloat16 with native bf16, else float32)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per contender (medians)")
    p.add_argument("--num-requests", type=int, default=128, help="requests in the workload")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--batch-size", type=int, default=16, help="B: max concurrent sequences")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=1024,
        help="T: engine max_num_batched_tokens, also cb max_batch_tokens",
    )
    p.add_argument("--prefill-chunk-size", type=int, default=512, help="C: engine prefill chunk")
    p.add_argument(
        "--kv-cache-memory-bytes", type=int, default=2 * 1024**3, help="M: engine KV cache budget"
    )
    p.add_argument(
        "--contenders",
        default=",".join(ALL_CONTENDERS),
        help="comma-separated subset of: " + ", ".join(ALL_CONTENDERS),
    )
    p.add_argument(
        "--cb-attn",
        choices=["sdpa", "paged|eager"],
        default="sdpa",
        help="attention implementation for transformers CB (sdpa was faster on CPU)",
    )
    p.add_argument("--cb-page-size", type=int, default=256, help="transformers CB page size")
    p.add_argument(
        "--cb-num-blocks",
        type=int,
        default=0,
        help="transformers CB cache blocks (0: 2 x B x blocks of the longest request)",
    )
    p.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads"
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write summary JSON")
    args = p.parse_args(argv)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    for c in args.contenders:
        if c not in ALL_CONTENDERS:
            p.error(f"unknown contender {c!r}")
    if args.repeats < 1 or args.num_requests < 1 or args.batch_size < 1:
        p.error("--repeats, --num-requests and --batch-size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    import transformers

    log(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"torch threads={torch.get_num_threads()}, cpus={os.cpu_count()}"
    )
    model_dir = ensure_model_dir(args.model_dir)
    facts = load_model_facts(model_dir)
    workload = make_workload(facts, args.num_requests, args.seed)
    total_flops = sum(
        facts.flops(p, o) for p, o in zip(workload.prompt_lens, workload.out_lens, strict=True)
    )
    log(
        f"model {model_dir}: {facts.num_layers} layers, hidden {facts.hidden_size}, "
        f"{facts.non_embedding_params / 1e6:.1f}M non-embedding params (lm_head included), "
        f"vocab used {facts.vocab_size}, special ids excluded {facts.special_ids}"
    )
    log(
        f"workload: {args.num_requests} requests, seed {args.seed}, prompt tokens "
        f"{sum(workload.prompt_lens)}, useful output tokens {workload.useful_output_tokens}, "
        f"useful model FLOPs {total_flops / 1e12:.2f} TFLOP"
    )

    log(f"measuring {args.dtype} matmul peak ...")
    peak = measure_matmul_peak(dtype)
    log(f"  peak {peak / 1e9:.1f} GFLOP/s")

    contenders: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name in args.contenders:
        log(f"[{name}] setting up ...")
        try:
            if name == "engine":
                try:
                    import controlplane.engine  # noqa: F401
                except Exception as exc:
                    errors[name] = f"import controlplane.engine failed: {exc!r}"
                    log(f"[engine] SKIPPED: {errors[name]}")
                    continue
                contenders[name] = EngineContender(args, model_dir)
            elif name == "static":
                contenders[name] = StaticContender(args, model_dir, facts)
            else:
                contenders[name] = CBContender(args, model_dir, facts, workload)
        except Exception as exc:
            traceback.print_exc()
            errors[name] = f"setup failed: {exc!r}"
            log(f"[{name}] SKIPPED: {errors[name]}")
            continue
        log(f"[{name}] warmup ...")
        try:
            torch.manual_seed(args.seed)
            contenders[name].run(warmup_workload(facts, args.batch_size))
        except Exception as exc:
            traceback.print_exc()
            errors[name] = f"warmup failed: {exc!r}"
            log(f"[{name}] SKIPPED: {errors[name]}")
            del contenders[name]

    runs: dict[str, list[RunResult]] = {name: [] for name in contenders}
    order = list(contenders)
    for rep in range(args.repeats):
        # Rotate the order every repeat so no contender always runs first (or right after another).
        rot = order[rep % len(order) :] + order[: rep % len(order)] if order else []
        for name in rot:
            if name in errors:
                continue
            log(f"[{name}] repeat {rep + 1}/{args.repeats} ...")
            torch.manual_seed(args.seed)
            try:
                res = contenders[name].run(workload)
            except Exception as exc:
                traceback.print_exc()
                errors[name] = f"repeat {rep + 1} failed: {exc!r}"
                log(f"[{name}] dropped: {errors[name]}")
                continue
            runs[name].append(res)
            bad = sum(n != want for n, want in zip(res.output_lens, workload.out_lens, strict=True))
            extra = (
                f", preemptions {res.num_preemptions}" if res.num_preemptions is not None else ""
            )
            log(
                f"[{name}] repeat {rep + 1}: wall {res.wall_s:.1f}s, "
                f"{workload.useful_output_tokens / res.wall_s:.1f} useful tok/s"
                f"{extra}" + (f", {bad} requests with a WRONG output length" if bad else "")
            )
            for note in res.notes[:5]:
                log(f"[{name}]   note: {note}")

    summary: dict[str, Any] = {
        "benchmark": "offline_throughput",
        "model_dir": str(model_dir),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "settings": {
            "batch_size": args.batch_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "prefill_chunk_size": args.prefill_chunk_size,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
            "cb_attn": args.cb_attn,
        },
        "workload": {
            "num_requests": args.num_requests,
            "seed": args.seed,
            "prompt_tokens": sum(workload.prompt_lens),
            "useful_output_tokens": workload.useful_output_tokens,
            "useful_model_flops": total_flops,
        },
        "model": asdict(facts) | {"special_ids": facts.special_ids},
        "matmul_peak_flops": peak,
        "contenders": {},
        "ratios": {},
    }
    for name in args.contenders:
        if runs.get(name):
            row = summarize(name, runs[name], workload, total_flops, peak)
            row["describe"] = contenders[name].describe
            if name in errors:
                row["error"] = errors[name]
            summary["contenders"][name] = row
        else:
            summary["contenders"][name] = {"error": errors.get(name, "no successful run")}

    def tps(name: str) -> float | None:
        row = summary["contenders"].get(name, {})
        return row.get("useful_tokens_per_s")

    for other in ("static", "cb"):
        a, b = tps("engine"), tps(other)
        summary["ratios"][f"engine/{other}"] = a / b if a and b else None
    # Informational sanity check: greedy first tokens against the static baseline.
    agreement = {}
    if runs.get("static"):
        ref = runs["static"][0].first_tokens
        for name in ("engine", "cb"):
            if runs.get(name):
                got = runs[name][0].first_tokens
                same = sum(a is not None and a == b for a, b in zip(got, ref, strict=True))
                agreement[f"{name} vs static"] = same / len(ref)
    summary["first_token_agreement"] = agreement

    print_table(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
        log(f"summary written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
