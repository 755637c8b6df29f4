"""This engine against llama.cpp's own tools, on the very same GGUF file and thread count.

llama.cpp's figures come from its benchmark programs (`llama-bench`, `llama-batched-bench`),
built from the source that llama-cpp-python's source distribution carries in
`vendor/llama.cpp` (a benchmark-only build, never a dependency):

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-*.tar.gz -C /tmp/lcpp
    cd /tmp/lcpp/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    cmake --build build -j2 --target llama-bench llama-batched-bench llama-server
    python -m benchmarks.llamacpp_tools --llama-bin /tmp/lcpp/llama_cpp_python-*/vendor/llama.cpp/build/bin

On a CPU with AMX (a 2-core AVX10.1 Xeon, llama.cpp of October 2026) the native build dies in
ggml's AMX path (SIGILL; a SIGSEGV at `ldtilecfg` under gdb): configure it with
`-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"` and the same CMAKE_CXX_FLAGS,
its best working build there.

What is measured (each figure the same way on both sides):

* prompt processing, one `--pp`-token prompt: tokens / seconds (llama-bench `pp`; the engine:
  one request with max_tokens=1, wall time);
* batch-1 decode of `--tg` tokens (llama-bench `tg`; the engine: (n - 1) / time from the first
  to the last token of one request);
* aggregate decode with N parallel sequences of `--npp` prompt + `--ntg` new tokens each
  (llama-batched-bench `S_TG` = N * ntg / generation time; the engine: N requests queued
  together, N * (ntg - 1) / time from the last sequence's first token to the last token).

The engine runs in its default configuration (quantization auto, dtype auto) with torch's
threads set to `--threads`. Medians of `--repeats`; ratios are engine / llama.cpp.
`--paired-rounds N` then takes batch-1 decode again in N rounds, llama-bench's and every
engine's in turn, each ratio from figures a minute apart (on a VM whose speed drifts). Figures to
read, never timed assertions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_overrides import parse_overrides
from benchmarks.llamacpp_compare import gguf_model, log
from benchmarks.quant_decode import make_prompt

# -- llama.cpp ------------------------------------------------------------------------------------


def llama_bench(bin_dir: Path, model: str, threads: int, pp: int, tg: int, reps: int) -> dict:
    """llama-bench's pp and tg figures (tokens/s, its mean over `reps`)."""
    out = subprocess.run(
        [
            str(bin_dir / "llama-bench"),
            "-m",
            model,
            "-t",
            str(threads),
            "-p",
            str(pp),
            "-n",
            str(tg),
            "-r",
            str(reps),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = json.loads(out)
    got = {}
    for r in rows:
        key = "pp" if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0 else "tg"
        got[key] = float(r["avg_ts"])
    return got


def llama_batched(
    bin_dir: Path, model: str, threads: int, npp: int, ntg: int, npl: list[int]
) -> dict[int, float]:
    """llama-batched-bench's aggregate generation speed S_TG (tokens/s) per parallel count."""
    ctx = max(npl) * (npp + ntg) + 64
    out = subprocess.run(
        [
            str(bin_dir / "llama-batched-bench"),
            "-m",
            model,
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(ctx),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            str(npp),
            "-ntg",
            str(ntg),
            "-npl",
            ",".join(map(str, npl)),
            "--output-format",
            "jsonl",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    got = {}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            got[int(r["pl"])] = float(r["speed_tg"])
    return got


# -- the engine ---------------------------------------------------------------------------------


class Engine:
    def __init__(self, model: str, max_seqs: int, overrides: dict[str, Any]) -> None:
        from controlplane.engine import LLM, SamplingParams

        t0 = time.perf_counter()
        # long_running: the daemon's engine, whose defaults are the ones compared.
        self.llm = LLM(model, device="cpu", max_num_seqs=max_seqs, long_running=True, **overrides)
        self._params = SamplingParams
        eng = self.llm.engine
        log(
            f"engine loaded in {time.perf_counter() - t0:.1f}s ({eng.dtype}, {eng.memory.describe()})"
        )
        # `compile = auto` in a daemon on a CPU compiles the decode step in the background:
        # measure the engine as a daemon serves once warm, not while the compiler works.
        t0 = time.perf_counter()
        while eng.compile_state == "warming":
            time.sleep(0.2)
        if eng.runner.compiled is not None:
            log(f"compiled step {eng.compile_state} after {time.perf_counter() - t0:.1f}s more")

    def prefill(self, prompt: list[int]) -> float:
        params = self._params(max_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate([prompt], [params], use_tqdm=False)
        return len(prompt) / (time.perf_counter() - t0)

    def decode(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Aggregate decode tokens/s of `prompts` run together."""
        params = self._params(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        start = max(o.metrics.first_token_time for o in outs)
        end = max(o.metrics.finish_time for o in outs)
        return len(outs) * (new_tokens - 1) / (end - start)


# Fresh prompts for every run: a repeated prompt would be served from the prefix cache.
_SEEDS = iter(range(1, 1_000_000))


def _prompts(eng: Engine, n: int, length: int) -> list[list[int]]:
    return [make_prompt(eng.llm, length, next(_SEEDS)) for _ in range(n)]


def measure_engine(
    eng: Engine, config: str, args: argparse.Namespace, npl: list[int], lb: dict, lbb: dict
) -> list[dict[str, Any]]:
    """The engine's rows, for one configuration (`config`: its settings overrides)."""
    label = f" [{config}]" if config else ""
    eng.decode(_prompts(eng, 1, 32), 8)  # warm-up
    reps = range(args.repeats)
    pp = statistics.median(eng.prefill(_prompts(eng, 1, args.pp)[0]) for _ in reps)
    tg = statistics.median(eng.decode(_prompts(eng, 1, 1), args.tg) for _ in reps)
    agg = {
        n: statistics.median(eng.decode(_prompts(eng, n, args.npp), args.ntg) for _ in reps)
        for n in npl
    }
    return [
        {
            "figure": f"prompt processing, {args.pp} tokens{label}",
            "llama_cpp": lb["pp"],
            "engine": pp,
        },
        {"figure": f"batch-1 decode, {args.tg} tokens{label}", "llama_cpp": lb["tg"], "engine": tg},
        *(
            {
                "figure": f"aggregate decode, {n} sequences ({args.npp}+{args.ntg}){label}",
                "llama_cpp": lbb[n],
                "engine": agg[n],
            }
            for n in npl
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="This engine vs llama.cpp's llama-bench and llama-batched-bench (figures).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's build/bin")
    p.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--npp", type=int, default=128)
    p.add_argument("--ntg", type=int, default=128)
    p.add_argument("--npl", default="4,16", help="parallel sequences, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--engine",
        action="append",
        default=None,
        help="engine settings overrides, e.g. compile=on (repeat to compare configurations; "
        "default: one engine on its defaults)",
    )
    p.add_argument(
        "--paired-rounds",
        type=int,
        default=0,
        help="then batch-1 decode in this many rounds of llama-bench and every engine in turn "
        "(for a machine whose speed drifts; keeps every engine in memory)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    model = gguf_model(args.model)
    npl = [int(n) for n in args.npl.split(",") if n]
    torch.set_num_threads(args.threads)
    log(f"model {model}; {args.threads} threads")

    log("llama.cpp: llama-bench ...")
    lb = llama_bench(args.llama_bin, model, args.threads, args.pp, args.tg, args.repeats)
    log(f"llama.cpp: llama-batched-bench (npl {npl}) ...")
    lbb = llama_batched(args.llama_bin, model, args.threads, args.npp, args.ntg, npl)

    rows: list[dict[str, Any]] = []
    engines: dict[str, Engine] = {}
    for config in args.engine or [""]:
        engines[config] = eng = Engine(model, max(npl), parse_overrides(config))
        rows += measure_engine(eng, config, args, npl, lb, lbb)
        if not args.paired_rounds:
            del engines[config], eng  # one engine in memory at a time
    log("")
    log(f"{'figure':<60} {'llama.cpp':>10} {'engine':>10} {'ratio':>7}   (tok/s)")
    for r in rows:
        r["ratio"] = r["engine"] / r["llama_cpp"]
        log(f"{r['figure']:<60} {r['llama_cpp']:>10.1f} {r['engine']:>10.1f} {r['ratio']:>6.2f}x")
    paired = paired_rounds(engines, args, model) if args.paired_rounds else []
    if args.json:
        out = {"model": model, "rows": rows, "paired_batch1": paired}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def paired_rounds(engines: dict[str, Engine], args: argparse.Namespace, model: str) -> list[dict]:
    """Batch-1 decode in rounds: llama-bench's tg, then each engine's, so that every ratio
    compares figures taken a minute apart. On a VM whose speed drifts (a 2-core Xeon's step
    read 10 and 20 ms two minutes apart), llama.cpp's one figure taken first is no fair
    baseline for engines measured minutes later."""
    log(f"\nbatch-1 decode of {args.tg} tokens in {args.paired_rounds} paired rounds (tok/s):")
    rounds = []
    for i in range(args.paired_rounds):
        lc = llama_bench(args.llama_bin, model, args.threads, 0, args.tg, 2)["tg"]
        got = {
            config: statistics.median(eng.decode(_prompts(eng, 1, 1), args.tg) for _ in range(2))
            for config, eng in engines.items()
        }
        rounds.append({"llama_cpp": lc, "engine": got})
        cells = " | ".join(f"{c or 'defaults'} {v:.1f} ({v / lc:.2f}x)" for c, v in got.items())
        log(f"round {i + 1}: llama.cpp {lc:.1f} | {cells}")
    for config in engines:
        ratios = [r["engine"][config] / r["llama_cpp"] for r in rounds]
        log(
            f"{config or 'defaults'}: median {statistics.median(ratios):.2f}x "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x)"
        )
    return rounds


if __name__ == "__main__":
    raise SystemExit(main())
