"""The daemon on the device with its utilization sampler on: real NVML readings in
`gpu_samples`, and the cost per million tokens the rollup computes for a throughput run.

What it does
------------
Starts `controlplane serve` (the shared harness: a fresh data directory, SQLite store, port 0)
on a random-weight model of `--shape` (benchmarks.gpu_seeds' model directories: the weights
are generated on the device at load), with `[jobs] utilization_interval_s = 1` and
`rollup_interval_s = 2` (the sampler reads every GPU through NVML at each tick),
`gpu_hourly_usd = --gpu-hourly-usd` (2.0, the config's default) and `peak_flops` = the
device's dense bf16 peak where known (H100 / H200: 989e12; MFU is left empty otherwise). Then
a closed-loop throughput run with the project's own load generator (`controlplane loadgen
--rate inf --concurrency-limit C --requests N --stream`, random token-id prompts, EOS
ignored), waits for two more samples, stops the daemon with SIGTERM (its last cost rollup runs
at shutdown), and reads from its SQLite file: the latest `utilization_samples` rows with their
`gpu_samples` rows, and the run's `cost_rollups` rows (`gpu_usd_per_mtok_completion`: the busy
GPU cost shared over computed tokens; the "(idle)" row carries the idle time). Prints them,
with the run's cost per million output tokens all in (every row's GPU cost over the output
tokens) and the load generator's summary.

On a machine without NVML (no driver, or no GPU) it says so, runs the same on the CPU with the
tiny shape (`gpu_samples` then stays empty: the sampler writes engine figures only) and exits
0 after printing the rollup: the CPU path is the test of the whole chain.
Where a package the daemon or the load generator needs is missing (a device image without the
project's dependencies), it names them and exits 3: carry them as wheels
(benchmarks/README.md).

    python -m benchmarks.gpu_daemon --json /tmp/daemon.json           # on the device: 1b shape
    python -m benchmarks.gpu_daemon --shape 8b --requests 128 --concurrency 64
    python -m benchmarks.gpu_daemon --quick --json -                   # CPU: the tiny shape
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# What the daemon and the load generator import at run time (module -> distribution).
NEEDED = {
    "sqlalchemy": "SQLAlchemy",
    "alembic": "alembic",
    "litestar": "litestar",
    "msgspec": "msgspec",
    "uvicorn": "uvicorn",
    "apscheduler": "APScheduler",
    "tzlocal": "tzlocal",
    "httpx": "httpx",
    "openai": "openai",
    "pydantic": "pydantic",
    "pynvml": "nvidia-ml-py",
    "prometheus_client": "prometheus-client",
}
# Dense bf16 peak FLOP/s by device name, for the rollup's MFU (0: unknown, MFU left empty).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def missing_modules() -> list[str]:
    out = []
    for module, dist in NEEDED.items():
        try:
            importlib.import_module(module)
        except Exception:
            out.append(dist)
    return out


def nvml_state() -> tuple[bool, str]:
    """Whether NVML answers here, and a line saying what it sees or why not."""
    try:
        import pynvml
    except Exception as exc:
        return False, f"pynvml not importable ({type(exc).__name__}: {exc})"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return False, f"NVML unavailable ({type(exc).__name__}: {exc})"
    try:
        n = int(pynvml.nvmlDeviceGetCount())
        names = []
        for i in range(n):
            raw = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(raw.decode() if isinstance(raw, bytes) else str(raw))
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    finally:
        pynvml.nvmlShutdown()
    if n == 0:
        return False, "NVML sees no GPU"
    return True, f"{n} GPU(s) via NVML: {', '.join(names)} (driver {driver})"


def read_store(db: Path, samples: int) -> dict[str, Any]:
    """The latest `samples` utilization samples with their GPU rows, every cost rollup row."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    try:
        util = [
            dict(r)
            for r in con.execute(
                "SELECT * FROM utilization_samples ORDER BY id DESC LIMIT ?", (samples,)
            )
        ]
        count = con.execute("SELECT COUNT(*) FROM utilization_samples").fetchone()[0]
        ids = [u["id"] for u in util] or [-1]
        marks = ",".join("?" * len(ids))
        gpus = [
            dict(r)
            for r in con.execute(
                f"SELECT * FROM gpu_samples WHERE sample_id IN ({marks}) ORDER BY id", ids
            )
        ]
        gpu_count = con.execute("SELECT COUNT(*) FROM gpu_samples").fetchone()[0]
        # The latest rows come after the load (idle, 0%: the H200 run of 2026-11-30 showed only
        # those); the busiest one is the reading taken under load.
        busiest = con.execute(
            "SELECT * FROM gpu_samples ORDER BY utilization_pct DESC, power_w DESC LIMIT 1"
        ).fetchone()
        rollups = [
            dict(r) for r in con.execute("SELECT * FROM cost_rollups ORDER BY hour_bucket, id")
        ]
        requests = con.execute(
            "SELECT COUNT(*), COALESCE(SUM(completion_tokens), 0) FROM requests"
        ).fetchone()
    finally:
        con.close()
    for row in (*util, *rollups):
        row.pop("updated_at", None)
    return {
        "utilization_samples": count,
        "gpu_sample_rows": gpu_count,
        "latest_samples": util,
        "latest_gpu_samples": gpus,
        "busiest_gpu_sample": None if busiest is None else dict(busiest),
        "cost_rollups": rollups,
        "request_rows": requests[0],
        "request_completion_tokens": requests[1],
    }


