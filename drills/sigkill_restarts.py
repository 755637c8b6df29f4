"""Drill: SIGKILL the daemon under load, restart it, five times in a row.

Each round starts the daemon (the same data dir and SQLite database), runs `--concurrency`
streaming clients for `--load-seconds`, then SIGKILLs it mid-stream. After the last round the
daemon is started once more (its request journal replays what the killed runs could not write)
and stopped gracefully. Every request carries an X-Request-Id; afterwards:

* every row is final (none `running`);
* every request a client saw admitted (a 200) has exactly one row: none lost, none doubled;
* the ones cut by a kill are `interrupted`, the ones read to the end are `success`.

    python -m drills.sigkill_restarts                  # 5 rounds, ~2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections import Counter
from pathlib import Path

from drills._clients import Tally, stream_clients
from drills._common import Checks, Daemon, log


async def load_then_kill(d: Daemon, tag: str, seconds: float, concurrency: int) -> Tally:
    stop = asyncio.Event()
    clients = asyncio.create_task(stream_clients(d.url, tag, stop, concurrency))
    await asyncio.sleep(seconds)
    d.kill()  # mid-stream: requests running, rows in the writer's buffer
    stop.set()
    return await clients


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--load-seconds", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args(argv)

    checks = Checks()
    admitted: set[str] = set()
    completed: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="cp-drill-") as tmp:
        d = Daemon(Path(tmp))
        for i in range(args.rounds):
            d.start()
            t = asyncio.run(load_then_kill(d, f"r{i}", args.load_seconds, args.concurrency))
            admitted |= t.admitted
            completed |= t.completed
            log(
                f"round {i + 1}: {len(t.admitted)} admitted, {len(t.completed)} read to the end, "
                f"{t.broken} cut by the kill, rejected {t.rejected or 0}; SIGKILLed"
            )
        d.start()  # replays the journal
        code = d.stop()
        rows = d.rows_by_request_id()
    statuses = Counter(s for ss in rows.values() for s in ss)
    log(f"rows: {sum(statuses.values())} by status {dict(statuses)}")
    lost = [rid for rid in admitted if rid not in rows]
    doubled = [rid for rid, ss in rows.items() if len(ss) > 1]
    unfinished = [rid for rid in completed if rows.get(rid) != ["success"]]
    checks.check("requests were admitted", len(admitted) > 0, f"{len(admitted)}")
    checks.check(
        "every row final", statuses.get("running", 0) == 0, f"{statuses.get('running', 0)} running"
    )
    checks.check("no admitted request lost", not lost, f"{len(lost)} without a row {lost[:3]}")
    checks.check("no request doubled", not doubled, f"{len(doubled)} with 2+ rows {doubled[:3]}")
    checks.check(
        "requests read to the end are success",
        not unfinished,
        f"{len(unfinished)} are not {[(r, rows.get(r)) for r in unfinished[:3]]}",
    )
    checks.check(
        "requests cut by a kill are interrupted",
        statuses.get("interrupted", 0) > 0,
        f"{statuses.get('interrupted', 0)} interrupted",
    )
    checks.check("graceful stop after the last restart", code == 0, f"exit status {code}")
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
