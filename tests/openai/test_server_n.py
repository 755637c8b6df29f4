"""OpenAI `n` and `best_of` through the HTTP server (real daemon on loopback, tiny model)."""

from __future__ import annotations

import json

import httpx
import pytest

from harness import InProcessDaemon, wait_rows

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def daemon(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        engine={"max_num_seqs": 3, "max_model_len": 512},
        # Every slot may go to one request here (the share has its own test below).
        server={"max_n": 4, "max_choices_share": 1.0},
        store={"flush_interval_s": 0.1},
    )


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c


def post(c: httpx.Client, path: str, **body) -> httpx.Response:
    return c.post(path, json={"model": "model", "max_tokens": 6, **body})


def ok(c: httpx.Client, path: str, **body) -> dict:
    r = post(c, path, **body)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_n_choices_usage_and_one_row(client, daemon):
    body = ok(client, "/v1/completions", prompt=PROMPT, n=3, temperature=1.0, seed=7, logprobs=0)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) > 1  # sampled independently
    tokens = [len(c["logprobs"]["tokens"]) for c in choices]
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(PROMPT)  # once, not n times
    assert usage["completion_tokens"] == sum(tokens)
    # Seeded: the same choices again (choice i's seed derives from the request's and i).
    again = ok(client, "/v1/completions", prompt=PROMPT, n=3, temperature=1.0, seed=7, logprobs=0)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in choices]
    # Choice 0 is what n = 1 gives with the same seed.
    single = ok(client, "/v1/completions", prompt=PROMPT, temperature=1.0, seed=7)
    assert single["choices"][0]["text"] == choices[0]["text"]
    # One request row, with every choice's completion tokens.
    (row,) = wait_rows(
        daemon.cfg.store_url,
        lambda rs: rs and rs[0]["status"] == "success",
        where=f"id = '{body['id']}'",
    )
    assert row["completion_tokens"] == usage["completion_tokens"]
    assert row["prompt_tokens"] == len(PROMPT)
    # What it asked for (a replay drives it again): n, and max_tokens (post sends 6).
    assert (row["n"], row["max_tokens"]) == (3, 6)


def test_several_prompts_are_indexed_prompt_major(client):
    other = [20, 21, 22, 23]
    body = ok(client, "/v1/completions", prompt=[PROMPT, other], n=2, temperature=0)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    # Greedy: both choices of one prompt agree; the prompts differ.
    assert choices[0]["text"] == choices[1]["text"]
    assert choices[2]["text"] == choices[3]["text"]
    assert body["usage"]["prompt_tokens"] == len(PROMPT) + len(other)


def test_chat_n_streaming_every_choice_finishes(client):
    messages = [{"role": "user", "content": "hello there"}]
    plain = ok(client, "/v1/chat/completions", messages=messages, n=2, temperature=1.0, seed=3)
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in plain["choices"])

    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    roles: list[int] = []
    usage = None
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "model",
            "max_tokens": 6,
            "messages": messages,
            "n": 2,
            "temperature": 1.0,
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                i = choice["index"]
                delta = choice["delta"]
                if delta.get("role"):
                    roles.append(i)
                texts[i] += delta.get("content") or ""
                if choice["finish_reason"]:
                    assert i not in finishes  # one finish per choice
                    finishes[i] = choice["finish_reason"]
    assert sorted(roles) == [0, 1] and set(finishes) == {0, 1}
    # Streamed and non-streamed, the same seeded choices.
    assert texts == {c["index"]: c["message"]["content"] for c in plain["choices"]}
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_best_of_returns_the_most_likely_choices(client):
    kw = dict(prompt=PROMPT, temperature=1.0, seed=11, logprobs=0, max_tokens=5)
    every = ok(client, "/v1/completions", n=3, **kw)["choices"]
    total = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in every}
    assert len(total) == 3  # distinct samples: the ranking below means something
    best = ok(client, "/v1/completions", n=2, best_of=3, **kw)
    picked = [c["text"] for c in best["choices"]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    ranked = sorted(total, key=lambda t: -total[t])
    assert picked == ranked[:2]
    # Every sampled choice's tokens are billed (what was computed).
    assert best["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in every)


@pytest.mark.parametrize(
    ("path", "extra", "field", "words"),
    [
        ("/v1/completions", {"n": 5}, "n", "at most 4 (server.max_n)"),
        ("/v1/chat/completions", {"n": 5}, "n", "at most 4 (server.max_n)"),
        ("/v1/completions", {"n": 2, "best_of": 5}, "best_of", "at most 4 (server.max_n)"),
        ("/v1/completions", {"n": 3, "best_of": 2}, "best_of", "at least n (3)"),
        ("/v1/completions", {"best_of": 2, "stream": True}, "best_of", "stream"),
        ("/v1/completions", {"n": 0}, "n", "at least 1"),
        # Past the engine's own bound too (schemathesis found best_of answered 500 there).
        ("/v1/completions", {"best_of": 2613}, "best_of", "[1, 1024], got 2613"),
        ("/v1/completions", {"n": 2613}, "n", "[1, 1024], got 2613"),
    ],
)
def test_bad_n_and_best_of_are_400s_naming_the_field(client, path, extra, field, words):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}]}
    else:
        body = {"prompt": PROMPT}
    r = post(client, path, **body, **extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and words in error["message"], error


def test_n_beyond_the_batch_is_a_400_naming_max_num_seqs(client):
    # n = 4 passes server.max_n (4) but one request's choices must fit one batch (3 sequences).
    r = post(client, "/v1/completions", prompt=PROMPT, n=4)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and "max_num_seqs" in error["message"], error


def test_choices_beyond_their_share_of_the_batch_are_a_400_and_the_share_is_live(make_daemon):
    """One request's choices may take at most server.max_choices_share (default half) of
    engine.max_num_seqs: an n = 16 request would otherwise hold every request behind it."""
    token = "share-test-token-0123456789"
    d = make_daemon(
        engine={"max_num_seqs": 8},
        admin_tokens=[{"name": "ops", "token": token}],
    )
    with d.client(token) as c:
        for extra, field in (({"n": 5}, "n"), ({"n": 1, "best_of": 5}, "best_of")):
            r = post(c, "/v1/completions", prompt=PROMPT, **extra)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == field, error
            assert "server.max_choices_share" in error["message"], error
            assert "at most 4" in error["message"], error
        assert len(ok(c, "/v1/completions", prompt=PROMPT, n=4)["choices"]) == 4
        r = c.patch("/admin/config", json={"server": {"max_choices_share": 1.0}})
        assert r.status_code == 200, r.text
        assert len(ok(c, "/v1/completions", prompt=PROMPT, n=5)["choices"]) == 5
        r = c.patch("/admin/config", json={"server": {"max_choices_share": 0}})
        assert r.status_code == 422 and "server.max_choices_share" in r.text, r.text