def cost_figures(rollups: list[dict[str, Any]]) -> dict[str, Any]:
    work = [r for r in rollups if r["api_key_name"] != "(idle)"]
    completion = sum(r["completion_tokens"] for r in work)
    computed = sum(
        r["prompt_tokens"] - r["cached_prompt_tokens"] + r["completion_tokens"] for r in work
    )
    busy = sum(r["gpu_cost_usd"] for r in work)
    every = sum(r["gpu_cost_usd"] for r in rollups)
    return {
        "completion_tokens": completion,
        "computed_tokens": computed,
        "gpu_cost_usd_busy": busy,
        "gpu_cost_usd_all": every,
        # The rollup's own rate (busy cost / computed tokens), as its rows give it.
        "gpu_usd_per_mtok_completion": [r["gpu_usd_per_mtok_completion"] for r in work],
        "busy_usd_per_mtok_output": busy / completion * 1e6 if completion else None,
        "all_in_usd_per_mtok_output": every / completion * 1e6 if completion else None,
        "list_usd_per_mtok_completion": [r["list_usd_per_mtok_completion"] for r in work],
        "mean_utilization": work[0]["mean_utilization"] if work else None,
        "mfu": work[0]["mfu"] if work else None,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default=None, help="8b, 1b (default with a GPU) or tiny (without)")
    p.add_argument("--requests", type=int, default=None, help="256; 8 with --quick")
    p.add_argument("--concurrency", type=int, default=None, help="in flight: 32; 4 with --quick")
    p.add_argument("--prompt-len", default=None, help="A-B tokens: 512-512; 16-32 with --quick")
    p.add_argument("--output-len", default=None, help="A-B tokens: 256-256; 8-8 with --quick")
    p.add_argument("--quick", action="store_true", help="a short run (the CPU smoke run)")
    p.add_argument("--gpu-hourly-usd", type=float, default=2.0, help="[jobs] gpu_hourly_usd")
    p.add_argument("--start-timeout", type=float, default=420.0, help="daemon ready within")
    p.add_argument("--model-root", type=Path, default=REPO / ".bench", help="model directories")
    p.add_argument("--keep", type=Path, default=None, help="data directory to keep (default: temp)")
    p.add_argument("--json", default=None, help="write the figures here ('-': to stdout only)")
    args = p.parse_args(argv)
    for name, full, short in (
        ("requests", 256, 8),
        ("concurrency", 32, 4),
        ("prompt_len", "512-512", "16-32"),
        ("output_len", "256-256", "8-8"),
    ):
        if getattr(args, name) is None:
            setattr(args, name, short if args.quick else full)
    return args


