"""The fairness experiment (issue 55) against a running daemon: a flooding key keeps many long
prompts in flight while a light key sends one short streamed request at a time; the light
key's time to first token, alone and under the flood, and the flood's completion tokens per
second. Used by tests/tenants/test_fairness_daemon.py and benchmarks/fairness.py."""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class Flood:
    concurrency: int = 16  # requests of the flooding key in flight at once
    prompt_tokens: int = 200
    max_tokens: int = 8


@dataclass(frozen=True, slots=True)
class LightRun:
    ttfts: list[float]  # seconds, one per light request
    flood_tokens_per_s: float  # completion tokens of the flooding key per second (0: alone)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    @property
    def p50(self) -> float:
        return statistics.median(self.ttfts)

    @property
    def p99(self) -> float:
        return self.percentile(0.99)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """A prompt of token ids no other prompt shares (no prefix-cache hits between them)."""
    return [rng.randrange(3, vocab - 8) for _ in range(n)]


def light_ttft(client: httpx.Client, model: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise AssertionError("the stream ended without a token")


def run(
    url: str,
    model: str,
    light_key: str,
    flood_key: str | None,
    flood: Flood = Flood(),
    requests: int = 10,
    vocab: int = 1024,
    seed: int = 0,
    interval: float = 0.25,
) -> LightRun:
    """`requests` light requests one after another, one every `interval` seconds at most (the
    first once the flood fills the server); flood_key None: the light key alone. The flood's
    tokens per second are counted from its start to its stop."""
    rng = random.Random(seed)
    stop = threading.Event()
    tokens = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def flooder(worker: int) -> None:
        wrng = random.Random(seed * 1000 + worker)
        with httpx.Client(base_url=url, headers=_auth(flood_key), timeout=300) as c:
            while not stop.is_set():
                body = {
                    "model": model,
                    "prompt": _ids(wrng, flood.prompt_tokens, vocab),
                    "max_tokens": flood.max_tokens,
                    "ignore_eos": True,
                }
                try:
                    r = c.post("/v1/completions", json=body)
                    r.raise_for_status()
                except BaseException as exc:
                    if not stop.is_set():
                        errors.append(exc)
                    return
                with lock:
                    tokens[0] += r.json()["usage"]["completion_tokens"]

    threads = []
    flood_start = time.perf_counter()
    if flood_key is not None:
        threads = [
            threading.Thread(target=flooder, args=(i,), daemon=True)
            for i in range(flood.concurrency)
        ]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the flood fills the batch and the queue
    ttfts = []
    try:
        with httpx.Client(base_url=url, headers=_auth(light_key), timeout=300) as c:
            for _ in range(requests):
                ttfts.append(light_ttft(c, model, _ids(rng, 8, vocab)))
                time.sleep(max(0.0, interval - ttfts[-1]))
    finally:
        stop.set()
        with lock:
            counted, elapsed = tokens[0], time.perf_counter() - flood_start
        for t in threads:
            t.join(timeout=300)
    if errors:
        raise errors[0]
    return LightRun(ttfts, counted / elapsed if threads else 0.0)


def wait_compiled(url: str, admin_token: str, timeout: float = 600) -> str:
    """Wait while the daemon compiles its decode step in the background (its steps are slower
    meanwhile); returns /admin/stats' compiled_step."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{url}/admin/stats", headers=_auth(admin_token), timeout=30).json()
        if stats.get("compiled_step") != "warming" or time.monotonic() > deadline:
            return str(stats.get("compiled_step"))
        time.sleep(1)


def set_policy(url: str, admin_token: str, policy: str) -> None:
    """engine.scheduling_policy, live (applied at the next engine step)."""
    r = httpx.patch(
        f"{url}/admin/config",
        json={"engine": {"scheduling_policy": policy}},
        headers=_auth(admin_token),
        timeout=30,
    )
    r.raise_for_status()


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}
