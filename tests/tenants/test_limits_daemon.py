"""Issue 55, limits through a real daemon on loopback: [limits] requests_per_minute = 3 with
[[api_keys]]; the 4th request of a key is a 429 in OpenAI's shape with Retry-After and the
x-ratelimit-* headers, other keys go on; the openai SDK raises RateLimitError carrying the
headers and, with a retry, waits Retry-After and tries again; tokens per minute reserved at
admission and corrected to what the request used; [limits] changed live."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import openai
import pytest

from harness import ADMIN_TOKEN, InProcessDaemon
from tests.admin.test_admin_api import MODEL

KEYS = {name: f"sk-{name}-0123456789abcdef" for name in ("a", "b", "c", "d", "e")}


@pytest.fixture(scope="module")
def daemon(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        admin=True,
        engine={"max_num_seqs": 4, "max_model_len": 256},
        api_keys=[{"name": n, "key": k} for n, k in KEYS.items()],
        limits={"requests_per_minute": 3},
    )


def complete(c: httpx.Client, max_tokens: int = 2) -> httpx.Response:
    return c.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "hello there", "max_tokens": max_tokens},
    )


def test_fourth_request_is_429_with_retry_after_and_headers(daemon):
    with daemon.client(KEYS["a"]) as a, daemon.client(KEYS["b"]) as b:
        for left in ("2", "1", "0"):
            r = complete(a)
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "3"
            assert r.headers["x-ratelimit-remaining-requests"] == left
            assert r.headers["x-ratelimit-reset-requests"].endswith("s")
            assert "x-ratelimit-limit-tokens" not in r.headers  # no tokens limit set
        r = complete(a)
        assert r.status_code == 429
        assert r.json() == {
            "error": {
                "message": r.json()["error"]["message"],
                "type": "rate_limit_error",
                "code": "rate_limit_exceeded",
                "param": None,
            }
        }
        assert "requests per minute (3)" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 20
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-request-id"]  # the app's own headers are kept
        # Every /v1 response of a limited key carries them: a GET, a 400, a stream.
        r = a.get("/v1/models")
        assert r.status_code == 200 and r.headers["x-ratelimit-remaining-requests"] == "0"
        r = a.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
        assert r.status_code == 400 and r.headers["x-ratelimit-limit-requests"] == "3"
        # Another key is not affected, streaming included.
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
        with b.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200
            assert s.headers["x-ratelimit-remaining-requests"] == "2"
            assert "[DONE]" in s.read().decode()


def test_openai_sdk_raises_rate_limit_error_and_retries_after_retry_after(daemon, monkeypatch):
    c = daemon.openai(api_key=KEYS["c"])  # max_retries=0
    for _ in range(3):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as err:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    headers = err.value.response.headers
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert err.value.code == "rate_limit_exceeded"
    wait_ms = int(headers["retry-after-ms"])
    # max_retries=1: the SDK sleeps what the headers say, then sends the request again (the
    # sleep is recorded and skipped here: the window is 20 s a request).
    slept: list[float] = []
    monkeypatch.setattr(openai._base_client.time, "sleep", slept.append)
    sent: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(str(r.url))]})
    retrying = openai.OpenAI(
        base_url=daemon.url + "/v1", api_key=KEYS["c"], max_retries=1, http_client=http
    )
    with pytest.raises(openai.RateLimitError):
        retrying.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert len(sent) == 2  # the first try and one retry
    assert len(slept) == 1 and abs(slept[0] - wait_ms / 1000) < 1.0


def test_openai_sdk_retry_after_the_wait_succeeds(daemon, monkeypatch):
    """With retries on, a 429 costs the caller only the wait: the SDK sleeps what Retry-After
    says, and its retry, the key's one slot free by then, returns the completion (a table key
    with max_concurrent 1, its slot held by a stream that ends as the 429 arrives)."""
    with daemon.client(ADMIN_TOKEN) as admin:
        made = admin.post(
            "/admin/keys",
            json={"name": "sdk-retry", "max_concurrent": 1, "requests_per_minute": 100},
        )
        assert made.status_code == 201, made.text
        secret = made.json()["secret"]
        held = contextlib.ExitStack()
        holder = held.enter_context(daemon.client(secret))
        stream = held.enter_context(
            holder.stream(
                "POST",
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "hi",
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
        )
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: closing it would close the stream
        assert next(lines).startswith("data:")  # running: the key's one slot is taken
        live = admin.get("/admin/requests", params={"api_key_name": "sdk-retry"}).json()["live"]
        assert len(live) == 1
        answers: list[httpx.Response] = []

        def on_response(r: httpx.Response) -> None:
            answers.append(r)
            if r.status_code == 429:  # the stream ends now; its slot is free once it is gone
                held.close()
                deadline = time.monotonic() + 10
                while admin.get("/admin/requests", params={"api_key_name": "sdk-retry"}).json()[
                    "live"
                ]:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)

        me = threading.current_thread()
        slept: list[float] = []
        real_sleep = time.sleep

        def sleep(seconds: float) -> None:
            if threading.current_thread() is me:  # the SDK's, not the daemon's threads'
                slept.append(seconds)
            real_sleep(seconds)

        monkeypatch.setattr(openai._base_client.time, "sleep", sleep)
        http = httpx.Client(event_hooks={"response": [on_response]})
        client = openai.OpenAI(
            base_url=daemon.url + "/v1", api_key=secret, max_retries=2, http_client=http
        )
        got = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert got.choices[0].finish_reason in ("length", "stop")
    assert [r.status_code for r in answers] == [429, 200]
    assert answers[0].headers["Retry-After"] == "1" and answers[0].headers["retry-after-ms"]
    assert slept == [int(answers[0].headers["retry-after-ms"]) / 1000]


def test_tokens_reserved_then_corrected_and_limits_live(daemon):
    with daemon.client(ADMIN_TOKEN) as admin, daemon.client(KEYS["d"]) as d:
        r = admin.patch("/admin/config", json={"limits": {"tokens_per_minute": 300}})
        assert r.status_code == 200, r.text
        try:
            r = complete(d, max_tokens=400)  # prompt + 400 > the whole bucket: never fits
            assert r.status_code == 429
            message = r.json()["error"]["message"]
            assert "tokens per minute (300)" in message and "Request too large" in message
            start = time.monotonic()
            r = complete(d, max_tokens=200)
            assert r.status_code == 200, r.text
            used = r.json()["usage"]["total_tokens"]
            # At admission prompt + 200 were reserved; at the end corrected to what was used
            # (the lease goes back as the engine request ends, just after the response).
            assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 300 - 200
            for _ in range(100):
                left = int(d.get("/v1/models").headers["x-ratelimit-remaining-tokens"])
                if left > 300 - 200 + 5 * (time.monotonic() - start) + 1:
                    break
                time.sleep(0.02)
            refill = 300 / 60 * (time.monotonic() - start)  # 5 tokens a second come back
            assert 300 - used <= left <= 300 - used + refill + 1, (used, left, refill)
            assert d.get("/v1/models").headers["x-ratelimit-limit-tokens"] == "300"
        finally:
            admin.patch("/admin/config", json={"limits": {"tokens_per_minute": 0}})
        r = admin.patch("/admin/config", json={"limits": {"requests_per_minute": -1}})
        assert r.status_code == 422 and "limits.requests_per_minute" in r.text
        r = admin.patch("/admin/config", json={"limits": {"backend": "redis"}})
        assert r.status_code == 409  # restart-only


def test_concurrency_limit_and_open_key_counts(daemon):
    with daemon.client(ADMIN_TOKEN) as admin, daemon.client(KEYS["e"]) as e:
        assert (
            admin.patch("/admin/config", json={"limits": {"max_concurrent": 1}}).status_code == 200
        )
        try:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 64, "stream": True}
            with e.stream("POST", "/v1/completions", json=body) as s:
                assert s.status_code == 200
                r = complete(e)
                assert r.status_code == 429 and "concurrent requests (1)" in r.text
                assert r.headers["Retry-After"] == "1"
                s.read()
            # The stream ended: its slot is back (released when its engine request ended).
            for _ in range(50):
                r = complete(e)
                if r.status_code == 200 or "concurrent" not in r.text:
                    break
            assert r.status_code in (200, 429) and "concurrent" not in r.text
        finally:
            admin.patch("/admin/config", json={"limits": {"max_concurrent": 0}})
