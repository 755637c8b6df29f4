"""Drill: restart PostgreSQL (the real server, via pg_ctlcluster) under load.

A daemon stores its rows in a fresh database on the local PostgreSQL; `--concurrency` streaming
clients (each request tagged with an X-Request-Id) run for `--load-seconds`, and
`--restart-at` seconds in, the cluster is restarted (`pg_ctlcluster ... restart`: every
connection is cut). Afterwards:

* serving continued: no client request failed or was cut, and requests were admitted after the
  restart too;
* every admitted request's row is in the database, final, exactly once (the recorder holds rows
  while the database is away and writes them when it is back).

Needs root (pg_ctlcluster) and a cluster in /etc/postgresql; `CONTROLPLANE_TEST_POSTGRES`
names the server as for the tests (default postgresql://postgres@127.0.0.1:5432/postgres).

    python -m drills.postgres_restart                   # ~1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from sqlalchemy import make_url

from drills._clients import stream_clients
from drills._common import Checks, Daemon, log

ADMIN_URL = os.environ.get(
    "CONTROLPLANE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)


def restart_postgres() -> float:
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    t0 = time.monotonic()
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
        check=True,
        capture_output=True,
    )
    return time.monotonic() - t0


async def load_with_restart(d: Daemon, seconds: float, at: float, concurrency: int):
    stop = asyncio.Event()
    clients = asyncio.create_task(stream_clients(d.url, "pg", stop, concurrency))
    await asyncio.sleep(at)
    took = await asyncio.to_thread(restart_postgres)
    log(f"PostgreSQL restarted in {took:.1f}s")
    await asyncio.sleep(max(0.0, seconds - at))
    stop.set()
    return await clients


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load-seconds", type=float, default=12.0)
    p.add_argument("--restart-at", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args(argv)

    name = f"cp_drill_{os.getpid()}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    db_url = make_url(ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
    checks = Checks()
    try:
        with tempfile.TemporaryDirectory(prefix="cp-drill-") as tmp:
            d = Daemon(Path(tmp), db_url=db_url.render_as_string(hide_password=False))
            d.start()
            try:
                tally = asyncio.run(
                    load_with_restart(d, args.load_seconds, args.restart_at, args.concurrency)
                )
                d.wait_idle()
                rows = {}
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # the recorder retries every few seconds
                    try:
                        rows = d.rows_by_request_id()
                    except Exception:  # the server may still be coming back
                        rows = {}
                    if all(rid in rows for rid in tally.admitted) and not any(
                        "running" in ss for ss in rows.values()
                    ):
                        break
                    time.sleep(1)
            finally:
                code = d.stop()
            log(
                f"{len(tally.admitted)} admitted, {len(tally.completed)} read to the end, "
                f"{tally.broken} cut, rejected {tally.rejected or 0}; {len(rows)} rows"
            )
            lost = [rid for rid in tally.admitted if rid not in rows]
            doubled = [rid for rid, ss in rows.items() if len(ss) > 1]
            not_final = [rid for rid, ss in rows.items() if "running" in ss]
            checks.check(
                "requests were admitted", len(tally.admitted) > 0, f"{len(tally.admitted)}"
            )
            checks.check(
                "serving continued: no request cut or refused",
                tally.broken == 0 and not tally.rejected,
                f"{tally.broken} cut, rejected {tally.rejected}",
            )
            checks.check(
                "every admitted request read to the end",
                tally.completed == tally.admitted,
                f"{len(tally.admitted - tally.completed)} not",
            )
            checks.check(
                "every admitted request has its row", not lost, f"{len(lost)} lost {lost[:3]}"
            )
            checks.check("no row doubled", not doubled, f"{len(doubled)}")
            checks.check("every row final", not not_final, f"{len(not_final)} running")
            checks.check("graceful stop", code == 0, f"exit status {code}")
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