def write_json(dest: str | None, out: dict[str, Any]) -> None:
    if dest and dest != "-":
        Path(dest).write_text(json.dumps(out, indent=2, default=str) + "\n")


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(f"gpu_daemon: signal {signum} (a timeout?): stopping the daemon")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (gpu_check.sh's `timeout`) unwinds like an exception: the daemon is stopped, the
    # temporary directory removed and what was measured written.
    signal.signal(signal.SIGTERM, _terminated)
    missing = missing_modules()
    if missing:
        print(
            f"gpu_daemon: missing packages: {', '.join(missing)}. Carry them (and their own "
            "dependencies) as wheels: benchmarks/README.md, gpu_daemon.",
            file=sys.stderr,
        )
        return 3
    import torch

    from benchmarks.gpu_seeds import SHAPES, ensure_random_model

    has_nvml, nvml_line = nvml_state()
    on_gpu = torch.cuda.is_available()
    log(("NVML: " if has_nvml else "NVML absent: ") + nvml_line)
    if not on_gpu:
        log("no CUDA device: the daemon runs on the CPU (tiny shape unless --shape), no GPU rows")
    shape = args.shape or ("1b" if on_gpu else "tiny")
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in device_name), 0.0)
    model = ensure_random_model(shape, args.model_root)
    vocab = SHAPES[shape]["vocab_size"]
    engine: dict[str, Any] = (
        {"device": "cuda", "dtype": "bfloat16", "attention_backend": "triton"}
        if on_gpu
        else {"device": "cpu", "attention_backend": "torch", "compile": "off"}
    )
    engine.update(max_num_seqs=max(args.concurrency, 1), enable_prefix_caching=False)
    if on_gpu:
        engine.update(gpu_memory_utilization=0.8, max_num_batched_tokens=8192)
        engine["prefill_chunk_size"] = 2048
    else:
        engine["kv_cache_memory_bytes"] = 64 << 20
    out: dict[str, Any] = {
        "device": device_name,
        "shape": shape,
        "nvml": has_nvml,
        "nvml_line": nvml_line,
        "gpu_hourly_usd": args.gpu_hourly_usd,
        "peak_flops": peak,
        "engine": engine,
    }
    tmp = None
    if args.keep:
        data = args.keep
        data.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="gpu-daemon-")
        data = Path(tmp.name)
    try:
        rc = run(args, out, data, model, engine, vocab, peak)
    except SystemExit as exc:
        out["error"] = str(exc)
        rc = 1
    finally:
        if tmp is not None:
            tmp.cleanup()
    write_json(args.json, out)
    print_summary(out, sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        print(json.dumps(out, indent=2, default=str))
    return rc


def run(
    args: argparse.Namespace,
    out: dict[str, Any],
    data: Path,
    model: Path,
    engine: dict[str, Any],
    vocab: int,
    peak: float,
) -> int:
    from harness import DaemonError, DaemonProcess, write_config

    jobs = {
        "utilization_interval_s": 1.0,
        "rollup_interval_s": 2.0,
        "gpu_hourly_usd": args.gpu_hourly_usd,
        "peak_flops": peak,
    }
    cfg = write_config(
        data / "controlplane.toml",
        data / "data",
        model,
        engine=engine,
        jobs=jobs,
        store={"flush_interval_s": 0.2},
        server={"start_timeout_s": 0.0},
    )
    # As the tests' daemons: the CPU kernels and inductor's graphs in torch's usual caches,
    # not rebuilt under a fresh data directory.
    env: dict[str, str] = {}
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        from torch.utils.cpp_extension import _get_build_directory

        env["TORCH_EXTENSIONS_DIR"] = os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path(_get_build_directory("", False)).resolve())
        )
        env["TORCHINDUCTOR_CACHE_DIR"] = os.environ.get(
            "TORCHINDUCTOR_CACHE_DIR", default_cache_dir()
        )
    except Exception:  # a torch without these helpers: the daemon's own defaults
        pass
    t0 = time.perf_counter()
    try:
        daemon = DaemonProcess.start(cfg, timeout=args.start_timeout, env=env)
    except DaemonError as exc:
        out["error"] = f"daemon did not start: {exc}"
        log(out["error"])
        return 1
    out["daemon_start_s"] = round(time.perf_counter() - t0, 2)
    log(f"daemon ready at {daemon.url} in {out['daemon_start_s']} s")
    write_json(args.json, out)
    rc = 0
    try:
        load_json = data / "loadgen.json"
        cmd = [
            sys.executable,
            "-m",
            "controlplane",
            "loadgen",
            "--url",
            daemon.url,
            "--rate",
            "inf",
            "--requests",
            str(args.requests),
            "--concurrency-limit",
            str(args.concurrency),
            "--prompt-len",
            args.prompt_len,
            "--output-len",
            args.output_len,
            "--token-id-range",
            f"100-{min(vocab, 30000) - 1}",
            "--stream",
            "--json",
            str(load_json),
        ]
        out["loadgen_command"] = " ".join(cmd[1:])
        t1 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        out["loadgen_s"] = round(time.perf_counter() - t1, 2)
        if done.returncode != 0 or not load_json.is_file():
            out["error"] = f"loadgen exited {done.returncode}: {done.stderr[-2000:]}"
            log(out["error"])
            rc = 1
        else:
            summary = json.loads(load_json.read_text())
            out["loadgen"] = {
                k: summary.get(k)
                for k in (
                    "requests_ok",
                    "requests_failed",
                    "errors",
                    "wall_s",
                    "output_throughput",
                    "total_prompt_tokens",
                    "total_completion_tokens",
                    "ttft_ms",
                    "tpot_ms",
                )
            }
        time.sleep(2.5)  # two more sampler ticks, over the end of the run
    finally:
        out["daemon_exit"] = daemon.stop(timeout=120, check=False)
        out["daemon_log_tail"] = daemon.log_tail(15).splitlines()
    db = data / "data" / "controlplane.db"
    if not db.is_file():
        out["error"] = f"no store at {db}"
        return 1
    store = read_store(db, samples=3)
    out["store"] = store
    out["cost"] = cost_figures(store["cost_rollups"])
    if out["nvml"] and not store["latest_gpu_samples"]:
        out["error"] = "NVML answers here, but the sampler wrote no gpu_samples row"
        rc = 1
    return rc


