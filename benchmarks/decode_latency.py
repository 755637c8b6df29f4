"""Batch-1 greedy decode speed of a ~1.1B Llama: our engine vs. transformers ``generate``.

What is measured
----------------
One request, a 32-token prompt (random token ids from a fixed seed, special ids excluded), 128
new tokens, greedy, EOS ignored, in ``--dtype`` (default: bfloat16 where the CPU has native bf16,
float32 elsewhere), on a ~1.1B-parameter Llama configuration (hidden 2048,
16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab 32000, untied embeddings) with random
weights from a fixed seed. Two contenders, interleaved, ``--repeats`` times (medians reported):

* ``engine``: ``controlplane.engine.LLM.generate``; decode tokens/s = (n - 1) /
  (finish_time - first_token_time) from the request's own metrics.
* ``transformers``: ``AutoModelForCausalLM.generate`` (max_new_tokens = min_new_tokens = 128);
  decode tokens/s = (n - 1) / (time of the last step - time of the first step), both stamped by
  a logits-processor hook that runs at every generation step.

Both are also shown as a fraction of the memory-bandwidth limit: copy bandwidth / weight bytes,
where weight bytes are the bytes of the weights as each contender loaded them (in ``--dtype``,
packed oneDNN weights included), read once per token: every parameter, buffer and packed weight
except the input embedding table (only indexed) and rotary tables. A float32 run reads twice the
bytes of the bf16 checkpoint on disk, so the checkpoint's size would halve its "of limit". Copy
bandwidth is measured in the same run by timing ``dst.copy_(src)`` on 1 GiB tensors (best of
several), counting bytes read + bytes written (2 x 1 GiB per copy). A decode step only reads
its weights, so the read bandwidth (``src.sum()`` over 1 GiB, best of several) is shown beside
it (on a 2-core Zen 4 VM about the copy figure: 33.4 against 32.2 GB/s). Both are probed
again after every round of repeats, and each repeat is held against the mean of the probes
either side of it ("of limit" is the median of those fractions): on a shared VM the bandwidth
swung between ~46 and ~80 GB/s within a minute, so one probe at the start put the same code's
decode speed at 59% or at 91% of its limit. The target for the engine is >= 1.3x transformers.

These are figures to read, never timed assertions.

How to run
----------
    python -m benchmarks.decode_latency                     # ~5 minutes, 3 repeats
    python -m benchmarks.decode_latency --repeats 1 --contenders transformers
    python -m benchmarks.decode_latency --json /tmp/decode.json
    python -m benchmarks.decode_latency --contenders engine --engine compile=on

The checkpoint is generated once into ``.bench/llama-1b`` (repo root; ~2.2 GB: config.json,
model.safetensors written directly with safetensors from a seeded torch.Generator, plus the
tokenizer files of the ``small`` demo model, written with
``controlplane.engine.demo_model.write_demo_model`` into ``.bench/small`` if missing, or a
byte-level ``tokenizers`` BPE if that module cannot be imported).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / ".bench" / "llama-1b"
SMALL_DEMO_DIR = REPO_ROOT / ".bench" / "small"
ALL_CONTENDERS = ("engine", "transformers")
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


TARGET_RATIO = 1.3

LLAMA_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHT_SEED = 0


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------- #
# Checkpoint
# --------------------------------------------------------------------------------------------- #


def _parameter_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return shapes


def _tokenizer_source() -> Path:
    """The small demo model's directory, written if missing, for its tokenizer files."""
    if not all((SMALL_DEMO_DIR / f).exists() for f in (*TOKENIZER_FILES, "config.json")):
        from controlplane.engine.demo_model import write_demo_model

        log(f"writing the small demo model to {SMALL_DEMO_DIR} for its tokenizer ...")
        write_demo_model(SMALL_DEMO_DIR, size="small")
    return SMALL_DEMO_DIR


