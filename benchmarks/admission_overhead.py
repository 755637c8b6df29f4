"""The overhead of the rate limits' admission checks at the offline throughput workload (issue
55's target: under 2%): the same many-request workload through a daemon with no limits, with
limits on in memory, and with limits on in Redis; requests/s and tokens/s, and their ratio to no
limits measured in the same run.

What is measured
----------------
The workload of ``benchmarks.offline_throughput`` (``--num-requests`` requests, seed 0, all sent
at once: prompts of 32 to 512 random token ids, 16 to 512 completion tokens each, EOS ignored,
greedy) as ``/v1/completions`` requests of one config file key, through ``controlplane serve``
in its own process on the demo model (``--size``) with the offline benchmark's engine settings
(16 sequences, 1024 batched tokens, prefill chunks of 512), the prefix cache off (each run
sends the same prompts: every run after the first would hit it). A run's figures: requests/s and
completion tokens/s over the wall time from the first request sent to the last answer.

* ``none``: [limits] all 0, so admission never calls a limiter (the path of a daemon without
  limits).
* ``memory``: the four limits set live (``PATCH /admin/config``) far above what the run sends
  (every check admits): each request takes a check and a release on the in-process buckets.
* ``redis``: the same limits on a second daemon with ``backend = "redis"`` (``--redis-url``, a
  key name of this run): a Lua script round trip to Redis at admission and another at the end.

Each daemon runs its ``none`` and limited runs in turn, ``--rounds`` times (none, limited, then
limited, none: ABBA), after a run of the workload untimed (the first run of a daemon took 2.3x
its later ones); a limited run is compared with the ``none`` run of its round (on a shared
machine the load drifts between rounds more than inside one) and the median of those ratios is
reported, with their range and the ratio of the medians. Every answer must be a 200; the limited
runs' answers carry the ``x-ratelimit-*`` headers (the checks ran), the ``none`` runs' do not.

    python -m benchmarks.admission_overhead
    python -m benchmarks.admission_overhead --num-requests 16 --rounds 1 --size tiny   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.offline_throughput import load_model_facts, make_workload
from controlplane.engine.demo_model import write_demo_model
from harness import ADMIN_TOKEN, DaemonProcess, admin_sections, write_config

BIG = {  # far above anything the run sends: every check admits
    "requests_per_minute": 10_000_000,
    "tokens_per_minute": 1 << 40,
    "max_concurrent": 100_000,
    "max_tokens_per_request": 10_000_000,
}
NONE = dict.fromkeys(BIG, 0)


@dataclass
class Run:
    config: str
    wall_s: float
    requests: int
    completion_tokens: int
    counted: int  # answers with x-ratelimit-* headers

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s


async def send_all(url: str, key: str, prompts: list[list[int]], out_lens: list[int]) -> Run:
    """Every request at once; (wall time, answers) as a Run."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits, headers=headers) as c:

        async def one(prompt: list[int], n: int) -> httpx.Response:
            body = {
                "model": "model",
                "prompt": prompt,
                "max_tokens": n,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            return await c.post("/v1/completions", json=body)

        start = time.perf_counter()
        answers = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, out_lens, strict=True)))
        wall = time.perf_counter() - start
    for r in answers:
        if r.status_code != 200:
            raise SystemExit(f"a request failed: {r.status_code} {r.text[:300]}")
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in answers)
    counted = sum("x-ratelimit-limit-requests" in r.headers for r in answers)
    return Run("", wall, len(answers), tokens, counted)


