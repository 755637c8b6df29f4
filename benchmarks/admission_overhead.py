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
(16 sequences, 1024 batched tokens, prefill chunks of 512). A run's figures: requests/s and
completion tokens/s over the wall time from the first request sent to the last answer.

* ``none``: [limits] all 0, so admission never calls a limiter (the path of a daemon without
  limits).
* ``memory``: the four limits set live (``PATCH /admin/config``) far above what the run sends
  (every check admits): each request takes a check and a release on the in-process buckets.
* ``redis``: the same limits on a second daemon with ``backend = "redis"`` (``--redis-url``, a
  key name of this run): a Lua script round trip to Redis at admission and another at the end.

Each daemon runs its ``none`` and limited runs in turn, ``--rounds`` times (none, limited, then
limited, none: ABBA), after a warm-up; a limited figure is compared with the median of the
``none`` runs of its own daemon. Every answer must be a 200; the limited runs' answers carry the
``x-ratelimit-*`` headers (the checks ran), the ``none`` runs' do not.

    python -m benchmarks.admission_overhead
    python -m benchmarks.admission_overhead --num-requests 16 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
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
    """One daemon on `backend`: a warm-up, then `--rounds` of none and limited runs (ABBA)."""
    name = f"bench-{backend}-{uuid.uuid4().hex[:8]}"  # its own Redis hash, this run only
    key = f"sk-{name}-0123456789abcdef"
    engine = {
        "max_num_seqs": 16,
        "max_num_batched_tokens": 1024,
        "prefill_chunk_size": 512,
        "max_model_len": 1024,
        "compile": args.compile,
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
        warm = min(16, len(workload.prompts))
        asyncio.run(send_all(daemon.url, key, workload.prompts[:warm], workload.out_lens[:warm]))
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

    folder = Path(tempfile.mkdtemp(prefix="admission-overhead-"))
    model = write_demo_model(folder / "model", size=args.size)
    workload = make_workload(load_model_facts(model), args.num_requests, args.seed)
    results = {b: run_daemon(args, folder, model, b, workload) for b in args.backends.split(",")}

    print(
        f"\n{args.num_requests} requests a run (offline workload, seed {args.seed}), "
        f"{args.rounds} round(s) a daemon, {args.size} demo model, compile {args.compile}"
    )
    print(
        f"{'daemon':<8} {'limits':<8} {'req/s':>8} {'tok/s':>9} {'req/s vs none':>14} {'tok/s vs none':>14}"
    )
    for backend, runs in results.items():
        base = [r for r in runs if r.config == "none"]
        base_rps = statistics.median(r.requests_per_s for r in base)
        base_tps = statistics.median(r.tokens_per_s for r in base)
        for config in ("none", backend):
            mine = [r for r in runs if r.config == config]
            rps = statistics.median(r.requests_per_s for r in mine)
            tps = statistics.median(r.tokens_per_s for r in mine)
            print(
                f"{backend:<8} {config:<8} {rps:>8.3f} {tps:>9.1f} {rps / base_rps:>13.3f}x"
                f" {tps / base_tps:>13.3f}x"
            )


if __name__ == "__main__":
    main()
