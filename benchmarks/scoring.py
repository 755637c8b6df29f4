"""The cost of scoring prompts (echo + max_tokens 0, prompt logprobs) against plain prefill.

What is measured
----------------
One in-process engine on SmolLM2 (its defaults, prefix caching off so that no run reuses
another's blocks), ``--requests`` prompts of ``--prompt-len`` random token ids queued at once:

* ``prefill``: each prompt with ``max_tokens = 1`` (the prompt computed, one token sampled);
* ``score``: each prompt with ``max_tokens = 0, prompt_logprobs = 1`` (what ``echo: true,
  logprobs: 1, max_tokens: 0`` asks: every prompt row's logits kept, its token's logprob and
  the top 1 taken).

Figures: prompt tokens per second (wall, median of ``--repeats`` interleaved runs) and the ratio
score / prefill. Then the effect on other requests: ``--decoders`` requests decoding
(``--decode-len`` new tokens each) while the same prompts arrive as plain prefills or as scoring
requests, against the decoders alone: their inter-token latency p50 / p99 (the time between a
request's consecutive tokens, stamped at each engine step). Figures to read, never timed
assertions.

    python -m benchmarks.scoring
    python -m benchmarks.scoring --requests 8 --prompt-len 256 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.llamacpp_compare import gguf_model
from controlplane.common import percentile


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=gen).tolist() for _ in range(n)]


def run_batch(eng: Any, batch: list[list[int]], params: Any) -> float:
    """Queue `batch` at once, step to the end: wall seconds."""
    for p in batch:
        eng.add_request(p, params)
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t0


def run_mixed(eng: Any, args: argparse.Namespace, extra: list[list[int]], extra_params: Any):
    """Decoders first (their prompts computed), then `extra` arrives: the decoders' gaps (s)."""
    from controlplane.engine import SamplingParams

    decode = SamplingParams(max_tokens=args.decode_len, temperature=0.0, ignore_eos=True)
    ids = {
        eng.add_request(p, decode)
        for p in prompts(eng.model_config.vocab_size, args.decoders, 32, 7)
    }
    last: dict[str, float] = {}
    gaps: list[float] = []
    added = False
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in ids and o.new_token_ids:
                if o.request_id in last:
                    gaps.append(now - last[o.request_id])
                last[o.request_id] = now
        if not added and len(last) == len(ids):  # every decoder has its first token
            for p in extra:
                eng.add_request(p, extra_params)
            added = True
    return gaps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF or model dir (default: SmolLM2)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--decode-len", type=int, default=96)
    args = p.parse_args(argv)

    from controlplane.engine import Engine, SamplingParams

    eng = Engine(model=gguf_model(args.model), enable_prefix_caching=False)
    vocab = eng.model_config.vocab_size
    batch = prompts(vocab, args.requests, args.prompt_len, 0)
    plain = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    score = SamplingParams(max_tokens=0, prompt_logprobs=1)
    run_batch(eng, batch[:2], plain)  # warm-up
    tokens = args.requests * args.prompt_len
    walls: dict[str, list[float]] = {"prefill": [], "score": []}
    for _ in range(args.repeats):
        walls["prefill"].append(run_batch(eng, batch, plain))
        walls["score"].append(run_batch(eng, batch, score))
    rate = {k: tokens / statistics.median(v) for k, v in walls.items()}
    print(f"\n{args.requests} prompts x {args.prompt_len} tokens, median of {args.repeats}")
    print(f"  plain prefill   {rate['prefill']:8.1f} prompt tok/s")
    print(
        f"  scoring         {rate['score']:8.1f} prompt tok/s   {rate['score'] / rate['prefill']:.2f}x"
    )

    extra = batch[: max(1, args.requests // 2)]
    cases = {
        "decoders alone": ([], plain),
        "+ prefills": (extra, plain),
        "+ scoring": (extra, score),
    }
    print(f"\n{args.decoders} decoders x {args.decode_len} tokens; {len(extra)} prompts arrive")
    base = None
    for name, (more, params) in cases.items():
        gaps = run_mixed(eng, args, more, params)
        p50, p99 = percentile(gaps, 50) * 1e3, percentile(gaps, 99) * 1e3
        base = base or p99
        print(f"  {name:16s} ITL p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  ({p99 / base:.2f}x p99)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