def _f(v: Any, spec: str = ",.2f") -> str:
    return "-" if v is None else format(v, spec)


def print_summary(out: dict[str, Any], stream: Any) -> None:
    def p(line: str) -> None:
        print(line, file=stream)

    p(f"\n{out['device']}, {out['shape']} shape; NVML: {out['nvml_line']}")
    if "daemon_start_s" in out:
        p(f"  daemon ready in {out['daemon_start_s']} s; exit status {out.get('daemon_exit')}")
    load = out.get("loadgen")
    if load:
        p(
            f"  loadgen: {load['requests_ok']} ok, {load['requests_failed']} failed, "
            f"{_f(load['output_throughput'], ',.1f')} output tok/s over {_f(load['wall_s'])} s"
        )
    store = out.get("store")
    if store:
        p(
            f"  store: {store['utilization_samples']} utilization samples, "
            f"{store['gpu_sample_rows']} gpu_samples rows, {store['request_rows']} request rows"
        )
        busiest = store.get("busiest_gpu_sample")
        for label, g in [
            *(("latest", g) for g in store["latest_gpu_samples"][-2:]),
            *((("busiest", busiest),) if busiest else ()),
        ]:
            p(
                f"  gpu_samples ({label}): GPU {g['gpu_index']} {g['name']}: {_f(g['utilization_pct'], '.0f')}% "
                f"busy, {_f((g['memory_used_bytes'] or 0) / 2**30, '.1f')} / "
                f"{_f((g['memory_total_bytes'] or 0) / 2**30, '.1f')} GiB, "
                f"{_f(g['power_w'], '.0f')} W, {_f(g['temperature_c'], '.0f')} C, "
                f"energy {_f(g['interval_energy_j'], ',.0f')} J over the interval"
            )
        if not store["latest_gpu_samples"]:
            p("  gpu_samples: none (NVML absent: the sampler writes the engine's figures only)")
        for r in store["cost_rollups"]:
            p(
                f"  rollup {r['hour_bucket']} {r['api_key_name'] or '(no key)'}: "
                f"{r['completion_tokens']:,} output tokens, GPU ${r['gpu_cost_usd']:.6f} "
                f"({_f(r['gpu_usd_per_mtok_completion'], ',.4f')} $/Mtok), list "
                f"${r['list_cost_usd']:.6f}, covered {r['covered_s']:.1f} s, "
                f"utilization {_f(r['mean_utilization'], '.2f')}, MFU {_f(r['mfu'], '.3f')}"
            )
    cost = out.get("cost")
    if cost:
        p(
            f"  cost per million output tokens at ${out['gpu_hourly_usd']}/GPU-hour: "
            f"{_f(cost['busy_usd_per_mtok_output'], ',.4f')} busy, "
            f"{_f(cost['all_in_usd_per_mtok_output'], ',.4f')} with the idle time"
        )
    if out.get("error"):
        p(f"  error: {out['error'][:800]}")


if __name__ == "__main__":
    sys.exit(main())
