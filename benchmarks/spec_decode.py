"""Speculative decoding on the real model: off vs n-gram vs int4 self-draft, in the same run.

What is measured
----------------
The target is SmolLM2-135M-Instruct in float32 (``quantization = "none"``); the draft model is
the same checkpoint quantized to int4 (``speculative_draft_model`` = the target's path,
``speculative_draft_quantization = "int4"``). All requests are greedy chat requests (the chat
template applied), EOS honoured, so every configuration emits the same tokens (speculation is
exact) and only the time differs.

* ``batch1``: one request at a time, ``--max-tokens`` (128) new tokens, on two prompt sets:
  ``grounded`` (rewrite / correct / continue a given text: the answer repeats its input, where
  prompt lookup shines) and ``chat`` (open questions). Configurations: off, then ngram and
  draft with k in ``--ks`` (2, 4, 6), switched live on one engine. Figures per configuration and
  set: decode tokens/s = sum(output tokens - 1) / sum(finish - first token), the speed-up over
  off, acceptance rate (accepted / proposed tokens) and mean accepted length (tokens emitted
  per verification: accepted / drafts + 1). Target: >= 2x at batch 1 for the better method on
  grounded prompts.
* ``batch16``: ``--batch`` (16) requests at once (both sets mixed), off vs ngram vs draft at
  the default k and the default ``speculative_max_batch_size`` (8: above it speculation pauses,
  so a 16-wide batch runs as without it, plus the bookkeeping). Figure: output tokens/s of the
  whole batch, ratio to off. Target: >= 0.95x.
* ``online``: the daemon (SQLite, streaming chat) at a low and a high arrival rate
  (``--rates``, requests/s; ``--online-requests`` each, prompts from both sets), speculation off
  vs ``--online-method`` at the default k. Figures: chunk gap p50 / p99 (what a streaming client
  sees between chunks; a verification step may deliver several tokens in one chunk), time per
  output token (TPOT, (e2e - TTFT) / (tokens - 1), mean), TTFT p50, output tokens/s.

Figures to read, never timed assertions: the machine is shared and the load generator runs on
the same CPUs as the engine.

How to run
----------
    python -m benchmarks.spec_decode                          # all three, ~15 minutes on 2 cores
    python -m benchmarks.spec_decode --only batch1 --ks 4
    python -m benchmarks.spec_decode --only online --rates 0.2,2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.prefix_cache import chat, log, start
from controlplane.common import cpu_name, percentile

GROUNDED_TEXTS = (
    "The quarterly report shows that revenue grew by twelve percent, driven mostly by new "
    "customers in the northern region. Costs rose more slowly than revenue, so the margin "
    "improved. The board will meet next month to discuss the budget for the coming year.",
    "To reset your password, open the settings page, choose the security tab and click the "
    "button labelled reset. You will receive an email with a link. The link expires after one "
    "hour, so use it soon. If the email does not arrive, check your spam folder first.",
    "Our team moved the weekly meeting from Monday to Wednesday because many people were "
    "travelling. The new room is on the third floor, next to the kitchen. Please bring your "
    "laptop and the notes from last week, since we will review the open action items.",
    "The library opens at nine in the morning and closes at eight in the evening on weekdays. "
    "On weekends it opens at ten and closes at four. Books can be borrowed for three weeks and "
    "renewed twice, unless another reader has reserved them in the meantime.",
)
GROUNDED_ASKS = (
    "Rewrite the following text exactly, but in the past tense:\n\n{}",
    "Correct any mistakes in the following text and return the full corrected text:\n\n{}",
    "Copy the following text, then add one more sentence at the end:\n\n{}",
    "Repeat the following text word for word:\n\n{}",
)
CHAT_PROMPTS = (
    "What are three good habits for staying healthy while working from home?",
    "Explain in simple terms how a rainbow forms.",
    "Write a short poem about the sea at night.",
    "Give me some tips for learning a new language as an adult.",
)


def prompt_sets() -> dict[str, list[str]]:
    grounded = [ask.format(text) for ask, text in zip(GROUNDED_ASKS, GROUNDED_TEXTS, strict=True)]
    return {"grounded": grounded, "chat": list(CHAT_PROMPTS)}


# -- offline ----------------------------------------------------------------------------------


def load(model: str, args: argparse.Namespace) -> Any:
    from controlplane.engine import LLM

    return LLM(
        model,
        quantization="none",
        speculative_draft_model=model,
        speculative_draft_quantization="int4",
        max_num_seqs=max(32, args.batch),
    )


def encode(llm: Any, prompts: list[str]) -> list[list[int]]:
    tok = llm.engine.tokenizer
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]


def run(llm: Any, prompts: list[list[int]], max_tokens: int, together: bool) -> dict[str, Any]:
    """Generate (all at once, or one request at a time); decode speed and speculation figures
    from the request metrics and the engine's counters."""
    from controlplane.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    before = llm.engine.stats()
    t0 = time.perf_counter()
    if together:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    wall = time.perf_counter() - t0
    after = llm.engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    decode_s = sum(o.metrics.finish_time - o.metrics.first_token_time for o in outs)
    drafts = after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
    proposed = after.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
    accepted = (
        after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    )
    return {
        "outputs": [o.token_ids for o in outs],
        "tokens": tokens,
        "decode_tok_s": (tokens - len(outs)) / decode_s if decode_s > 0 else None,
        "output_tok_s": tokens / wall,
        "acceptance": accepted / proposed if proposed else None,
        "mean_accepted_len": accepted / drafts + 1 if drafts else None,
    }


