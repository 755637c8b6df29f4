"""Daemon memory across request storms: does RSS plateau (allocator caching) or keep growing?

What is measured
----------------
For each variant (``--variants``, default ``default,no-trim``) a fresh daemon is started as a
subprocess (``python -m controlplane serve`` on the ``small`` demo model, bfloat16, a fresh
``data_dir``), warmed up with ``--warmup`` requests, and then hit by ``--storms`` storms of
``--requests`` (350) streaming completions sent all at once (``controlplane.client.loadgen``: prompts
``--prompt-len``, outputs ``--output-len``, EOS ignored; those beyond ``server.max_queue_len`` get
429, as in production), followed by ``--bad-storms`` storms of ``--bad-requests`` bad inputs
sent 32 at a time: near-limit bodies that are not JSON, prompts far beyond the context (a 1 MB
string, 100k token ids), wrong types. After warm-up and after every storm the script waits
``--settle`` seconds (the daemon is idle) and reads the daemon's RSS with psutil.

Variants differ only in the daemon's environment:

* ``default``: as shipped.
* ``no-trim``: ``CONTROLPLANE_MALLOC_TRIM_IDLE_S=0``, the daemon's idle ``malloc_trim`` off (how
  it behaved before it had one).
* ``arena2``: ``no-trim`` plus ``MALLOC_ARENA_MAX=2`` (glibc keeps at most 2 malloc arenas).

Figures: RSS after warm-up and after each storm (MB), growth over warm-up in %, and the growth
between the first and the last storm of each kind (a plateau shows as ~0 there, a leak keeps
climbing). The drill in the production-hardening issue asks for RSS within 10% of warm-up.

How to run
----------
    python -m benchmarks.rss_storms                              # both variants, ~10 minutes
    python -m benchmarks.rss_storms --variants no-trim --storms 6 --bad-storms 0
    python -m benchmarks.rss_storms --json /tmp/rss.json

These are figures to read, not assertions; the machine is shared, and RSS depends on the
allocator's state, so compare variants within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from controlplane.client.loadgen import LoadConfig, parse_range, run_load
from harness import REPO_ROOT, DaemonProcess, write_config

DEFAULT_MODEL_DIR = REPO_ROOT / ".bench" / "small"
MB = 1024 * 1024
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "no-trim": {"CONTROLPLANE_MALLOC_TRIM_IDLE_S": "0"},
    "arena2": {"CONTROLPLANE_MALLOC_TRIM_IDLE_S": "0", "MALLOC_ARENA_MAX": "2"},
}


def log(msg: str) -> None:
    print(msg, flush=True)


def start(workdir: Path, model_dir: Path, env_extra: dict[str, str]) -> DaemonProcess:
    """The daemon on the small model in bfloat16, with `env_extra` on top of the scrubbed
    environment (harness.clean_env: no CONTROLPLANE_*, no MALLOC_ARENA_MAX); returns once it
    is ready."""
    cfg = write_config(
        workdir / "config.toml", workdir / "data", model_dir, engine={"dtype": "bfloat16"}
    )
    return DaemonProcess.start(cfg, timeout=300, env=env_extra)


def bad_bodies(i: int) -> tuple[bytes, str]:
    """The i-th bad request: (body, content type). Each must get a 4xx, never hurt the daemon."""
    kinds = [
        (b'{"model": "x", "prompt": "' + b"a" * (1_900_000) + b'"', "application/json"),
        (json.dumps({"prompt": "word " * 200_000, "max_tokens": 4}).encode(), "application/json"),
        (
            json.dumps({"prompt": list(range(1, 100_001)), "max_tokens": 4}).encode(),
            "application/json",
        ),
        (json.dumps({"prompt": "hi", "max_tokens": 10**9}).encode(), "application/json"),
        (json.dumps({"prompt": {"nested": [1] * 50_000}}).encode(), "application/json"),
        (os.urandom(1_000_000), "application/octet-stream"),
    ]
    return kinds[i % len(kinds)]


async def bad_storm(url: str, n: int, concurrency: int = 32) -> dict[int, int]:
    """Send `n` bad requests, `concurrency` at a time; returns {status: count}."""
    statuses: dict[int, int] = {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(i: int) -> None:
            body, ctype = bad_bodies(i)
            async with sem:
                try:
                    r = await client.post(
                        url + "/v1/completions", content=body, headers={"content-type": ctype}
                    )
                    code = r.status_code
                except httpx.HTTPError:
                    code = 0
            statuses[code] = statuses.get(code, 0) + 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return statuses


@dataclass
class Result:
    variant: str
    env: dict[str, str]
    points: list[tuple[str, int]] = field(default_factory=list)  # (label, RSS bytes)

    def summary(self) -> dict[str, Any]:
        base = self.points[0][1]
        out: dict[str, Any] = {
            "variant": self.variant,
            "env": self.env,
            "rss_mb": {label: round(v / MB, 1) for label, v in self.points},
            "growth_over_warmup_pct": {
                label: round(100 * (v / base - 1), 1) for label, v in self.points[1:]
            },
        }
        for kind in ("load", "bad"):
            mine = [v for label, v in self.points if label.startswith(kind)]
            if len(mine) >= 2:
                out[f"{kind}_first_to_last_pct"] = round(100 * (mine[-1] / mine[0] - 1), 1)
        return out


def run_variant(name: str, model_dir: Path, args: argparse.Namespace) -> Result:
    env = VARIANTS[name]
    res = Result(name, env)
    with tempfile.TemporaryDirectory(prefix="cp-rss-") as tmp:
        d = start(Path(tmp), model_dir, env)
        try:
            common = dict(url=d.url, stream=True, prompt_len=args.prompt_len)
            asyncio.run(
                run_load(
                    LoadConfig(**common, rate=math.inf, num_requests=args.warmup, output_len=(4, 8))
                )
            )

            def point(label: str) -> None:
                time.sleep(args.settle)
                rss = d.rss()
                res.points.append((label, rss))
                base = res.points[0][1]
                log(
                    f"  [{name}] {label:<10} RSS {rss / MB:8.1f} MB ({100 * (rss / base - 1):+.1f}%)"
                )

            point("warm-up")
            for i in range(args.storms):
                s = asyncio.run(
                    run_load(
                        LoadConfig(
                            **common,
                            rate=math.inf,
                            num_requests=args.requests,
                            output_len=args.output_len,
                            seed=i,
                        )
                    )
                )
                log(
                    f"  [{name}] load storm {i + 1}: ok {s.requests_ok}, failed "
                    f"{s.requests_failed} {s.errors or ''}"
                )
                point(f"load {i + 1}")
            for i in range(args.bad_storms):
                statuses = asyncio.run(bad_storm(d.url, args.bad_requests))
                log(f"  [{name}] bad-input storm {i + 1}: statuses {statuses}")
                point(f"bad {i + 1}")
        finally:
            d.stop(timeout=60, check=False)
    return res


def _range(flag: str):
    def parse(text: str) -> tuple[int, int]:
        try:
            return parse_range(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--variants", default="default,no-trim", help=f"among {sorted(VARIANTS)}")
    p.add_argument("--storms", type=int, default=3, help="storms of valid requests")
    p.add_argument("--requests", type=int, default=350, help="requests per storm, all at once")
    p.add_argument("--bad-storms", type=int, default=2, help="storms of bad inputs")
    p.add_argument("--bad-requests", type=int, default=192, help="bad requests per storm")
    p.add_argument("--warmup", type=int, default=16, help="requests before the first reading")
    p.add_argument("--prompt-len", type=_range("--prompt-len"), default="32-512", metavar="A-B")
    p.add_argument("--output-len", type=_range("--output-len"), default="8-32", metavar="C-D")
    p.add_argument("--settle", type=float, default=5.0, help="idle seconds before each reading")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="small demo model")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the summary as JSON")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose among {sorted(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from controlplane.engine.demo_model import write_demo_model  # imports torch: only here

    model_dir = write_demo_model(args.model_dir, size="small")
    log(
        f"rss storms: model {model_dir}, {args.storms} x {args.requests} requests "
        f"(prompt {args.prompt_len}, output {args.output_len}), {args.bad_storms} x "
        f"{args.bad_requests} bad inputs, variants {args.variants}"
    )
    results = []
    for name in args.variants:
        log(f"[{name}] env {VARIANTS[name] or '(as shipped)'}")
        results.append(run_variant(name, model_dir, args).summary())
    log("")
    for r in results:
        growth = ", ".join(f"{k} {v:+.1f}%" for k, v in r["growth_over_warmup_pct"].items())
        tail = ", ".join(
            f"{k.split('_')[0]} storms first->last {r[k]:+.1f}%"
            for k in ("load_first_to_last_pct", "bad_first_to_last_pct")
            if k in r
        )
        log(f"{r['variant']:<8} warm-up {r['rss_mb']['warm-up']:.0f} MB; {growth}")
        if tail:
            log(f"{'':<8} {tail}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
