"""Drill: thousands of requests, a share of the clients hanging up at random moments.

A daemon on the tiny demo model (SQLite) gets `--warmup` requests, settles, and its RSS is read;
then `controlplane loadgen` sends `--requests` (10,000) requests, `--concurrency` in flight,
half of them streaming, with `--disconnect-fraction` (0.3) of the clients hanging up after a
delay uniform in [0, `--disconnect-within`] seconds (streaming and not). Afterwards:

* the engine is idle: 0 running, 0 waiting, 0 KV blocks in use;
* every admitted request has exactly one final row: no row is `running`, and the rows number
  the requests the engine finished (`num_finished`, which counts aborted ones too);
* the daemon's RSS after the run is within `--rss-tolerance` (10%) of its RSS after warm-up.

    python -m drills.disconnect_storm                       # 10,000 requests, ~10 minutes
    python -m drills.disconnect_storm --requests 1000       # CI's size
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from controlplane.client.loadgen import LoadConfig, run_load
from drills._common import MB, Checks, Daemon, engine_stats, log, statuses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect-fraction", type=float, default=0.3)
    p.add_argument("--disconnect-within", type=float, default=0.3)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument(
        "--settle",
        type=float,
        default=8.0,
        help="idle seconds before an RSS reading (the daemon trims its heap after 5)",
    )
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    args = p.parse_args(argv)

    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="cp-drill-") as tmp:
        d = Daemon(Path(tmp), engine={"max_num_seqs": 32}, server={"max_queue_len": 1024})
        d.start()
        try:
            common = dict(
                url=d.url,
                rate=float("inf"),
                prompt_len=(8, 64),
                output_len=(4, 32),
                concurrency_limit=args.concurrency,
                stream_fraction=0.5,
                token_id_range=(10, 1000),  # the tiny model's vocabulary is 1024
            )
            log(f"warm-up: {args.warmup} requests")
            asyncio.run(run_load(LoadConfig(**common, num_requests=args.warmup)))
            d.wait_idle()
            time.sleep(args.settle)
            rss_warm = d.rss()
            log(f"RSS after warm-up: {rss_warm / MB:.1f} MB")

            log(
                f"storm: {args.requests} requests, {args.concurrency} in flight, "
                f"{args.disconnect_fraction:.0%} of the clients hang up"
            )
            t0 = time.monotonic()
            s = asyncio.run(
                run_load(
                    LoadConfig(
                        **common,
                        num_requests=args.requests,
                        seed=1,
                        disconnect_fraction=args.disconnect_fraction,
                        disconnect_within_s=args.disconnect_within,
                    ),
                    progress=True,
                )
            )
            log(
                f"storm done in {time.monotonic() - t0:.1f}s: ok {s.requests_ok}, hung up "
                f"{s.requests_disconnected}, failed {s.requests_failed} {s.errors or ''}"
            )
            stats = engine_stats(d.wait_idle())
            rows = d.wait_rows_final()
            time.sleep(args.settle)
            rss_after = d.rss()
        finally:
            code = d.stop()
        log(f"RSS after the storm: {rss_after / MB:.1f} MB; rows by status {statuses(rows)}")

        checks.check("no client request failed", s.requests_failed == 0, str(s.errors))
        checks.check(
            "clients hung up", s.requests_disconnected > 0, f"{s.requests_disconnected} did"
        )
        checks.check("0 running", stats["num_running"] == 0, str(stats["num_running"]))
        checks.check("0 waiting", stats["num_waiting"] == 0, str(stats["num_waiting"]))
        checks.check(
            "0 KV blocks in use", stats["kv_blocks_used"] == 0, str(stats["kv_blocks_used"])
        )
        running = sum(1 for _, st in rows if st == "running")
        checks.check("every row final", running == 0, f"{running} running")
        checks.check(
            "one row per admitted request",
            len(rows) == stats["num_finished"],
            f"{len(rows)} rows, engine finished {stats['num_finished']}",
        )
        checks.check(
            "every answered request has a row",
            len(rows) >= args.warmup + s.requests_ok,
            f"{len(rows)} rows >= {args.warmup} warm-up + {s.requests_ok} ok",
        )
        growth = rss_after / rss_warm - 1
        checks.check(
            f"RSS within {args.rss_tolerance:.0%} of warm-up",
            growth <= args.rss_tolerance,
            f"{rss_warm / MB:.1f} -> {rss_after / MB:.1f} MB, {growth:+.1%}",
        )
        checks.check("graceful stop", code == 0, f"exit status {code}")
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
