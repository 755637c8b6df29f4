"""A worked capacity plan (issue 57): a daemon records loadgen traffic, `controlplane calibrate`
fits the simulator's cost model for its config, and `controlplane plan` answers for the
recorded window at growth factors 1, 2, 4 and 8 within the targets: the best config, the
instances, their cost per hour and per million tokens, the headroom, and how long each plan
took.

What is measured
----------------
The `--model` demo model (default small) in float32, compile off, `max_num_seqs` 8; loadgen's
Poisson traffic (`--requests` at `--rate` a second, prompts of 16-96 tokens, 8-32 completion
tokens, streamed) plus the recording harness's shared-prefix and n = 2 requests
(harness/recording.py); targets `--slo` (default TTFT p99 500 ms, ITL p99 100 ms); the GPU price
of the config (`jobs.gpu_hourly_usd`, default $2 an hour).

    python -m benchmarks.capacity_plan
    python -m benchmarks.capacity_plan --requests 600 --rate 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import write_config
from harness.recording import record_traffic


def cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "controlplane", *args], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"controlplane {args[0]} failed:\n{done.stderr}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--slo", default="ttft_p99=500ms,itl_p99=100ms")
    parser.add_argument("--growth", default="1,2,4,8")
    args = parser.parse_args()
    from controlplane.engine.demo_model import write_demo_model

    folder = Path(tempfile.mkdtemp(prefix="capacity-plan-"))
    model = write_demo_model(folder / "model", args.model)
    config = write_config(
        folder / "cp.toml",
        folder / "data",
        model,
        engine={"compile": "off", "max_num_seqs": 8},
        store={"flush_interval_s": 0.1},
    )
    print(f"recording {args.requests} requests at {args.rate:g}/s ...", flush=True)
    since, until = record_traffic(config, requests=args.requests, rate=args.rate)
    cost = folder / "cost.json"
    print(cli("calibrate", "--config", str(config), "--out", str(cost)).strip(), flush=True)
    window = ["--db", f"sqlite:///{folder / 'data' / 'controlplane.db'}", "--config", str(config),
              "--since", since.isoformat(), "--until", until.isoformat()]  # fmt: skip
    recorded = json.loads(cli("replay", *window, "--simulate", str(cost), "--json"))
    rec, sim = recorded["figures"]
    print(
        f"window: {rec['requests']} requests, {rec['prompt_tokens']:,} prompt and "
        f"{rec['completion_tokens']:,} completion tokens; recorded TTFT p99 "
        f"{rec['ttft_p99_ms']:.1f} ms, ITL p99 {rec['itl_p99_ms']:.1f} ms; simulated "
        f"{sim['ttft_p99_ms']:.1f} / {sim['itl_p99_ms']:.1f} ms"
    )
    print(f"{'growth':>6} {'instances':>9} {'max_num_seqs':>12} {'budget':>6} {'preempt':>9} "
          f"{'$/hour':>7} {'$/M tok':>8} {'headroom ttft/itl':>18} {'plan s':>7}")  # fmt: skip
    for growth in args.growth.split(","):
        t0 = time.perf_counter()
        out = json.loads(
            cli(
                "plan",
                *window,
                "--cost-model",
                str(cost),
                "--growth",
                growth,
                "--slo",
                args.slo,
                "--json",
            )
        )
        took = time.perf_counter() - t0
        best = out["candidates"][0]
        room = best["headroom"]
        print(
            f"{growth:>6} {best['instances'] or '-':>9} {best['max_num_seqs']:>12} "
            f"{best['max_num_batched_tokens']:>6} {best['preemption_mode']:>9} "
            f"{best['cost_per_hour_usd'] or 0:>7.2f} {best['cost_per_mtok_usd'] or 0:>8.4f} "
            f"{room['ttft'] or 0:>8.0%} / {room['itl'] or 0:>6.0%} {took:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
