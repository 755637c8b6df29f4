"""Prefix caching on the real model: cache on vs off, in the same run.

What is measured
----------------
Three workloads, each run with ``engine.enable_prefix_caching`` on and off (order alternating):

* ``system``: the daemon (``python -m controlplane serve``, SQLite, SmolLM2 by default) gets
  ``--system-requests`` (64) streaming chat requests at a fixed rate (``--rate``, 1 req/s), each
  the same ~2,000-token system prompt plus a distinct 50-100-token user turn, 64 output tokens
  (EOS ignored). Figures: TTFT p50 / p99 (first content chunk), output tokens/s (from the first
  send to the last completion), and the share of prompt tokens served from the cache (from
  ``usage.prompt_tokens_details.cached_tokens``). Target: TTFT p50 at least 5x lower with the
  cache on.
* ``multiturn``: the daemon again; ``--conversations`` (16) chats of ``--turns`` (6) turns run
  concurrently, every turn resending the whole conversation so far (the model's answers
  included) plus a new user message, 48 output tokens per turn. Figures: prompt tokens sent,
  prompt tokens computed (sent - cached), the cached share, total time. Target: at least 70%
  of prompt tokens from the cache.
* ``nosharing``: in-process ``LLM.generate`` on random prompts (``--offline-requests`` (48),
  prompt 32-512 random token ids, output 16-128, greedy, EOS ignored): the hashing and
  bookkeeping cost when nothing is shared. One engine, the setting toggled live between runs
  (``--repeats`` (3) interleaved pairs; medians). Target: throughput with the cache on within
  2% of off.
* ``isolation``: the ``system`` workload with the cache on, against a daemon with one API key
  against one with ``--keys`` (4) keys and against an open API (one shared cache), request ``i`` sent with key ``i mod keys``
  (``engine.prefix_cache_isolation = key``, the default): what partitioning the cache per key
  costs when every tenant sends the same system prompt. Figures: the cached share of prompt
  tokens and TTFT p50 for each. Expected: with one key nothing changes; with K keys each key
  computes the system prompt once, so the share drops by about (K - 1) / N of the system part.

Figures to read, never timed assertions: the machine is shared, the load generator runs on
the same CPUs as the daemon.

How to run
----------
    python -m benchmarks.prefix_cache                    # all three, ~20 minutes on 2 cores
    python -m benchmarks.prefix_cache --only nosharing
    python -m benchmarks.prefix_cache --system-requests 16 --conversations 4 --turns 3  # smoke
    python -m benchmarks.prefix_cache --only isolation --system-requests 16 --keys 4
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from controlplane.common import cpu_name, percentile
from harness import DaemonProcess, write_config

TOPICS = (
    "billing disputes",
    "password resets",
    "shipping delays",
    "refund eligibility",
    "account security",
    "data export requests",
    "subscription upgrades",
    "outage communication",
)


def log(msg: str) -> None:
    print(msg, flush=True)


def system_prompt(words: int) -> str:
    """A long, plausible, deterministic policy document (~1.3 tokens per word)."""
    rng = random.Random(0)
    parts = ["You are the support assistant of Example Corp. Follow this handbook exactly."]
    n = 0
    section = 1
    while n < words:
        topic = TOPICS[section % len(TOPICS)]
        rule = (
            f"Section {section}: on {topic}, first confirm the customer's identity, then check "
            f"ticket history item {rng.randint(100, 999)}, quote policy clause "
            f"{rng.randint(1, 40)}.{rng.randint(1, 9)}, and never promise a resolution time "
            f"shorter than {rng.randint(2, 72)} hours. Escalate to tier {rng.randint(2, 3)} when "
            f"the amount exceeds {rng.randint(50, 5000)} dollars."
        )
        parts.append(rule)
        n += len(rule.split())
        section += 1
    return "\n".join(parts)


def user_turn(i: int, words: int) -> str:
    rng = random.Random(1000 + i)
    topic = TOPICS[i % len(TOPICS)]
    filler = " ".join(
        rng.choice(
            (
                "please",
                "urgent",
                "order",
                "account",
                "today",
                "again",
                "invoice",
                "email",
                "help",
                "thanks",
            )
        )
        for _ in range(words)
    )
    return f"Customer {i} writes about {topic}: {filler}. What should I answer?"


# -- the daemon -------------------------------------------------------------------------------


def api_key(k: int) -> str:
    return f"sk-bench-tenant-{k}"


def start(
    workdir: Path, model: str, engine: dict[str, Any], args: argparse.Namespace, keys: int = 0
) -> DaemonProcess:
    """The daemon on `model` with `engine` settings on top of the config below, and `keys` API
    keys (api_key(0), ...; none: an open API); returns once it is ready."""
    cfg = write_config(
        workdir / "config.toml",
        workdir / "data",
        model,
        server={"max_queue_len": 1024},
        engine={"max_num_seqs": args.max_num_seqs, **engine},
        api_keys=[{"name": f"tenant-{k}", "key": api_key(k)} for k in range(keys)],
    )
    return DaemonProcess.start(cfg, timeout=300)


async def chat(client: Any, model: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    text = []
    times: list[float] = []  # arrival of each content chunk (inter-token latencies)
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            if ttft is None:
                ttft = times[-1] - t0
            text.append(chunk.choices[0].delta.content)
    cached = 0
    if usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens or 0
    return {
        "ttft": ttft,
        "e2e": time.perf_counter() - t0,
        "text": "".join(text),
        "prompt": usage.prompt_tokens,
        "cached": cached,
        "completion": usage.completion_tokens,
        "itl": [b - a for a, b in itertools.pairwise(times)],
    }


async def system_workload(url: str, args: argparse.Namespace, keys: int = 0) -> dict[str, Any]:
    """Request i goes with API key i mod `keys` (none: the open API)."""
    import openai

    clients = [
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=3600)
        for key in ([api_key(k) for k in range(keys)] or ["none"])
    ]
    client = clients[0]
    model = (await client.models.list()).data[0].id
    system = system_prompt(args.system_words)
    # Warm up (not measured) on an unrelated prompt: no cache entry for the system prompt.
    await chat(client, model, [{"role": "user", "content": "Hello there"}], 4)
    rng = random.Random(7)

    async def one(i: int) -> dict[str, Any]:
        await asyncio.sleep(i / args.rate)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": user_turn(i, rng.randint(40, 75))},
        ]
        return await chat(clients[i % len(clients)], model, messages, args.output_len)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(args.system_requests)))
    wall = time.perf_counter() - t0
    for c in clients:
        await c.close()
    ttfts = [r["ttft"] for r in results]
    prompt = sum(r["prompt"] for r in results)
    return {
        "requests": len(results),
        "prompt_tokens_mean": prompt / len(results),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "output_tok_s": sum(r["completion"] for r in results) / wall,
        "cached_share": sum(r["cached"] for r in results) / prompt,
        "wall_s": wall,
    }


async def multiturn_workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    await chat(client, model, [{"role": "user", "content": "Hello there"}], 4)
    totals = {"prompt": 0, "cached": 0, "completion": 0}

    async def conversation(c: int) -> None:
        messages = [{"role": "system", "content": f"You are assistant number {c}. Be brief."}]
        for t in range(args.turns):
            messages.append({"role": "user", "content": user_turn(100 * c + t, 30)})
            r = await chat(client, model, messages, args.turn_output_len)
            messages.append({"role": "assistant", "content": r["text"]})
            for k in totals:
                totals[k] += r[k]

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    wall = time.perf_counter() - t0
    await client.close()
    return {
        "conversations": args.conversations,
        "turns": args.turns,
        "prompt_tokens": totals["prompt"],
        "prompt_tokens_computed": totals["prompt"] - totals["cached"],
        "cached_share": totals["cached"] / totals["prompt"],
        "wall_s": wall,
    }


def daemon_pair(name: str, workload: Any, model: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for caching in (False, True):
        label = "on" if caching else "off"
        with tempfile.TemporaryDirectory(prefix=f"prefix-{name}-") as tmp:
            log(f"{name}: cache {label}: starting the daemon")
            d = start(Path(tmp), model, {"enable_prefix_caching": caching}, args)
            try:
                out[label] = asyncio.run(workload(d.url, args))
            except Exception:
                log(d.log_tail())
                raise
            finally:
                d.stop(timeout=60, check=False)
        log(f"{name}: cache {label}: {json.dumps(out[label])}")
    return out


def isolation(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The system workload, cache on: an open API (one shared cache), 1 key, --keys keys
    (isolation: key, the default)."""
    out: dict[str, Any] = {}
    for keys in (0, 1, args.keys):
        label = f"{keys}_keys" if keys else "open"
        with tempfile.TemporaryDirectory(prefix=f"prefix-isolation-{keys}-") as tmp:
            log(f"isolation: {keys} API key(s): starting the daemon")
            d = start(Path(tmp), model, {"enable_prefix_caching": True}, args, keys=keys)
            try:
                out[label] = asyncio.run(system_workload(d.url, args, keys=keys))
            except Exception:
                log(d.log_tail())
                raise
            finally:
                d.stop(timeout=60, check=False)
        log(f"isolation: {label}: {json.dumps(out[label])}")
    return out