def _write_byte_tokenizer(path: Path) -> dict[str, int]:
    """Fallback: a byte-level BPE with no merges (256 byte tokens + BOS/EOS); returns their ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok.add_special_tokens([bos, eos])
    tok.save(str(path / "tokenizer.json"))
    tok_cfg = {
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": True,
        "model_max_length": LLAMA_1B["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return {"bos_token_id": tok.token_to_id(bos), "eos_token_id": tok.token_to_id(eos)}


def ensure_checkpoint(path: Path) -> Path:
    """Write config.json, model.safetensors and tokenizer files into `path` unless present."""
    needed = ("config.json", "model.safetensors", *TOKENIZER_FILES)
    if all((path / f).exists() for f in needed):
        return path
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = dict(LLAMA_1B)
    try:
        src = _tokenizer_source()
    except Exception as exc:
        log(f"demo model unavailable ({exc!r}): writing a byte-level tokenizer instead")
        cfg.update(_write_byte_tokenizer(path))
    else:
        for name in TOKENIZER_FILES:
            shutil.copyfile(src / name, path / name)
        demo_cfg = json.loads((src / "config.json").read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if demo_cfg.get(key) is not None:
                cfg[key] = demo_cfg[key]

    log(f"generating the ~1.1B random bf16 checkpoint in {path} (seed {WEIGHT_SEED}) ...")
    gen = torch.Generator().manual_seed(WEIGHT_SEED)
    std = cfg["initializer_range"]
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _parameter_shapes(cfg):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            # Generate in float32 one tensor at a time, keep only the bf16 copy.
            tensors[name] = torch.randn(shape, generator=gen).mul_(std).to(torch.bfloat16)
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    del tensors
    os.replace(tmp, path / "model.safetensors")
    # config.json last: together with the weights it marks a complete checkpoint.
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    log(f"  done in {time.perf_counter() - t0:.0f}s")
    return path


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def weight_facts(model_dir: Path) -> dict[str, int]:
    """Bytes and parameter counts of the checkpoint on disk, from the safetensors header (no
    tensor is loaded). The bytes read per token depend on the dtype loaded: loaded_weight_bytes."""
    from safetensors import safe_open

    total_params = total_bytes = embed_bytes = 0
    has_lm_head = False
    embed_key = None
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
            sl = f.get_slice(key)
            numel = 1
            for d in sl.get_shape():
                numel *= d
            size = numel * _DTYPE_BYTES[sl.get_dtype()]
            total_params += numel
            total_bytes += size
            if key.endswith("embed_tokens.weight"):
                embed_bytes += size
                embed_key = key
            has_lm_head |= key.endswith("lm_head.weight")
    read_per_token = total_bytes - embed_bytes
    if not has_lm_head and embed_key is not None:
        read_per_token += embed_bytes  # tied: lm_head reads the whole table every token
    return {
        "total_params": total_params,
        "total_bytes": total_bytes,
        "embedding_bytes": embed_bytes,
        "checkpoint_bytes_read_per_token": read_per_token,
    }


def loaded_weight_bytes(model: torch.nn.Module) -> tuple[int, str]:
    """Bytes one decode step reads from the weights as loaded, and their dtype(s).

    Every parameter, buffer and oneDNN-packed weight (PackedLinear.packed, an opaque tensor that
    is neither) counts once, except an input embedding table that no linear layer shares (a
    lookup reads one row; a tied lm_head reads all of it) and rotary tables (indexed)."""
    linear_weights = {
        id(m.weight)
        for m in model.modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
        and not isinstance(m, torch.nn.Embedding)
    }
    seen: set[int] = set()
    total = 0
    dtypes: set[str] = set()
    for name, module in model.named_modules():
        if "rotary" in name:
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            tensors.append(packed)
        for t in tensors:
            if id(t) in seen:
                continue
            seen.add(id(t))
            if isinstance(module, torch.nn.Embedding) and id(t) not in linear_weights:
                continue
            total += t.numel() * t.element_size()
            dtypes.add(str(t.dtype).removeprefix("torch."))
    return total, "+".join(sorted(dtypes))


def special_ids(model_dir: Path) -> set[int]:
    ids: set[int] = set()
    cfg = json.loads((model_dir / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(key)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(int(x) for x in v)
    tok = model_dir / "tokenizer.json"
    if tok.exists():
        data = json.loads(tok.read_text())
        ids.update(int(t["id"]) for t in data.get("added_tokens", []) if t.get("special"))
    return ids


# --------------------------------------------------------------------------------------------- #
# Measurements
# --------------------------------------------------------------------------------------------- #


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` timed calls of fn, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_copy_bandwidth(nbytes: int = 1 << 30, reps: int = 6) -> float:
    """Best-of-`reps` dst.copy_(src) bandwidth in bytes/s, counting bytes read + bytes written."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)  # touched: no page faults inside the timing
    dst = torch.zeros(nbytes // 4, dtype=torch.float32)
    return 2.0 * nbytes / _best_seconds(lambda: dst.copy_(src), reps)


def measure_read_bandwidth(nbytes: int = 1 << 30, reps: int = 6) -> float:
    """Best-of-`reps` src.sum() bandwidth in bytes/s: bytes read, nothing written."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best_seconds(src.sum, reps)


class _StepTimer:
    """LogitsProcessor-compatible hook: records perf_counter() at every generation step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


class EngineContender:
    name = "engine"

    def __init__(
        self, model_dir: Path, dtype: str, kv_bytes: int, overrides: dict[str, Any]
    ) -> None:
        from controlplane.engine import LLM, SamplingParams

        self._params = SamplingParams
        t0 = time.perf_counter()
        self.llm = LLM(
            str(model_dir),
            dtype=dtype,
            device="cpu",
            max_num_seqs=1,
            kv_cache_memory_bytes=kv_bytes,
            **overrides,
        )
        log(f"  [engine] LLM constructed in {time.perf_counter() - t0:.1f}s")
        self.weight_bytes, self.weight_dtype = loaded_weight_bytes(self.llm.engine.model)

    def run(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        params = self._params(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = self.llm.generate([prompt], [params], use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        m = out.metrics
        n = m.num_output_tokens
        decode_s = m.finish_time - m.first_token_time
        return {
            "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "ttft_s": m.first_token_time - m.arrival_time,
            "wall_s": wall,
            "num_output_tokens": n,
            "token_ids": list(out.token_ids),
        }


class TransformersContender:
    name = "transformers"

    def __init__(self, model_dir: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=DTYPES[dtype], attn_implementation="sdpa"
        ).eval()
        cfg = self.model.config
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        log(f"  [transformers] model loaded in {time.perf_counter() - t0:.1f}s")
        self.weight_bytes, self.weight_dtype = loaded_weight_bytes(self.model)

    def run(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        from transformers import GenerationConfig, LogitsProcessorList

        timer = _StepTimer()
        input_ids = torch.tensor([prompt], dtype=torch.long)
        gen_cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=self.pad_id,
        )
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=gen_cfg,
            logits_processor=LogitsProcessorList([timer]),
        )
        wall = time.perf_counter() - t0
        new = out[0, len(prompt) :].tolist()
        n = len(timer.times)
        decode_s = timer.times[-1] - timer.times[0] if n > 1 else 0.0
        return {
            "decode_tokens_per_s": (n - 1) / decode_s if decode_s > 0 else None,
            "ttft_s": timer.times[0] - t0 if timer.times else None,
            "wall_s": wall,
            "num_output_tokens": len(new),
            "token_ids": new,
        }


# --------------------------------------------------------------------------------------------- #
# Driver
# --------------------------------------------------------------------------------------------- #


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Batch-1 greedy decode tokens/s of a ~1.1B random-weight Llama: controlplane's "
            "engine vs. transformers generate, and both vs. the memory-bandwidth limit "
            "(figures, not assertions)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="checkpoint directory; the ~1.1B checkpoint is generated there if missing",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=auto_dtype(),
        help="weights dtype (default: bfloat16 with native bf16, else float32)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per contender (medians)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens to generate")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument(
        "--kv-cache-memory-bytes", type=int, default=256 * 1024**2, help="engine KV cache budget"
    )
    p.add_argument(
        "--contenders",
        default=",".join(ALL_CONTENDERS),
        help="comma-separated subset of: " + ", ".join(ALL_CONTENDERS),
    )
    p.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads"
    )
    p.add_argument(
        "--engine",
        default="",
        help="engine settings overrides, e.g. compile=on (key=value, comma-separated)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write summary JSON")
    args = p.parse_args(argv)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    for c in args.contenders:
        if c not in ALL_CONTENDERS:
            p.error(f"unknown contender {c!r}")
    if args.repeats < 1 or args.new_tokens < 2 or args.prompt_tokens < 1:
        p.error("--repeats >= 1, --new-tokens >= 2 and --prompt-tokens >= 1 are required")
    return args


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    log(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"torch threads={torch.get_num_threads()}, cpus={os.cpu_count()}"
    )
    model_dir = ensure_checkpoint(args.model_dir)
    facts = weight_facts(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    specials = special_ids(model_dir)
    rng = random.Random(args.seed)
    allowed = [i for i in range(vocab) if i not in specials]
    prompt = [rng.choice(allowed) for _ in range(args.prompt_tokens)]
    log(
        f"model {model_dir}: {facts['total_params'] / 1e9:.3f}B params, checkpoint "
        f"{facts['total_bytes'] / 1e9:.3f} GB on disk; weights are counted as loaded "
        f"(--dtype {args.dtype}), per contender below"
    )

    log("measuring copy bandwidth (1 GiB dst.copy_(src), best of 6) ...")
    bw = measure_copy_bandwidth()
    log(f"  copy bandwidth {bw / 1e9:.1f} GB/s (bytes read + bytes written)")
    read_bw = measure_read_bandwidth()
    log(f"  read bandwidth {read_bw / 1e9:.1f} GB/s (1 GiB src.sum(), best of 6)")

    probes = [(bw, read_bw)]  # (copy, read) at the start and after every round of repeats
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
                from benchmarks.engine_overrides import parse_overrides

                contenders[name] = EngineContender(
                    model_dir, args.dtype, args.kv_cache_memory_bytes, parse_overrides(args.engine)
                )
            else:
                contenders[name] = TransformersContender(model_dir, args.dtype)
            c = contenders[name]
            log(
                f"[{name}] weights as loaded: {c.weight_bytes / 1e9:.3f} GB read per token "
                f"({c.weight_dtype}), limit {bw / c.weight_bytes:.2f} tokens/s"
            )
            log(f"[{name}] warmup ...")
            torch.manual_seed(args.seed)
            contenders[name].run(prompt, 8)
        except Exception as exc:
            traceback.print_exc()
            errors[name] = f"setup/warmup failed: {exc!r}"
            log(f"[{name}] SKIPPED: {errors[name]}")
            contenders.pop(name, None)

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    order = list(contenders)
    for rep in range(args.repeats):
        rot = order[rep % len(order) :] + order[: rep % len(order)] if order else []
        for name in rot:
            if name in errors:
                continue
            log(f"[{name}] repeat {rep + 1}/{args.repeats} ...")
            torch.manual_seed(args.seed)
            try:
                res = contenders[name].run(prompt, args.new_tokens)
            except Exception as exc:
                traceback.print_exc()
                errors[name] = f"repeat {rep + 1} failed: {exc!r}"
                log(f"[{name}] dropped: {errors[name]}")
                continue
            runs[name].append({**res, "round": rep})
            ok = res["num_output_tokens"] == args.new_tokens
            log(
                f"[{name}] repeat {rep + 1}: decode {_fmt(res['decode_tokens_per_s'])} tok/s, "
                f"TTFT {_fmt(res['ttft_s'])} s, wall {res['wall_s']:.1f} s"
                + ("" if ok else f", WRONG output length {res['num_output_tokens']}")
            )
        probes.append((measure_copy_bandwidth(reps=3), measure_read_bandwidth(reps=3)))
        log(f"  bandwidth now: copy {probes[-1][0] / 1e9:.1f}, read {probes[-1][1] / 1e9:.1f} GB/s")
    bw = statistics.median(p[0] for p in probes)
    read_bw = statistics.median(p[1] for p in probes)

    def around(r: dict[str, Any], kind: int) -> float:
        """The mean bandwidth of the probes either side of repeat `r`'s round."""
        return (probes[r["round"]][kind] + probes[r["round"] + 1][kind]) / 2

    summary: dict[str, Any] = {
        "benchmark": "decode_latency",
        "model_dir": str(model_dir),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "checkpoint": facts,
        "copy_bandwidth_bytes_per_s": bw,
        "copy_bandwidth_convention": "bytes read + bytes written per dst.copy_(src)",
        "read_bandwidth_bytes_per_s": read_bw,
        "bandwidth_probes_bytes_per_s": [{"copy": c, "read": r} for c, r in probes],
        "contenders": {},
    }
    for name in args.contenders:
        rs = [r for r in runs.get(name, []) if r["decode_tokens_per_s"] is not None]
        tps = [r["decode_tokens_per_s"] for r in rs]
        if not tps:
            summary["contenders"][name] = {"error": errors.get(name, "no successful run")}
            continue
        med = statistics.median(tps)
        c = contenders[name]
        limit = bw / c.weight_bytes
        summary["contenders"][name] = {
            "decode_tokens_per_s": med,
            "decode_tokens_per_s_runs": tps,
            "weight_bytes_read_per_token": c.weight_bytes,
            "weight_dtype": c.weight_dtype,
            "bandwidth_limit_tokens_per_s": limit,
            "fraction_of_bandwidth_limit": statistics.median(
                r["decode_tokens_per_s"] * c.weight_bytes / around(r, 0) for r in rs
            ),
            "fraction_of_read_bandwidth_limit": statistics.median(
                r["decode_tokens_per_s"] * c.weight_bytes / around(r, 1) for r in rs
            ),
            "ttft_s": statistics.median([r["ttft_s"] for r in rs if r["ttft_s"] is not None]),
            "all_valid": all(r["num_output_tokens"] == args.new_tokens for r in rs),
            **({"error": errors[name]} if name in errors else {}),
        }
    eng = summary["contenders"].get("engine", {}).get("decode_tokens_per_s")
    hf = summary["contenders"].get("transformers", {}).get("decode_tokens_per_s")
    ratio = eng / hf if eng and hf else None
    summary["ratio_engine_over_transformers"] = ratio
    summary["target_ratio"] = TARGET_RATIO
    if runs.get("engine") and runs.get("transformers"):
        a, b = runs["engine"][0]["token_ids"], runs["transformers"][0]["token_ids"]
        same = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            same += 1
        summary["greedy_prefix_agreement_tokens"] = same

    log("")
    log("=" * 88)
    log(
        f"Batch-1 decode, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, "
        f"dtype={args.dtype}, threads={torch.get_num_threads()}, medians of {args.repeats}"
    )
    copies, reads = [p[0] / 1e9 for p in probes], [p[1] / 1e9 for p in probes]
    log(
        f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write; median of {len(probes)} probes, "
        f"{min(copies):.1f}-{max(copies):.1f}); limit = bandwidth / the bytes of the weights "
        "as loaded, read once per token; 'of limit' = the median over repeats of each against "
        "the probes either side of it"
    )
    log(
        f"read bandwidth {read_bw / 1e9:.1f} GB/s ({min(reads):.1f}-{max(reads):.1f}); "
        "'of read' = the same with it"
    )
    log(
        f"{'contender':<13} {'weights':>18} {'limit tok/s':>11} {'decode tok/s':>12} "
        f"{'of limit':>9} {'of read':>8} {'TTFT s':>8} {'valid':>6}"
    )
    log("-" * 92)
    for name, row in summary["contenders"].items():
        if "decode_tokens_per_s" not in row:
            log(f"{name:<13} skipped: {row['error']}")
            continue
        weights = f"{row['weight_bytes_read_per_token'] / 1e9:.3f} GB {row['weight_dtype']}"
        log(
            f"{name:<13} {weights:>18} {row['bandwidth_limit_tokens_per_s']:>11.2f} "
            f"{row['decode_tokens_per_s']:>12.2f} "
            f"{row['fraction_of_bandwidth_limit'] * 100:>8.1f}% "
            f"{row['fraction_of_read_bandwidth_limit'] * 100:>7.1f}% {_fmt(row['ttft_s']):>8} "
            f"{'yes' if row['all_valid'] else 'NO':>6}"
        )
    if ratio is not None:
        verdict = "meets" if ratio >= TARGET_RATIO else "below"
        log(f"ratio engine/transformers: {ratio:.2f}x ({verdict} the {TARGET_RATIO}x target)")
    else:
        log("ratio engine/transformers: n/a")
    if "greedy_prefix_agreement_tokens" in summary:
        log(
            "greedy tokens identical for the first "
            f"{summary['greedy_prefix_agreement_tokens']} of {args.new_tokens} (informational)"
        )
    log("=" * 88)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
        log(f"summary written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
