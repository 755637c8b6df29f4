"""The load generator: pure helpers, argument validation, aggregation, and the client side end to
end against a small fake OpenAI-compatible server (http.server in a thread, loopback only)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from controlplane.client.loadgen import (
    Interrupted,
    LoadConfig,
    LoadError,
    RequestResult,
    add_loadgen_parser,
    arrival_offsets,
    config_from_args,
    parse_range,
    parse_rate,
    request_specs,
    run_load,
    summarize,
)
from controlplane.common import percentile

# --------------------------------------------------------------------------------------------- #
# Percentiles
# --------------------------------------------------------------------------------------------- #


def test_percentile_linear_interpolation() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile([4.0, 1.0, 3.0, 2.0], 25) == pytest.approx(1.75)  # unsorted input
    assert percentile([7.0], 99) == 7.0
    assert percentile(range(101), 99) == pytest.approx(99.0)


def test_percentile_matches_statistics_inclusive_quantiles() -> None:
    xs = [0.3, 9.1, 2.2, 5.5, 5.5, 1.0, 8.8, 4.2, 7.7]
    q = statistics.quantiles(xs, n=100, method="inclusive")  # q[k-1] is the k-th percentile
    for p in (1, 10, 50, 90, 99):
        assert percentile(xs, p) == pytest.approx(q[p - 1])


def test_percentile_empty_is_none_and_rejects_bad_p() -> None:
    # One definition with /admin/stats (controlplane.common): no values, no percentile.
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


# --------------------------------------------------------------------------------------------- #
# Poisson schedule and workload
# --------------------------------------------------------------------------------------------- #


def test_poisson_schedule_is_seeded_and_has_the_right_mean() -> None:
    a = list(arrival_offsets(4.0, seed=1, count=20_000))
    assert a == list(arrival_offsets(4.0, seed=1, count=20_000))
    assert a != list(arrival_offsets(4.0, seed=2, count=20_000))
    assert a[0] == 0.0
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 4.0, rel=0.03)
    # exponential: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(1 / 4.0, rel=0.05)


def test_poisson_schedule_inf_is_all_at_once_and_duration_bounds_it() -> None:
    assert list(arrival_offsets(math.inf, seed=0, count=50)) == [0.0] * 50
    within = list(arrival_offsets(10.0, seed=0, duration_s=100.0))
    assert within and max(within) < 100.0
    assert len(within) == pytest.approx(1000, rel=0.15)


def test_workload_is_seeded_and_within_ranges() -> None:
    cfg = LoadConfig(url="http://x", prompt_len=(3, 9), output_len=(2, 5), seed=7)
    specs = list(itertools.islice(request_specs(cfg), 200))
    again = list(itertools.islice(request_specs(cfg), 200))
    assert specs == again
    assert [s.index for s in specs] == list(range(200))
    assert {len(s.prompt) for s in specs} == set(range(3, 10))
    assert {s.max_tokens for s in specs} == set(range(2, 6))
    assert all(100 <= t < 30000 for s in specs for t in s.prompt)
    # the rate does not change the workload
    other_rate = dataclasses.replace(cfg, rate=3.0)
    assert specs[:5] == list(itertools.islice(request_specs(other_rate), 5))


# --------------------------------------------------------------------------------------------- #
# Argument validation
# --------------------------------------------------------------------------------------------- #


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="controlplane")
    add_loadgen_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["loadgen", *argv])


def test_parse_range_and_rate() -> None:
    assert parse_range("32-256", "--prompt-len") == (32, 256)
    assert parse_range("7", "--prompt-len") == (7, 7)
    assert parse_rate("inf") == math.inf
    assert parse_rate("0") == math.inf
    assert parse_rate("2.5") == 2.5


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--prompt-len", "9-3"], "--prompt-len: expected A-B with 1 <= A <= B"),
        (["--prompt-len", "0-3"], "--prompt-len: expected A-B with 1 <= A <= B"),
        (["--prompt-len", "a-b"], "--prompt-len"),
        (["--output-len", "5-1"], "--output-len: expected A-B with 1 <= A <= B"),
        (["--output-len", "1-2-3"], "--output-len"),
        (["--rate", "-1"], "--rate"),
        (["--rate", "fast"], "--rate"),
        (["--rate", "nan"], "--rate"),
        (["--requests", "0"], "--requests"),
        (["--duration", "0"], "--duration"),
        (["--duration", "5"], "--duration: with --rate inf it needs --concurrency-limit"),
        (["--concurrency-limit", "0"], "--concurrency-limit"),
        (["--token-id-range", "5-5"], "--token-id-range"),
        (["--timeout", "0"], "--timeout"),
    ],
)
def test_bad_arguments_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(flag)):
        config_from_args(_parse(["--url", "http://127.0.0.1:1", *argv]))


def test_bad_url_and_handler_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"^--url"):
        config_from_args(_parse(["--url", "localhost:8000"]))
    args = _parse(["--url", "http://127.0.0.1:1", "--output-len", "4-2"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "--output-len: expected A-B with 1 <= A <= B, got '4-2'" in err


def test_requests_and_duration_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(["--url", "http://h", "--requests", "3", "--duration", "2"])
    assert exc.value.code == 2
    assert "--duration" in capsys.readouterr().err


def test_good_arguments_build_the_config() -> None:
    cfg = config_from_args(
        _parse(
            [
                "--url",
                "http://127.0.0.1:8000/v1/",
                "--rate",
                "3",
                "--duration",
                "10",
                "--prompt-len",
                "8-16",
                "--output-len",
                "4",
                "--stream",
                "--seed",
                "5",
                "--concurrency-limit",
                "2",
            ]
        )
    )
    assert cfg.url == "http://127.0.0.1:8000"
    assert (cfg.rate, cfg.duration_s, cfg.num_requests) == (3.0, 10.0, None)
    assert (cfg.prompt_len, cfg.output_len) == ((8, 16), (4, 4))
    assert cfg.stream and cfg.seed == 5 and cfg.concurrency_limit == 2
    default = config_from_args(_parse(["--url", "http://h:1"]))
    assert (default.num_requests, default.rate, default.stream) == (100, math.inf, False)


# --------------------------------------------------------------------------------------------- #
# Aggregation
# --------------------------------------------------------------------------------------------- #


def _ok(i: int, completion: int, ttft: float | None = None, gaps: list[float] | None = None):
    return RequestResult(
        index=i,
        ok=True,
        max_tokens=completion,
        prompt_tokens=10,
        completion_tokens=completion,
        e2e_s=(ttft or 0.0) + sum(gaps or []) + 0.001,
        ttft_s=ttft,
        itl_s=list(gaps or []),
    )


def _err(i: int, kind: str) -> RequestResult:
    return RequestResult(index=i, ok=False, max_tokens=5, error=kind, error_message=f"boom {i}")


def test_summary_aggregates_synthetic_results() -> None:
    results = [
        _ok(0, 4, ttft=0.1, gaps=[0.01, 0.02, 0.03]),
        _ok(1, 2, ttft=0.3, gaps=[0.05]),
        _err(2, "429"),
        _err(3, "503"),
        _err(4, "429"),
        _err(5, "ConnectError"),
        _err(6, "429"),
        _err(7, "ConnectError"),
    ]
    s = summarize(results, wall_s=2.0, stream=True, requests_sent=10)
    assert (s.requests_sent, s.requests_ok, s.requests_failed) == (10, 2, 6)
    assert s.requests_cancelled == 2
    assert s.errors == {"429": 3, "503": 1, "ConnectError": 2}
    assert list(s.errors) == ["429", "503", "ConnectError"]
    assert s.error_samples["429"] == "boom 2"
    assert s.total_prompt_tokens == 20 and s.total_completion_tokens == 6
    assert s.output_throughput == pytest.approx(3.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.short_outputs == 0
    assert s.ttft_ms is not None and s.ttft_ms.count == 2
    assert s.ttft_ms.p50 == pytest.approx(200.0)
    assert s.itl_ms is not None and s.itl_ms.count == 4  # every gap of every request
    assert s.itl_ms.p50 == pytest.approx(25.0)
    assert s.tpot_ms is not None and s.tpot_ms.count == 2
    assert s.e2e_ms is not None and s.e2e_ms.count == 2
    d = s.to_dict()
    assert d["rate"] == "inf" and d["ttft_ms"]["p99"] == pytest.approx(s.ttft_ms.p99)
    json.dumps(d)
    text = s.format()
    assert "429: 3, 503: 1, ConnectError: 2" in text
    assert "ok 2 / failed 6" in text


def test_summary_without_stream_has_no_ttft() -> None:
    s = summarize([_ok(0, 3), _ok(1, 3)], wall_s=1.0)
    assert s.ttft_ms is None and s.itl_ms is None and s.tpot_ms is None
    assert s.e2e_ms is not None and s.e2e_ms.count == 2
    assert s.to_dict()["ttft_ms"] is None
    assert "n/a" in s.format()


# --------------------------------------------------------------------------------------------- #
# End to end against a fake OpenAI-compatible server
# --------------------------------------------------------------------------------------------- #

FIRST_TOKEN_DELAY_S = 0.03
TOKEN_DELAY_S = 0.002


class _FakeOpenAI(BaseHTTPRequestHandler):
    """GET /v1/models; POST /v1/completions (SSE with usage when streaming). Prompts whose first
    token id is divisible by 4 get a 429."""

    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            model = {"id": "fake-model", "object": "model", "created": 0, "owned_by": "t"}
            self._json(200, {"object": "list", "data": [model]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.seen.append(body)
        prompt, n = body["prompt"], body["max_tokens"]
        if prompt[0] % 4 == 0:
            self.send_response(429)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "queue full", "type": "rate_limit"}}')
            return
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": n,
            "total_tokens": len(prompt) + n,
        }
        base = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"]}
        time.sleep(FIRST_TOKEN_DELAY_S)
        if not body.get("stream"):
            choice = {"index": 0, "text": " x" * n, "finish_reason": "length", "logprobs": None}
            self._json(200, {**base, "choices": [choice], "usage": usage})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def event(obj: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        for i in range(n):
            if i:
                time.sleep(TOKEN_DELAY_S)
            last = i == n - 1
            choice = {
                "index": 0,
                "text": " x",
                "finish_reason": "length" if last else None,
                "logprobs": None,
            }
            event({**base, "choices": [choice]})
        if body.get("stream_options", {}).get("include_usage"):
            event({**base, "choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


@pytest.fixture
def fake_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    server.daemon_threads = True
    server.seen = []  # type: ignore[attr-defined]
    server.lock = threading.Lock()  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def _expected(cfg: LoadConfig, n: int) -> tuple[int, int, int, int]:
    """(ok, rejected, prompt tokens of ok, completion tokens of ok) for the first n requests."""
    specs = list(itertools.islice(request_specs(cfg), n))
    ok = [s for s in specs if s.prompt[0] % 4 != 0]
    return len(ok), n - len(ok), sum(len(s.prompt) for s in ok), sum(s.max_tokens for s in ok)


def test_end_to_end_streaming(fake_server: ThreadingHTTPServer) -> None:
    cfg = LoadConfig(
        url=_url(fake_server),
        rate=200.0,
        num_requests=16,
        prompt_len=(4, 12),
        output_len=(3, 6),
        stream=True,
        seed=3,
    )
    s = asyncio.run(run_load(cfg))
    n_ok, n_429, prompt_tokens, completion_tokens = _expected(cfg, 16)
    assert n_ok and n_429, "the seed should give both outcomes"
    assert s.model == "fake-model"  # discovered from GET /v1/models
    assert (s.requests_sent, s.requests_ok, s.requests_failed) == (16, n_ok, n_429)
    assert s.errors == {"429": n_429}
    assert s.total_prompt_tokens == prompt_tokens
    assert s.total_completion_tokens == completion_tokens
    assert s.short_outputs == 0 and s.missing_usage == 0 and not s.interrupted
    assert s.ttft_ms is not None and s.ttft_ms.count == n_ok
    assert s.ttft_ms.p50 >= FIRST_TOKEN_DELAY_S * 1000 * 0.9
    assert s.itl_ms is not None and s.itl_ms.count == completion_tokens - n_ok
    assert s.e2e_ms is not None and s.e2e_ms.p50 >= s.ttft_ms.p50 * 0.9
    assert s.output_throughput == pytest.approx(completion_tokens / s.wall_s)
    seen = fake_server.seen  # type: ignore[attr-defined]
    assert len(seen) == 16
    for body in seen:
        assert body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert all(isinstance(t, int) and 100 <= t < 30000 for t in body["prompt"])


def test_end_to_end_cli_non_streaming_json(
    fake_server: ThreadingHTTPServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "summary.json"
    args = _parse(
        [
            "--url",
            _url(fake_server),
            "--requests",
            "10",
            "--prompt-len",
            "2-5",
            "--output-len",
            "1-3",
            "--model",
            "named-model",
            "--concurrency-limit",
            "3",
            "--json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    d = json.loads(out.read_text())
    cfg = config_from_args(args)
    n_ok, n_429, prompt_tokens, completion_tokens = _expected(cfg, 10)
    assert d["model"] == "named-model" and d["stream"] is False and d["rate"] == "inf"
    assert (d["requests_ok"], d["requests_failed"]) == (n_ok, n_429)
    assert d["errors"] == ({"429": n_429} if n_429 else {})
    assert d["total_completion_tokens"] == completion_tokens
    assert d["total_prompt_tokens"] == prompt_tokens
    assert d["ttft_ms"] is None and d["itl_ms"] is None and d["e2e_ms"]["count"] == n_ok
    assert f"ok {n_ok} / failed {n_429}" in printed
    assert {b["model"] for b in fake_server.seen} == {"named-model"}  # type: ignore[attr-defined]


def test_connection_errors_are_counted_by_exception_type() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI) as closed:
        port = closed.server_address[1]  # bound, then closed: nothing listens there
    cfg = LoadConfig(url=f"http://127.0.0.1:{port}", model="m", num_requests=3, stream=True)
    s = asyncio.run(run_load(cfg))
    assert s.requests_failed == 3 and s.errors == {"ConnectError": 3}


@pytest.mark.serial
def test_stop_event_cancels_and_returns_partial_summary(fake_server: ThreadingHTTPServer) -> None:
    cfg = LoadConfig(
        url=_url(fake_server),
        model="m",
        rate=20.0,
        num_requests=1000,
        prompt_len=(2, 2),
        output_len=(1, 2),
    )

    async def main():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.4, stop.set)
        t0 = time.perf_counter()
        summary = await run_load(cfg, stop=stop)
        return summary, time.perf_counter() - t0

    s, elapsed = asyncio.run(main())
    assert s.interrupted and elapsed < 5
    assert 0 < s.requests_sent < 1000
    assert s.requests_ok + s.requests_failed + s.requests_cancelled == s.requests_sent


def test_duration_closed_loop(fake_server: ThreadingHTTPServer) -> None:
    cfg = LoadConfig(
        url=_url(fake_server),
        model="m",
        num_requests=None,
        duration_s=0.3,
        concurrency_limit=2,
        prompt_len=(2, 2),
        output_len=(1, 1),
    )
    t0 = time.perf_counter()
    s = asyncio.run(run_load(cfg))
    assert 0.3 <= time.perf_counter() - t0 < 3
    # Each successful request holds one of the two slots for >= FIRST_TOKEN_DELAY_S; the fake
    # server's 429s (token id divisible by 4) return at once, so they don't count toward it.
    assert s.requests_sent >= 2
    assert s.requests_ok <= 2 * 0.3 / FIRST_TOKEN_DELAY_S + 2, (s.errors, s.error_samples)
    assert s.requests_ok + s.requests_failed == s.requests_sent


_CLI = """
import argparse, sys
from controlplane.client.loadgen import add_loadgen_parser
p = argparse.ArgumentParser(prog="controlplane")
add_loadgen_parser(p.add_subparsers(dest="command", required=True))
args = p.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery")
def test_ctrl_c_prints_partial_summary(fake_server: ThreadingHTTPServer, tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    argv = ["loadgen", "--url", _url(fake_server), "--rate", "10", "--requests", "1000"]
    argv += ["--prompt-len", "2", "--output-len", "2", "--stream", "--json", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLI, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 20
        while len(fake_server.seen) < 3 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "(interrupted)" in stdout and "TTFT" in stdout
    d = json.loads(out.read_text())
    assert d["interrupted"] is True and 3 <= d["requests_sent"] < 1000


def test_stop_during_model_discovery_and_discovery_failure() -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        cfg = LoadConfig(url=f"http://127.0.0.1:{silent.getsockname()[1]}", num_requests=1)

        async def main() -> None:
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(0.2, stop.set)
            await run_load(cfg, stop=stop)

        t0 = time.perf_counter()
        with pytest.raises(Interrupted):
            asyncio.run(main())
        assert time.perf_counter() - t0 < 5
        port = silent.getsockname()[1]
    # nothing listens any more: discovery fails with a LoadError, the CLI exits 1
    with pytest.raises(LoadError, match="cannot list models"):
        asyncio.run(run_load(LoadConfig(url=f"http://127.0.0.1:{port}", num_requests=1)))
    args = _parse(["--url", f"http://127.0.0.1:{port}", "--requests", "1"])
    assert args.func(args) == 1


def test_client_mix_is_seeded_and_leaves_the_prompts_alone() -> None:
    base = LoadConfig(url="http://x", num_requests=400, seed=7)
    mixed = LoadConfig(
        url="http://x", num_requests=400, seed=7, stream_fraction=0.5, disconnect_fraction=0.3
    )
    plain = list(itertools.islice(request_specs(base), 400))
    specs = list(itertools.islice(request_specs(mixed), 400))
    assert [s.prompt for s in specs] == [s.prompt for s in plain]
    assert [s.max_tokens for s in specs] == [s.max_tokens for s in plain]
    assert not any(s.stream or s.disconnect_after_s is not None for s in plain)
    streams = sum(s.stream for s in specs)
    hang_ups = [s.disconnect_after_s for s in specs if s.disconnect_after_s is not None]
    assert 160 <= streams <= 240 and 80 <= len(hang_ups) <= 160
    assert all(0.0 <= d <= mixed.disconnect_within_s for d in hang_ups)
    assert specs == list(itertools.islice(request_specs(mixed), 400))  # same seed, same mix
    with pytest.raises(ValueError, match="--disconnect-fraction"):
        LoadConfig(url="http://x", disconnect_fraction=1.5).validate()
    with pytest.raises(ValueError, match="--stream-fraction"):
        LoadConfig(url="http://x", stream_fraction=-0.1).validate()


def test_clients_that_hang_up_are_counted_apart_from_failures(
    fake_server: ThreadingHTTPServer,
) -> None:
    # Every client hangs up within 1 ms, long before the fake server's 30 ms first token.
    cfg = LoadConfig(
        url=_url(fake_server),
        num_requests=12,
        prompt_len=(4, 12),
        output_len=(3, 6),
        seed=3,
        stream_fraction=0.5,
        disconnect_fraction=1.0,
        disconnect_within_s=0.001,
    )
    s = asyncio.run(run_load(cfg))
    assert s.requests_disconnected == 12
    assert (s.requests_ok, s.requests_failed, s.errors) == (0, 0, {})
    assert "disconnected 12" in s.format()
