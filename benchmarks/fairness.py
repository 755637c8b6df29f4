"""Fair scheduling between API keys (issue 55): a light key's time to first token alone, beside a
flooding key under engine.scheduling_policy fcfs, and under fair; the flooding key's completion
tokens per second under both.

What is measured
----------------
A daemon in its own process (``controlplane serve``, the demo model ``--size``) with two config
file keys. ``alone``: the light key sends ``--requests`` short streamed completions (8 prompt
tokens, 2 completion tokens) one after another; its time to first token is the baseline of the
ratios. ``fcfs`` and ``fair``: the same while the flooding key keeps ``--flood`` completions of
``--prompt-tokens`` random prompt tokens (no prefix hits) and 8 completion tokens in flight, the
policy switched live through ``PATCH /admin/config``. The engine's token budget is small
(``--budget`` tokens a step, ``max_num_seqs`` 8), so the flood's prefills queue.

    python -m benchmarks.fairness
    python -m benchmarks.fairness --requests 10 --flood 16    # the test's size
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from controlplane.engine.demo_model import write_demo_model
from harness import ADMIN_TOKEN, DaemonProcess, admin_sections, fairness, write_config

KEYS = {"flood": "sk-flood-0123456789abcdef", "light": "sk-light-0123456789abcdef"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="light requests a policy")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between them")
    parser.add_argument("--flood", type=int, default=32, help="flooding requests in flight")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens")
    parser.add_argument("--size", default="small", help="demo model size (tiny, small)")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="fairness-"))
    model = write_demo_model(folder / "model", size=args.size)
    engine = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": args.budget,
        "prefill_chunk_size": args.budget,
        "max_model_len": args.prompt_tokens + 64,
    }
    sections = admin_sections(
        engine=engine, api_keys=[{"name": n, "key": k} for n, k in KEYS.items()]
    )
    cfg = write_config(folder / "cp.toml", folder / "data", model, **sections)
    daemon = DaemonProcess.start(cfg, timeout=300)
    flood = fairness.Flood(args.flood, args.prompt_tokens, 8)
    try:
        compiled = fairness.wait_compiled(daemon.url, ADMIN_TOKEN)
        vocab = 1024
        fairness.run(daemon.url, "model", KEYS["light"], None, flood, 5, vocab)  # warm
        runs = {}
        for policy in ("alone", "fcfs", "fair"):
            if policy != "alone":
                fairness.set_policy(daemon.url, ADMIN_TOKEN, policy)
            flood_key = None if policy == "alone" else KEYS["flood"]
            runs[policy] = fairness.run(
                daemon.url,
                "model",
                KEYS["light"],
                flood_key,
                flood,
                args.requests,
                vocab,
                interval=args.interval,
            )
            print(f"{policy}: done", flush=True)
    finally:
        daemon.stop(timeout=600)
    base = runs["alone"]
    print(
        f"light key: {args.requests} requests; flood: {args.flood} in flight x "
        f"{args.prompt_tokens} prompt tokens; budget {args.budget} tokens/step; {args.size} model"
        f" (compiled step: {compiled})"
    )
    print(
        f"{'run':<6} {'TTFT p50 ms':>12} {'p99 ms':>9} {'p50 vs alone':>13} {'p99 vs alone':>13}"
        f" {'flood tok/s':>12}"
    )
    for name, run in runs.items():
        print(
            f"{name:<6} {run.p50 * 1e3:>12.1f} {run.p99 * 1e3:>9.1f} {run.p50 / base.p50:>12.1f}x"
            f" {run.p99 / base.p99:>12.1f}x {run.flood_tokens_per_s:>12.1f}"
        )


if __name__ == "__main__":
    main()