def shared_caches() -> dict[str, str]:
    """Torch's own kernel-build and inductor cache directories, as the tests' daemons share
    them: a daemon otherwise builds the C++ kernels under its fresh data directory (minutes)."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from torch.utils.cpp_extension import _get_build_directory

    return {
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path(_get_build_directory("", False)).resolve())
        ),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()),
    }


def set_limits(url: str, values: dict[str, int]) -> None:
    r = httpx.patch(
        url + "/admin/config",
        json={"limits": values},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=60,
    )
    r.raise_for_status()


def run_daemon(
    args: argparse.Namespace, folder: Path, model: Path, backend: str, workload
) -> list[Run]:
    """One daemon on `backend`: the workload once untimed, then `--rounds` of none and limited
    runs (ABBA)."""
    name = f"bench-{backend}-{uuid.uuid4().hex[:8]}"  # its own Redis hash, this run only
    key = f"sk-{name}-0123456789abcdef"
    engine = {
        "max_num_seqs": 16,
        "max_num_batched_tokens": 1024,
        "prefill_chunk_size": 512,
        "max_model_len": 1024,
        "compile": args.compile,
        # Every run sends the same prompts: with the cache on, the runs after the first would
        # skip their prefills (the first run of each daemon some 10x slower than the rest).
        "enable_prefix_caching": False,
    }
    limits = {"backend": backend, "redis_url": args.redis_url, **NONE}
    sections = admin_sections(engine=engine, limits=limits, api_keys=[{"name": name, "key": key}])
    (folder / backend).mkdir()
    cfg = write_config(folder / backend / "cp.toml", folder / backend / "data", model, **sections)
    daemon = DaemonProcess.start(cfg, timeout=900, env=shared_caches())
    runs: list[Run] = []
    try:
        if args.compile != "off":
            from harness.fairness import wait_compiled

            print(f"{backend}: compiled step {wait_compiled(daemon.url, ADMIN_TOKEN)}", flush=True)
        # The whole workload once, untimed: a daemon's first run of it took 2.3x its later ones.
        asyncio.run(send_all(daemon.url, key, workload.prompts, workload.out_lens))
        order = []
        for i in range(args.rounds):
            order += ["none", backend] if i % 2 == 0 else [backend, "none"]
        for config in order:
            set_limits(daemon.url, NONE if config == "none" else BIG)
            run = asyncio.run(send_all(daemon.url, key, workload.prompts, workload.out_lens))
            run.config = config
            expected = 0 if config == "none" else run.requests
            if run.counted != expected:
                raise SystemExit(f"{config}: {run.counted} answers counted, expected {expected}")
            runs.append(run)
            print(
                f"{backend} daemon, {config}: {run.wall_s:.1f} s, {run.requests_per_s:.3f} req/s,"
                f" {run.tokens_per_s:.1f} tok/s",
                flush=True,
            )
    finally:
        daemon.stop(timeout=600)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=128, help="requests a run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="none + limited pairs a daemon")
    parser.add_argument("--size", default="small", help="demo model size (tiny, small)")
    parser.add_argument("--compile", default="off", choices=["off", "auto", "on"])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--backends", default="memory,redis")
    args = parser.parse_args()
    # A SIGTERM (a run stopped early) unwinds through run_daemon's finally: the daemon stops too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    folder = Path(tempfile.mkdtemp(prefix="admission-overhead-"))
    model = write_demo_model(folder / "model", size=args.size)
    workload = make_workload(load_model_facts(model), args.num_requests, args.seed)
    results = {b: run_daemon(args, folder, model, b, workload) for b in args.backends.split(",")}

    print(
        f"\n{args.num_requests} requests a run (offline workload, seed {args.seed}), "
        f"{args.rounds} round(s) a daemon, {args.size} demo model, compile {args.compile}"
    )
    print(
        "(each run sends the same requests and gets the same tokens: a ratio of requests/s is the"
        " ratio of tokens/s. 'vs none': the median over rounds of a limited run's figure over the"
        " no-limits run of its round, their range in brackets; 'medians': the medians' ratio)"
    )
    print(
        f"{'daemon':<8} {'limits':<8} {'req/s':>8} {'tok/s':>9} {'vs none':>9} {'range':>15}"
        f" {'medians':>8}"
    )
    for backend, runs in results.items():
        base = [r for r in runs if r.config == "none"]
        mine = [r for r in runs if r.config == backend]
        paired = [m.tokens_per_s / b.tokens_per_s for b, m in zip(base, mine, strict=True)]
        base_tps = statistics.median(r.tokens_per_s for r in base)
        for config, group in (("none", base), (backend, mine)):
            rps = statistics.median(r.requests_per_s for r in group)
            tps = statistics.median(r.tokens_per_s for r in group)
            ratio, spread = "1.000x", ""
            if config != "none":
                ratio = f"{statistics.median(paired):.3f}x"
                spread = f"[{min(paired):.3f}, {max(paired):.3f}]"
            print(
                f"{backend:<8} {config:<8} {rps:>8.3f} {tps:>9.1f} {ratio:>9} {spread:>15}"
                f" {tps / base_tps:>7.3f}x"
            )


if __name__ == "__main__":
    main()
