"""Issue 55, limits with the Redis backend through real daemons: two daemons on one PostgreSQL
database and one Redis share a key's requests-per-minute limit (the key made through one
daemon's /admin/keys), and a daemon keeps answering while the Redis it counts in is killed under
load and started again (redis_failure open: uncounted 200s; closed: 503 with Retry-After for the
limited key; counted again after the restart; never a 500 or a traceback).

Redis isolation: the fleet test runs on the shared Redis at 127.0.0.1:6379 under a key name made
for this run (its hash is controlplane:ratelimit:<name>); the kill test runs its own
redis-server on a free port, which it alone starts and kills."""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.tenants.limits import RateLimits
from harness import InProcessDaemon, free_port
from tests.admin.test_admin_api import MODEL, TOKEN
from tests.tenants.test_limits import REDIS_URL, needs_redis


def complete(c: httpx.Client, max_tokens: int = 1) -> httpx.Response:
    return c.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": max_tokens}
    )


def make_key(d: InProcessDaemon, name: str, **fields: Any) -> str:
    with d.client(TOKEN) as c:
        made = c.post("/admin/keys", json={"name": name, **fields})
        assert made.status_code == 201, made.text
        return made.json()["secret"]


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@needs_redis
def test_two_daemons_share_one_requests_per_minute_limit(make_daemon, pg_url):
    """A key limited to 60 requests a minute, sent 120 requests at once to both daemons from 8
    threads: at most 60 + 60 x T / 60 are admitted over the run's T seconds (the token bucket's
    tolerance, docs/tenants.md), at least the 60 of the full bucket, some by each daemon; every
    other answer is the requests-per-minute 429."""
    rpm = 60
    fleet = [
        make_daemon(
            admin=True,
            server={"instance_id": n, "key_refresh_s": 0.2},
            store={"url": pg_url},
            limits={"backend": "redis", "redis_url": REDIS_URL},
            engine={"max_num_seqs": 2, "max_model_len": 128},
        )
        for n in ("a", "b")
    ]
    a, b = fleet
    name = f"fleet-rpm-{uuid.uuid4().hex[:12]}"  # its own Redis hash, this run only
    secret = make_key(a, name, requests_per_minute=rpm)
    # B has read the table once its API is closed (before, any bearer is anonymous: uncounted).
    with b.client("cp-wrong") as c:
        wait_until(lambda: c.get("/v1/models").status_code == 401, 10, "B never read the key")
    with b.client(secret) as c:  # a GET takes nothing from the bucket
        assert c.get("/v1/models").status_code == 200

    def send(i: int) -> tuple[str, int, httpx.Response]:
        which = "ab"[i % 2]
        with fleet[i % 2].client(secret) as c:
            return which, i, complete(c)

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(2 * rpm)))
    span = time.monotonic() - start
    admitted = [(w, r) for w, _, r in results if r.status_code == 200]
    refused = [r for _, _, r in results if r.status_code != 200]
    by = {w: sum(1 for x, _ in admitted if x == w) for w in "ab"}
    print(f"{len(admitted)} admitted ({by}) of {len(results)} in {span:.2f} s")
    # Every one of them counted in Redis (none admitted anonymous or uncounted).
    assert all(r.headers["x-ratelimit-limit-requests"] == str(rpm) for _, r in admitted)
    assert len(admitted) <= rpm + math.floor(rpm * span / 60), (len(admitted), span)
    assert len(admitted) >= rpm  # the full bucket, not counted twice across the daemons
    assert by["a"] > 0 and by["b"] > 0
    for r in refused:
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded", r.text
        assert f"requests per minute ({rpm})" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 60 / rpm + 1
    # Both daemons read the same bucket: nearly empty on each (a few refilled since).
    for d in fleet:
        with d.client(secret) as c:
            left = int(c.get("/v1/models").headers["x-ratelimit-remaining-requests"])
        assert left <= math.ceil(rpm * (time.monotonic() - start) / 60)


# -- Redis killed under load ----------------------------------------------------------------------


class RedisServer:
    """A redis-server of this test's own on `port` (no persistence): start, kill, start again."""

    def __init__(self, port: int, folder: Path) -> None:
        self.port, self.folder = port, folder
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--daemonize",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.folder),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            ping = subprocess.run(
                ["redis-cli", "-p", str(self.port), "ping"], capture_output=True, text=True
            )
            if ping.stdout.strip() == "PONG":
                return
            assert self.proc.poll() is None, "redis-server exited"
            assert time.monotonic() < deadline, "redis-server never answered"
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("no redis-server on this machine")
    server = RedisServer(free_port(), tmp_path)
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.kill()


@dataclass
class Answer:
    key: str  # limited | free
    sent: float
    done: float
    status: int
    counted: bool  # carries the x-ratelimit-* headers: the check reached Redis
    body: str
    retry_after: str | None


