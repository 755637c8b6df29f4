"""Drill: hundreds of idle event-stream connections held open while the daemon serves load.

The same loadgen run (`--requests` streaming completions, `--concurrency` in flight) twice,
interleaved `--repeats` times: alone, and with `--connections` (500) `/admin/events` streams
held open by clients that only read what arrives (what a wall of dashboards does). Figure: the
output tokens/s of each, and their ratio; the target is within 10%.

    python -m drills.idle_connections                   # ~3 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
from pathlib import Path

from controlplane.client.loadgen import LoadConfig, run_load
from drills._common import ADMIN_TOKEN, Checks, Daemon, log


async def _watch(url: str, n: int, ready, stop) -> int:
    """`n` /admin/events readers; `ready` is set once all are open; they end when `stop` is.
    Returns how many were still open then. Raw sockets that discard what arrives: the readers
    share the daemon's 2 cores, and a heavier client (httpx parsing every event) would show
    its own cost as the daemon's."""
    host, port = url.removeprefix("http://").split(":")
    request = (
        f"GET /admin/events HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {ADMIN_TOKEN}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    opened = 0

    async def watcher() -> None:
        nonlocal opened
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
            opened += 1
            if opened == n:
                ready.set()
            while await reader.read(65536):
                pass
        finally:
            writer.close()

    tasks = [asyncio.create_task(watcher()) for _ in range(n)]
    while not stop.is_set():
        await asyncio.sleep(0.2)
    alive = sum(1 for t in tasks if not t.done())
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return alive


def _watchers(url: str, n: int, ready, stop, alive) -> None:
    alive.value = asyncio.run(_watch(url, n, ready, stop))


def with_watchers(d: Daemon, n: int, config: LoadConfig) -> tuple[float, int]:
    """Throughput of `config` while `n` /admin/events streams are open, read by another
    process (reading 500 streams must not slow the load generator itself); and how many
    streams were still open at the end."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop, alive = ctx.Event(), ctx.Event(), ctx.Value("i", -1)
    proc = ctx.Process(target=_watchers, args=(d.url, n, ready, stop, alive))
    proc.start()
    try:
        if not ready.wait(120):
            raise RuntimeError(f"the {n} event streams did not all open")
        summary = asyncio.run(run_load(config))
    finally:
        stop.set()
        proc.join(60)
    return summary.output_throughput, alive.value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=500)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tolerance", type=float, default=0.10)
    args = p.parse_args(argv)

    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="cp-drill-") as tmp:
        d = Daemon(Path(tmp), server={"max_queue_len": 1024})
        d.start()
        try:
            config = LoadConfig(
                url=d.url,
                num_requests=args.requests,
                concurrency_limit=args.concurrency,
                prompt_len=(8, 64),
                output_len=(16, 64),
                stream=True,
                token_id_range=(10, 1000),
            )
            asyncio.run(run_load(LoadConfig(**{**config.__dict__, "num_requests": 64})))
            alone: list[float] = []
            watched: list[float] = []
            alive_min = args.connections
            for rep in range(args.repeats):
                for kind in ("alone", "watched") if rep % 2 == 0 else ("watched", "alone"):
                    if kind == "alone":
                        tps = asyncio.run(run_load(config)).output_throughput
                        alone.append(tps)
                    else:
                        tps, alive = with_watchers(d, args.connections, config)
                        watched.append(tps)
                        alive_min = min(alive_min, alive)
                    log(f"repeat {rep + 1} {kind:<8} {tps:8.1f} output tok/s")
        finally:
            code = d.stop()
    a, w = statistics.median(alone), statistics.median(watched)
    log(f"median: alone {a:.1f} tok/s, with {args.connections} event streams {w:.1f} ({w / a:.1%})")
    checks.check(
        f"throughput within {args.tolerance:.0%} with {args.connections} open event streams",
        w >= (1 - args.tolerance) * a,
        f"{w:.1f} vs {a:.1f} tok/s, {w / a - 1:+.1%}",
    )
    checks.check(
        "every event stream stayed open through the run",
        alive_min == args.connections,
        f"at least {alive_min} of {args.connections}",
    )
    checks.check("graceful stop with the streams gone", code == 0, f"exit status {code}")
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
