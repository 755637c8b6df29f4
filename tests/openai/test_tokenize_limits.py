"""POST /tokenize and /detokenize have an input bound of their own, tied to max_model_len: over
it, a 400 in OpenAI's error shape naming the field and the limit; at it, the answer is built off
the event loop (/health keeps answering) and the idle memory trim is armed, as after engine
work (controlplane.memory).

A real in-process daemon on the tiny demo model, httpx on loopback; the trim is observed by
the memory module's own log line, on a real glibc `malloc_trim`."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from controlplane import memory
from controlplane.openai.tokenize import LIMIT_PER_CONTEXT_TOKEN
from harness import InProcessDaemon

MAX_MODEL_LEN = 2048
LIMIT = LIMIT_PER_CONTEXT_TOKEN * MAX_MODEL_LEN
IDLE_S = 0.5  # the trim's idle time in this test


@pytest.fixture(scope="module")
def served(make_module_daemon) -> InProcessDaemon:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(memory.ENV_VAR, str(IDLE_S))  # read once, as the daemon starts
        return make_module_daemon(
            engine={"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 2},
            server={"max_body_bytes": 8 << 20},  # an operator who raised it for long prompts
            store={"record_requests": False},
        )


def post(d: InProcessDaemon, path: str, body: object) -> httpx.Response:
    return httpx.post(d.url + path, content=json.dumps(body), timeout=120)


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error", err
    return err


def text(chars: int) -> str:
    """`chars` characters of varied text (some non-ASCII), repeated from one sentence."""
    sentence = "The model reads a long text, café 42 naïve über; tokens and more tokens. "
    return (sentence * (1 + chars // len(sentence)))[:chars]


def test_over_the_bound_is_a_400_naming_the_field_and_the_limit(served) -> None:
    limit = f"{LIMIT} ({LIMIT_PER_CONTEXT_TOKEN} x max_model_len {MAX_MODEL_LEN})"
    err = error_of(post(served, "/tokenize", {"prompt": text(LIMIT + 1)}))
    assert err["param"] == "prompt" and limit in err["message"], err
    assert f"is {LIMIT + 1} characters" in err["message"]

    err = error_of(post(served, "/detokenize", {"tokens": [5] * (LIMIT + 1)}))
    assert err["param"] == "tokens" and limit in err["message"], err

    chat = [{"role": "user", "content": text(LIMIT)}]
    err = error_of(post(served, "/tokenize", {"messages": chat}))
    assert err["param"] == "messages" and limit in err["message"], err

    # Larger than any admitted input could be in JSON: refused before it is parsed.
    big = "x" * (13 * LIMIT + (64 << 10))
    err = error_of(post(served, "/tokenize", {"prompt": big}))
    assert err["param"] == "body" and limit in err["message"], err

    # The bound itself is admitted, both ways.
    r = post(served, "/tokenize", {"prompt": text(LIMIT)})
    assert r.status_code == 200, r.text
    assert r.json()["max_model_len"] == MAX_MODEL_LEN
    ids = r.json()["tokens"][:LIMIT]
    assert post(served, "/detokenize", {"tokens": ids}).status_code == 200


class Trims(logging.Handler):
    """The memory module's "malloc_trim after ..." lines, as they are logged."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("malloc_trim after"):
            self.times.append(time.monotonic())


@pytest.fixture
def trims():
    log = logging.getLogger(memory.__name__)
    handler, level = Trims(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


def test_an_admitted_large_tokenize_keeps_health_prompt_and_arms_the_trim(served, trims) -> None:
    # Quiet first: a whole spell with no trim (what earlier requests left is trimmed by then),
    # so that the trim looked for below can only follow the requests made here.
    start = time.monotonic()
    while time.monotonic() - max([start, *trims.times]) < 2 * (IDLE_S + 1):
        assert time.monotonic() < start + 30, "the daemon never went quiet"
        time.sleep(0.1)
    trims.times.clear()

    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                assert c.get(served.url + "/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    body = {"prompt": text(LIMIT), "return_token_strs": True}
    try:
        with httpx.Client(timeout=120) as c:
            for _ in range(3):  # tokenize, then give the ids back: the bound both ways
                r = c.post(served.url + "/tokenize", content=json.dumps(body))
                assert r.status_code == 200 and r.json()["count"] == len(r.json()["token_strs"])
                back = {"tokens": r.json()["tokens"][:LIMIT]}
                assert c.post(served.url + "/detokenize", content=json.dumps(back)).is_success
        ended = time.monotonic()
    finally:
        done.set()
        prober.join()
    assert latencies and max(latencies) < 1.0, max(latencies)

    # No engine request ran, yet the idle trim follows the large requests.
    deadline = ended + IDLE_S + 10
    while not trims.times and time.monotonic() < deadline:
        time.sleep(0.1)
    assert trims.times, "no malloc_trim after the large tokenize requests"