class Load:
    """Threads sending short completions until stopped: three with the limited key, one with a
    key without limits; every answer kept."""

    def __init__(self, d: InProcessDaemon, limited: str, free: str) -> None:
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(d, "limited", limited), daemon=True)
            for _ in range(3)
        ] + [threading.Thread(target=self._loop, args=(d, "free", free), daemon=True)]
        for t in self._threads:
            t.start()

    def _loop(self, d: InProcessDaemon, which: str, secret: str) -> None:
        with d.client(secret) as c:
            while not self._stop.is_set():
                sent = time.monotonic()
                r = complete(c, max_tokens=2)
                answer = Answer(
                    which,
                    sent,
                    time.monotonic(),
                    r.status_code,
                    "x-ratelimit-limit-requests" in r.headers,
                    r.text,
                    r.headers.get("Retry-After"),
                )
                with self._lock:
                    self.answers.append(answer)

    def since(self, t: float, key: str = "limited") -> list[Answer]:
        """The answers to requests of `key` sent after `t`."""
        with self._lock:
            return [a for a in self.answers if a.key == key and a.sent > t]

    def wait(self, t: float, predicate, what: str, timeout: float = 15) -> list[Answer]:
        """The answers sent after `t` once `predicate(them)` holds."""
        deadline = time.monotonic() + timeout
        while not predicate(got := self.since(t)):
            assert time.monotonic() < deadline, f"{what}: {got[-5:]}"
            time.sleep(0.05)
        return got

    def stop(self) -> list[Answer]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return self.answers


def limiter_of(d: InProcessDaemon) -> RateLimits:
    """The daemon's rate limits (the app closes them at shutdown: that is where they are)."""
    found = [
        h.__self__
        for h in d.daemon.app.on_shutdown
        if isinstance(getattr(h, "__self__", None), RateLimits)
    ]
    assert len(found) == 1
    return found[0]


def counted(n: int):
    return lambda got: sum(a.counted for a in got) >= n


def test_redis_killed_under_load(make_daemon, own_redis, caplog):
    """Redis killed while requests stream in, then started again on its port: with
    redis_failure open every request is still a 200, uncounted (no x-ratelimit-* headers),
    the outage logged once and counted; after the restart the requests are counted again.
    Switched to closed live: the limited key's requests get 503 rate_limiter_unavailable with
    Retry-After 1 while a key without limits goes on; counted again after the restart. No
    answer is a 500, none carries a traceback, nothing is logged as an error."""
    d = make_daemon(
        admin=True,
        api_keys=[{"name": "free", "key": "sk-free-0123456789abcdef"}],  # no limits: [limits] 0
        limits={"backend": "redis", "redis_url": f"redis://127.0.0.1:{own_redis.port}/0"},
        engine={"max_num_seqs": 4, "max_model_len": 128},
    )
    limited = make_key(d, "limited", requests_per_minute=1_000_000)
    with caplog.at_level(logging.WARNING):
        load = Load(d, limited, "sk-free-0123456789abcdef")
        try:
            load.wait(0, counted(5), "never counted in Redis")
            # -- open: uncounted 200s while Redis is down
            killed = time.monotonic()
            own_redis.kill()
            load.wait(killed, lambda got: sum(not a.counted for a in got) >= 10, "no outage")
            restarted = time.monotonic()
            own_redis.start()
            down = [a for a in load.since(killed) if a.done < restarted]
            assert down and all(a.status == 200 and not a.counted for a in down), down[-5:]
            load.wait(restarted, counted(5), "never counted again after the restart")
            open_limiter = limiter_of(d).backend()
            assert open_limiter.outages == 1 and open_limiter.down_since is None
            assert open_limiter.failed_open >= len(down)  # each admitted uncounted
            assert open_limiter.failures >= open_limiter.failed_open
            # -- closed (live): 503 for the limited key, the free key goes on
            with d.client(TOKEN) as c:
                r = c.patch("/admin/config", json={"limits": {"redis_failure": "closed"}})
                assert r.status_code == 200, r.text
            switched = time.monotonic()
            load.wait(switched, counted(3), "not counted under closed")
            killed = time.monotonic()
            own_redis.kill()
            load.wait(killed, lambda got: sum(a.status == 503 for a in got) >= 10, "no 503")
            wait_until(lambda: len(load.since(killed, "free")) >= 3, 15, "the free key stopped")
            restarted = time.monotonic()
            own_redis.start()
            refused = [a for a in load.since(killed) if a.done < restarted]
            free_down = [a for a in load.since(killed, "free") if a.done < restarted]
            after = load.wait(restarted, counted(5), "never counted again under closed")
            closed_limiter = limiter_of(d).backend()
            assert closed_limiter is not open_limiter and closed_limiter.failure == "closed"
            assert closed_limiter.outages == 1 and closed_limiter.failures > 0
            assert closed_limiter.failed_open == 0
        finally:
            answers = load.stop()
    print(
        f"{len(answers)} answers: {len(down)} uncounted 200s (open), {len(refused)} 503s and "
        f"{len(free_down)} free-key 200s (closed) while Redis was down"
    )
    assert refused and all(a.status == 503 for a in refused), refused[-5:]
    for a in refused:
        assert '"code":"rate_limiter_unavailable"' in a.body.replace(" ", ""), a.body
        assert a.retry_after == "1"
    assert free_down and all(a.status == 200 for a in free_down)
    assert after[-1].status == 200 and after[-1].counted
    assert {a.status for a in answers} <= {200, 503}, {a.status for a in answers}
    assert not [a for a in answers if "Traceback" in a.body or 'File "' in a.body]
    assert all(a.status == 200 for a in answers if a.key == "free")
    logged = [r.getMessage() for r in caplog.records if r.name == "controlplane.limits"]
    outages = [m for m in logged if "is unreachable" in m]
    assert len(outages) == 2  # once an outage
    assert "admitted uncounted" in outages[0] and "refused with 503" in outages[1]
    assert sum("answers again" in m for m in logged) == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