# -- offline, nothing shared ----------------------------------------------------------------


def nosharing(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from controlplane.engine import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=args.max_num_seqs)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts, params = [], []
    for _ in range(args.offline_requests):
        prompts.append([rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))])
        params.append(
            SamplingParams(max_tokens=rng.randint(16, 128), temperature=0, ignore_eos=True)
        )
    useful = sum(p.max_tokens for p in params)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm up
    figures: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(args.repeats):
        order = ("off", "on") if rep % 2 == 0 else ("on", "off")
        for label in order:
            llm.engine.update_settings(enable_prefix_caching=label == "on")
            llm.engine.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            figures[label].append(useful / (time.perf_counter() - t0))
            log(f"nosharing: repeat {rep} cache {label}: {figures[label][-1]:.1f} output tok/s")
    hits = llm.engine.stats().prefix_cache_hits_total
    off, on = statistics.median(figures["off"]), statistics.median(figures["on"])
    return {"off_tok_s": off, "on_tok_s": on, "ratio": on / off, "cache_hits_tokens": hits}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="engine.model (default: SmolLM2's GGUF)")
    p.add_argument(
        "--only", choices=("system", "multiturn", "nosharing", "isolation"), action="append"
    )
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--system-requests", type=int, default=64)
    p.add_argument("--system-words", type=int, default=1500, help="~2,000 tokens")
    p.add_argument("--rate", type=float, default=1.0, help="system workload, requests/s")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-output-len", type=int, default=48)
    p.add_argument("--offline-requests", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keys", type=int, default=4, help="isolation: API keys of the second run")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    only = set(args.only or ("system", "multiturn", "nosharing", "isolation"))
    report: dict[str, Any] = {"cpu": cpu_name()}
    if "nosharing" in only:
        report["nosharing"] = nosharing(args.model, args)
    if "multiturn" in only:
        report["multiturn"] = daemon_pair("multiturn", multiturn_workload, args.model, args)
    if "system" in only:
        report["system"] = daemon_pair("system", system_workload, args.model, args)
    if "isolation" in only:
        report["isolation"] = isolation(args.model, args)

    log("\n== prefix caching, cache on vs off (same run) ==")
    if "system" in report:
        off, on = report["system"]["off"], report["system"]["on"]
        log(
            f"shared system prompt ({on['requests']} requests, ~{on['prompt_tokens_mean']:.0f} "
            f"prompt tokens, {args.rate:g} req/s): TTFT p50 {off['ttft_p50_s']:.2f}s -> "
            f"{on['ttft_p50_s']:.2f}s ({off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x lower, target "
            f">= 5x); p99 {off['ttft_p99_s']:.2f}s -> {on['ttft_p99_s']:.2f}s; output tok/s "
            f"{off['output_tok_s']:.1f} -> {on['output_tok_s']:.1f}; cached share "
            f"{on['cached_share']:.1%}"
        )
    if "multiturn" in report:
        off, on = report["multiturn"]["off"], report["multiturn"]["on"]
        log(
            f"multi-turn ({on['conversations']} x {on['turns']} turns): prompt tokens computed "
            f"{off['prompt_tokens_computed']} -> {on['prompt_tokens_computed']} of "
            f"{on['prompt_tokens']}; from the cache {on['cached_share']:.1%} (target >= 70%); "
            f"total {off['wall_s']:.1f}s -> {on['wall_s']:.1f}s"
        )
    if "isolation" in report:
        r = report["isolation"]
        shared, one, many = r["open"], r["1_keys"], r[f"{args.keys}_keys"]
        log(
            f"per-key isolation, shared system prompt ({one['requests']} requests, "
            f"~{one['prompt_tokens_mean']:.0f} prompt tokens): cached share "
            f"{shared['cached_share']:.1%} open API, {one['cached_share']:.1%} with 1 key, "
            f"{many['cached_share']:.1%} with {args.keys} keys; TTFT p50 "
            f"{shared['ttft_p50_s']:.2f}s / {one['ttft_p50_s']:.2f}s / {many['ttft_p50_s']:.2f}s"
        )
    if "nosharing" in report:
        r = report["nosharing"]
        log(
            f"no sharing (offline, {args.offline_requests} random prompts): {r['off_tok_s']:.1f} "
            f"-> {r['on_tok_s']:.1f} output tok/s, on/off {r['ratio']:.3f} (target >= 0.98); "
            f"cache hits {r['cache_hits_tokens']} tokens"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
