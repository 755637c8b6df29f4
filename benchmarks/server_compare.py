"""Server against server: `controlplane serve` and llama.cpp's `llama-server` on the same GGUF
file and thread count, driven by the same streaming client.

llama-server is built from the source llama-cpp-python's source distribution carries (see
`benchmarks/llamacpp_tools.py` for the build; a benchmark-only build, never a dependency):

    python -m benchmarks.server_compare --llama-bin /tmp/lcpp/llama_cpp_python-*/vendor/llama.cpp/build/bin

What is measured
----------------
Each server in turn, alone on the machine: llama-server with `-np CLIENTS` slots (continuous
batching, its default) and a context of CLIENTS x (prompt + output + 64) tokens; the daemon on
its defaults (`[engine] model` = the GGUF, plus any `--engine key=value` overrides, each a
separate daemon). A few short requests warm each server up (not measured), then
`controlplane.client.loadgen.run_load` (the openai SDK, streaming completions with
`ignore_eos`) keeps `--clients` requests in flight (a closed loop) until `--requests` have
finished: prompts of `--prompt-len` random token ids (~150 English words is ~200 tokens),
`--output-len` new tokens each. The workload (seeded) is the same for both servers.

Figures: output tokens/s (completion tokens / wall time), TTFT p50/p99, ITL p50/p99 (gaps
between streamed chunks), failed requests; ratios are daemon / llama-server (for latencies,
below 1 is better). Medians over `--repeats`. Figures to read, never timed assertions: the
client shares the machine's CPUs with the server under test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.engine_overrides import parse_overrides
from benchmarks.llamacpp_compare import gguf_model, log
from controlplane.client.loadgen import LoadConfig, run_load
from harness import DaemonProcess, free_port, write_config

METRICS = ("output_throughput", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")


def metric(summary: dict[str, Any], name: str) -> float | None:
    if name in summary:
        return summary[name]
    stat, _, q = name.rpartition("_")  # "ttft_ms_p50" -> summary["ttft_ms"]["p50"]
    return (summary.get(stat) or {}).get(q)


class LlamaServer:
    """llama-server in a child process; `url` once /health answers 200."""

    def __init__(self, bin_dir: Path, model: str, args: argparse.Namespace, log_path: Path):
        port = free_port()
        ctx = args.clients * (args.prompt_len[1] + args.output_len[1] + 64)
        self.log_path = log_path
        with log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(bin_dir / "llama-server"),
                    "-m",
                    model,
                    "-t",
                    str(args.threads),
                    "-tb",
                    str(args.threads),
                    "-np",
                    str(args.clients),
                    "-c",
                    str(ctx),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: see {log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server not ready in {args.startup_timeout}s")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def drive(url: str, args: argparse.Namespace, repeat: int) -> dict[str, Any]:
    """Warm-up, then the measured closed loop; the run's summary as a dict."""
    common = dict(url=url, stream=True, rate=math.inf, concurrency_limit=args.clients)
    asyncio.run(
        run_load(
            LoadConfig(**common, num_requests=4, prompt_len=(16, 16), output_len=(4, 4), seed=999)
        )
    )
    summary = asyncio.run(
        run_load(
            LoadConfig(
                **common,
                num_requests=args.requests,
                prompt_len=args.prompt_len,
                output_len=args.output_len,
                seed=args.seed + repeat,
            )
        )
    )
    return summary.to_dict()


def wait_compiled(url: str, token_file: Path, timeout: float) -> None:
    """`compile = auto` on a CPU compiles the decode step in the background while the daemon
    serves: measure it once warm, as it serves after its first minutes."""
    headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        state = httpx.get(url + "/admin/stats", headers=headers, timeout=10).json()["compiled_step"]
        if state != "warming":
            log(f"  compiled step {state} after {time.perf_counter() - t0:.1f}s more")
            return
        time.sleep(0.5)
    raise RuntimeError(f"the compiled step still warming after {timeout}s")


def run_server(name: str, start, args: argparse.Namespace) -> dict[str, Any]:
    """`start()` -> (url, stop); the medians over the repeats of each metric."""
    runs = []
    for repeat in range(args.repeats):
        t0 = time.perf_counter()
        url, stop = start()
        log(f"{name}: ready in {time.perf_counter() - t0:.1f}s; {args.requests} requests ...")
        try:
            s = drive(url, args, repeat)
        finally:
            stop()
        log(
            f"  {s['output_throughput']:.1f} tok/s, ITL p99 {metric(s, 'itl_ms_p99'):.0f} ms, "
            f"failed {s['requests_failed']}"
        )
        runs.append(s)
    out: dict[str, Any] = {"name": name, "requests_failed": sum(r["requests_failed"] for r in runs)}
    for m in METRICS:
        vals = [v for r in runs if (v := metric(r, m)) is not None]
        out[m] = statistics.median(vals) if vals else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="controlplane serve vs llama-server under the same streaming load (figures).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's build/bin")
    p.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", type=int, default=16, help="requests kept in flight")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-len", default="200-200", help="token range A-B")
    p.add_argument("--output-len", default="128-128", help="token range A-B")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument(
        "--engine",
        action="append",
        default=None,
        help="daemon [engine] overrides, e.g. compile=on (repeat to compare configurations)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.prompt_len = tuple(int(x) for x in args.prompt_len.split("-"))
    args.output_len = tuple(int(x) for x in args.output_len.split("-"))

    model = gguf_model(args.model)
    log(f"model {model}; {args.threads} threads; {args.clients} clients")
    with tempfile.TemporaryDirectory(prefix="cp-servers-") as tmp:
        work = Path(tmp)

        def llama():
            server = LlamaServer(args.llama_bin, model, args, work / "llama-server.log")
            return server.url, server.stop

        results = [run_server("llama-server", llama, args)]
        for config in args.engine or [""]:
            overrides = parse_overrides(config)

            def daemon(overrides=overrides):
                run_dir = Path(tempfile.mkdtemp(dir=work))
                cfg = write_config(
                    run_dir / "config.toml",
                    run_dir / "data",
                    model,
                    engine={"max_num_seqs": max(args.clients, 32), **overrides},
                )
                d = DaemonProcess.start(cfg, timeout=args.startup_timeout)
                wait_compiled(d.url, run_dir / "data" / "admin_token", args.startup_timeout)
                return d.url, lambda: d.stop(timeout=60, check=False)

            results.append(
                run_server(f"controlplane [{config}]" if config else "controlplane", daemon, args)
            )

    base = results[0]
    log("")
    log(f"{'server':<36} " + " ".join(f"{m:>18}" for m in METRICS))
    for r in results:
        cells = []
        for m in METRICS:
            v, b = r[m], base[m]
            ratio = f" ({v / b:.2f}x)" if v is not None and b and r is not base else ""
            cells.append(f"{'n/a' if v is None else format(v, '.1f')}{ratio}".rjust(18))
        log(f"{r['name']:<36} " + " ".join(cells))
    if any(r["requests_failed"] for r in results):
        log("failed requests: " + ", ".join(f"{r['name']} {r['requests_failed']}" for r in results))
    if args.json:
        args.json.write_text(json.dumps({"model": model, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