def configs(ks: list[int]) -> list[tuple[str, int]]:
    return [("off", 0)] + [(m, k) for m in ("ngram", "draft") for k in ks]


def batch1(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, texts in prompt_sets().items():
        prompts = encode(llm, texts)
        rows: dict[str, Any] = {}
        for method, k in configs(args.ks):
            settings = {"speculative_method": method}
            if k:
                settings["speculative_num_tokens"] = k
            llm.engine.update_settings(**settings)
            label = method if method == "off" else f"{method} k={k}"
            r = run(llm, prompts, args.max_tokens, together=False)
            if method != "off" and r["outputs"] != rows["off"]["outputs"]:
                raise AssertionError(f"{name} {label}: outputs differ from speculation off")
            rows[label] = r
            log(f"batch1 {name} {label}: {_summary(r, rows['off'])}")
        out[name] = {label: _public(r, rows["off"]) for label, r in rows.items()}
    llm.engine.update_settings(speculative_method="off")
    return out


def batch16(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from controlplane.engine.settings import EngineSettings

    sets = prompt_sets()
    texts = [t for group in sets.values() for t in group]
    prompts = encode(llm, [texts[i % len(texts)] for i in range(args.batch)])
    defaults = EngineSettings()
    llm.engine.update_settings(
        speculative_num_tokens=defaults.speculative_num_tokens,
        speculative_max_batch_size=defaults.speculative_max_batch_size,
    )
    rows: dict[str, Any] = {}
    for rep in range(args.repeats):
        for method in ("off", "ngram", "draft") if rep % 2 == 0 else ("draft", "ngram", "off"):
            llm.engine.update_settings(speculative_method=method)
            r = run(llm, prompts, args.max_tokens, together=True)
            rows.setdefault(method, []).append(r)
            log(f"batch{args.batch} {method} repeat {rep}: {r['output_tok_s']:.1f} output tok/s")
    llm.engine.update_settings(speculative_method="off")
    off = statistics.median(r["output_tok_s"] for r in rows["off"])
    return {
        method: {
            "output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
            "vs_off": statistics.median(r["output_tok_s"] for r in runs) / off,
            "acceptance": runs[0]["acceptance"],  # speculation runs only once the batch shrinks
        }
        for method, runs in rows.items()
    }


def _public(r: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in r.items() if k != "outputs"}
    out["speedup"] = r["decode_tok_s"] / off["decode_tok_s"]
    return out


def _summary(r: dict[str, Any], off: dict[str, Any]) -> str:
    acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
    mal = "-" if r["mean_accepted_len"] is None else f"{r['mean_accepted_len']:.2f}"
    return (
        f"{r['decode_tok_s']:.1f} decode tok/s ({r['decode_tok_s'] / off['decode_tok_s']:.2f}x), "
        f"{r['tokens']} tokens, acceptance {acc}, mean accepted length {mal}"
    )


# -- online -----------------------------------------------------------------------------------


async def online_workload(url: str, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    await chat(client, model, [{"role": "user", "content": "Hello there"}], 4)  # warm-up
    texts = [t for group in prompt_sets().values() for t in group]
    rng = random.Random(3)
    gaps = [rng.expovariate(rate) for _ in range(args.online_requests)]

    async def one(i: int) -> dict[str, Any]:
        await asyncio.sleep(sum(gaps[:i]))
        messages = [{"role": "user", "content": texts[i % len(texts)]}]
        return await chat(client, model, messages, args.max_tokens)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(args.online_requests)))
    wall = time.perf_counter() - t0
    await client.close()
    itl = [g for r in results for g in r["itl"]]
    tpot = [(r["e2e"] - r["ttft"]) / (r["completion"] - 1) for r in results if r["completion"] > 1]
    return {
        "requests": len(results),
        "chunk_gap_p50_ms": 1000 * percentile(itl, 50),
        "chunk_gap_p99_ms": 1000 * percentile(itl, 99),
        "tpot_mean_ms": 1000 * statistics.mean(tpot),
        "ttft_p50_s": percentile([r["ttft"] for r in results], 50),
        "output_tok_s": sum(r["completion"] for r in results) / wall,
    }


def online(model: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rate in args.rates:
        for method in ("off", args.online_method):
            engine: dict[str, Any] = {"quantization": "none", "speculative_method": method}
            if method == "draft":
                engine |= {
                    "speculative_draft_model": model,
                    "speculative_draft_quantization": "int4",
                }
            with tempfile.TemporaryDirectory(prefix="spec-online-") as tmp:
                d = start(Path(tmp), model, engine, args)
                try:
                    r = asyncio.run(online_workload(d.url, rate, args))
                except Exception:
                    log(d.log_tail())
                    raise
                finally:
                    d.stop(timeout=60, check=False)
            out.setdefault(f"{rate:g}/s", {})[method] = r
            log(f"online {rate:g} req/s {method}: {json.dumps(r)}")
    return out


# -- main -------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="engine.model (default: SmolLM2's GGUF)")
    p.add_argument("--only", choices=("batch1", "batch16", "online"), action="append")
    p.add_argument("--ks", type=_ints, default=[2, 4, 6])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="batch16: interleaved repeats")
    p.add_argument("--rates", type=_floats, default=[0.2, 2.0], help="online: requests/s")
    p.add_argument("--online-requests", type=int, default=24)
    p.add_argument("--online-method", choices=("ngram", "draft"), default="ngram")
    p.add_argument("--max-num-seqs", type=int, default=32, help="online: the daemon's")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    only = set(args.only or ("batch1", "batch16", "online"))
    report: dict[str, Any] = {"cpu": cpu_name()}
    if only & {"batch1", "batch16"}:
        llm = load(args.model, args)
        llm.generate(encode(llm, ["Hello"]), use_tqdm=False)  # warm up (not measured)
        if "batch1" in only:
            report["batch1"] = batch1(llm, args)
        if "batch16" in only:
            report["batch16"] = batch16(llm, args)
        del llm
    if "online" in only:
        report["online"] = online(args.model, args)

    log("\n== speculative decoding (same run; target float32, draft int4 self) ==")
    for name, rows in report.get("batch1", {}).items():
        best = max((r for label, r in rows.items() if label != "off"), key=lambda r: r["speedup"])
        log(f"batch 1, {name} prompts: best {best['speedup']:.2f}x over off (target >= 2x)")
        for label, r in rows.items():
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            mal = "-" if r["mean_accepted_len"] is None else f"{r['mean_accepted_len']:.2f}"
            log(
                f"  {label:10} {r['decode_tok_s']:6.1f} decode tok/s  {r['speedup']:.2f}x  "
                f"acceptance {acc:>4}  mean accepted length {mal}"
            )
    if "batch16" in report:
        rows = report["batch16"]
        log(
            f"batch {args.batch} (default k and max batch size): "
            + ", ".join(
                f"{m} {r['output_tok_s']:.1f} tok/s ({r['vs_off']:.3f}x)" for m, r in rows.items()
            )
            + " (target >= 0.95x)"
        )
    for rate, rows in report.get("online", {}).items():
        for method, r in rows.items():
            log(
                f"online {rate} {method:5}: chunk gap p50 {r['chunk_gap_p50_ms']:.0f} ms, p99 "
                f"{r['chunk_gap_p99_ms']:.0f} ms; TPOT {r['tpot_mean_ms']:.0f} ms; TTFT p50 "
                f"{r['ttft_p50_s']:.2f}s; {r['output_tok_s']:.1f} output tok/s"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
