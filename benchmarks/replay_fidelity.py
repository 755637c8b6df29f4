"""How closely `controlplane replay` reproduces a recorded run's latencies (issue 57): a daemon
(`controlplane serve` in its own process) records a Poisson loadgen run, then the replay drives
the recorded window again in-process against the same config; recorded and replayed figures
side by side, with the replayed / recorded ratio of each percentile.

What is measured
----------------
The `--model` demo model (default small; `smollm2` for the real model), `engine.compile` as
given (default off: a compile would put minutes of warm-up before each side), `--requests`
streamed requests arriving at `--rate` per second (loadgen: prompts of 16-96 tokens, 8-32
completion tokens, EOS ignored), plus two requests sharing a 64-token prefix and one with
n = 2 (harness/recording.py). The loadgen client runs on the same host as the daemon, as in
the tests; the replay has neither the HTTP front nor the client.

    python -m benchmarks.replay_fidelity
    python -m benchmarks.replay_fidelity --requests 200 --rate 8 --model smollm2 --compile auto
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import write_config
from harness.recording import record_traffic

LINES = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "queue_p99_ms",
    "throughput_tok_s",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="demo model size, or smollm2")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rate", type=float, default=6.0)
    parser.add_argument("--compile", default="off")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="replay-fidelity-"))
    model: Path | str = "smollm2"
    if args.model != "smollm2":
        from controlplane.engine.demo_model import write_demo_model

        model = write_demo_model(folder / "model", args.model)
    config = write_config(
        folder / "cp.toml",
        folder / "data",
        model,
        engine={"compile": args.compile, "max_num_seqs": args.max_num_seqs},
        store={"flush_interval_s": 0.1},
    )
    print(f"recording {args.requests} requests at {args.rate:g}/s ...", flush=True)
    since, until = record_traffic(config, requests=args.requests, rate=args.rate)
    url = f"sqlite:///{folder / 'data' / 'controlplane.db'}"
    print("replaying ...", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "controlplane", "replay", "--db", url, "--config", str(config),
         "--since", since.isoformat(), "--until", until.isoformat(), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    recorded, replayed = json.loads(done.stdout)["figures"]
    print(f"{args.model} model, compile {args.compile}, {recorded['requests']} requests")
    print(f"{'figure':<18}{'recorded':>12}{'replayed':>12}{'ratio':>8}")
    for name in LINES:
        a, b = recorded[name], replayed[name]
        ratio = f"{b / a:.2f}x" if a and b is not None else "–"
        print(f"{name:<18}{a:>12.2f}{b:>12.2f}{ratio:>8}")
    for name in ("prompt_tokens", "completion_tokens"):
        print(f"{name:<18}{recorded[name]:>12,}{replayed[name]:>12,}")
    a, b = recorded["prefix_hit_rate"], replayed["prefix_hit_rate"]
    print(f"{'prefix_hit_rate':<18}{a:>12.3f}{b:>12.3f}")


if __name__ == "__main__":
    main()
