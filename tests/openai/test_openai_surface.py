"""The rest of the surface real clients use: vLLM's POST /tokenize and /detokenize, GET
/version, GET /v1/models/{model}, `stream_options.continuous_usage_stats`, logprobs' `bytes`
(a token's own bytes), and a forced tool call cut by max_tokens (the same both ways).

A real daemon on loopback serving the real SmolLM2 (its byte-level BPE is what the token
tests are about), the official openai client and httpx; no mocks.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

import controlplane
from harness import InProcessDaemon
from tests.conftest import require_smollm2

KEY, SUSPENDED = "surface-key-0123456789abcdef", "surface-suspended-0123456789"
MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 1024
TEXT = "Hello world! 你好, 世界 😀 — café"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour. 你好 😀"},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city", "unit"],
        },
    },
}


@pytest.fixture(scope="module")
def served(make_module_daemon) -> InProcessDaemon:
    model = require_smollm2()
    return make_module_daemon(
        model,
        admin=True,
        engine={"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4},
        server={"suspended_keys": ["suspended"]},
        api_keys=[{"name": "tenant", "key": KEY}, {"name": "suspended", "key": SUSPENDED}],
    )


@pytest.fixture
def client(served) -> openai.OpenAI:
    return served.openai(KEY)


@pytest.fixture
def tok(served):
    return served.daemon.aengine.engine.tokenizer  # the engine's own tokenizer


def post(d: InProcessDaemon, path: str, body: Any, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(d.url + path, json=body, headers=headers, timeout=60)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]


# -- POST /tokenize, POST /detokenize ------------------------------------------------------------


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_detokenize_round_trip_is_the_engines_tokenizer(served, tok, special) -> None:
    r = post(
        served,
        "/tokenize",
        {"model": MODEL, "prompt": TEXT, "add_special_tokens": special, "return_token_strs": True},
    )
    assert r.status_code == 200, r.text
    ids = tok.encode(TEXT, add_special_tokens=special)
    assert r.json() == {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": [tok.id_to_token(i) for i in ids],
    }
    back = post(served, "/detokenize", {"model": MODEL, "tokens": ids})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": TEXT}
    # vLLM's `model` is optional; token_strs only when asked for.
    assert post(served, "/tokenize", {"prompt": TEXT}).json().keys() == {
        "count",
        "max_model_len",
        "tokens",
    }


def test_tokenize_chat_counts_what_a_chat_completion_bills(served, tok, client) -> None:
    r = post(served, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode_chat(MESSAGES, True, escape=True)
    assert body["count"] == len(body["tokens"])
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert done.usage.prompt_tokens == body["count"]

    # Tools are rendered the way the chat completion renders them (same path).
    with_tools = post(
        served, "/tokenize", {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER]}
    )
    assert with_tools.status_code == 200, with_tools.text
    called = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, tools=[WEATHER]
    )
    assert called.usage.prompt_tokens == with_tools.json()["count"] > body["count"]

    # No generation prompt; continue_final_message ends on the last message's own text.
    bare = post(
        served, "/tokenize", {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    assert body["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < body["count"]
    prefill = [*MESSAGES, {"role": "assistant", "content": "The colour is"}]
    cont = post(
        served,
        "/tokenize",
        {
            "model": MODEL,
            "messages": prefill,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ).json()
    text = post(served, "/detokenize", {"tokens": cont["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe colour is")


def test_tokenize_and_detokenize_errors_name_the_field(served, tok) -> None:
    vocab = served.daemon.aengine.engine.model_config.vocab_size
    for bad in ([1, vocab], [-1], [1, "a"], [True]):
        err = error_of(post(served, "/detokenize", {"model": MODEL, "tokens": bad}), 400)
        assert err["param"] == "tokens" and err["type"] == "invalid_request_error", err
    assert (
        f"[0, {vocab})"
        in error_of(post(served, "/detokenize", {"tokens": [vocab]}), 400)["message"]
    )
    assert error_of(post(served, "/detokenize", {"model": MODEL}), 400)["param"] == "tokens"

    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        err = error_of(post(served, path, {**body, "model": "nope"}), 404)
        assert (err["param"], err["code"]) == ("model", "model_not_found")

    neither = error_of(post(served, "/tokenize", {"model": MODEL}), 400)
    assert neither["param"] == "prompt"
    both = {"model": MODEL, "prompt": "x", "messages": MESSAGES}
    assert error_of(post(served, "/tokenize", both), 400)["param"] == "prompt"
    both_modes = {"model": MODEL, "messages": MESSAGES, "continue_final_message": True}
    assert error_of(post(served, "/tokenize", both_modes), 400)["param"] == (
        "continue_final_message"
    )
    bad_role = {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}
    assert error_of(post(served, "/tokenize", bad_role), 400)["param"] == "messages[0].role"
    flag = {"model": MODEL, "prompt": "x", "add_special_tokens": "yes"}
    assert error_of(post(served, "/tokenize", flag), 400)["param"] == "add_special_tokens"


def test_tokenizer_routes_have_the_v1_key_guard(served) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        err = error_of(post(served, path, body, key=None), 401)
        assert err["code"] == "invalid_api_key"
        err = error_of(post(served, path, body, key=SUSPENDED), 403)
        assert err["code"] == "api_key_suspended"


def test_token_bytes_are_the_tokens_own_bytes(tok) -> None:
    """Over SmolLM2's whole vocabulary: a token that is whole UTF-8 text has its text's bytes;
    the pieces of a multi-byte character add up to the character's bytes."""
    for i in range(tok.vocab_size):
        raw = tok.token_bytes(i)
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            continue
        assert text == tok.decode([i], skip_special_tokens=False), i
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == TEXT.encode()


# -- GET /version, GET /v1/models/{model} --------------------------------------------------------


def test_version_needs_no_key(served) -> None:
    r = httpx.get(served.url + "/version", timeout=30)
    assert r.status_code == 200
    assert r.json() == {"version": controlplane.__version__}


def test_models_retrieve(served, client) -> None:
    listed = client.models.list().data
    found = client.models.retrieve(MODEL)
    assert found.model_dump() == listed[0].model_dump()
    assert found.id == MODEL and found.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.status_code == 404
    assert caught.value.body == {
        "message": "The model 'no-such-model' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert caught.value.code == "model_not_found"
    r = httpx.get(served.url + f"/v1/models/{MODEL}", timeout=30)
    assert error_of(r, 401)["code"] == "invalid_api_key"


# -- stream_options.continuous_usage_stats --------------------------------------------------------

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def check_continuous(chunks: list[Any], prompt_tokens: int) -> None:
    assert chunks and all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] > done[0], done
    assert all(c.usage.prompt_tokens == prompt_tokens for c in chunks)
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in chunks)
    last, before = chunks[-1], chunks[-2]
    assert last.choices == [] and last.usage.completion_tokens == before.usage.completion_tokens
    # More than one distinct count: usage really grows chunk by chunk.
    assert len(set(done)) > 2


def test_continuous_usage_on_every_chunk(served, client, tok) -> None:
    common = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True}
    chunks = list(
        client.completions.create(
            prompt=TEXT, stream_options=CONTINUOUS, extra_body={"ignore_eos": True}, **common
        )
    )
    check_continuous(chunks, len(tok.encode(TEXT)))
    assert chunks[-1].usage.completion_tokens == 12

    chunks = list(
        client.chat.completions.create(
            messages=MESSAGES, stream_options=CONTINUOUS, extra_body={"ignore_eos": True}, **common
        )
    )
    check_continuous(chunks, len(tok.encode_chat(MESSAGES, True, escape=True)))
    assert chunks[0].usage.completion_tokens == 0  # the role chunk, before any token
    assert chunks[-1].usage.completion_tokens == 12

    # Without continuous_usage_stats, only the last chunk has usage (as before).
    plain = list(
        client.chat.completions.create(
            messages=MESSAGES, stream_options={"include_usage": True}, **common
        )
    )
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_continuous_usage_must_be_a_boolean(served) -> None:
    body = {
        "model": MODEL,
        "prompt": "x",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"},
    }
    err = error_of(post(served, "/v1/completions", body), 400)
    assert err["param"] == "stream_options.continuous_usage_stats"


# -- logprobs' bytes ----------------------------------------------------------------------------


def test_chat_logprobs_bytes_are_the_tokens_own(client, tok) -> None:
    """A guided choice makes SmolLM2 write CJK and an emoji, whose tokens are pieces of UTF-8
    characters: their `bytes` are those pieces (adding up to the text), never U+FFFD's."""
    answer = "你好 😀"
    done = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello in Chinese."}],
        max_tokens=20,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"guided_choice": [answer]},
    )
    assert done.choices[0].message.content == answer
    content = done.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content) == answer.encode()
    partial = [e for e in content if "\ufffd" in e.token]
    assert partial, "the answer's tokens should include pieces of characters"
    for e in content:
        for entry in [e, *e.top_logprobs]:
            raw = bytes(entry.bytes)
            if "\ufffd" in entry.token:  # part of a character: its own bytes, not U+FFFD's
                assert "\ufffd".encode() not in raw, entry
                with pytest.raises(UnicodeDecodeError):
                    raw.decode()
            else:
                assert raw.decode() == entry.token
    # Each token's bytes are the tokenizer's raw bytes of that token.
    ids = tok.encode(answer, add_special_tokens=False)
    assert [bytes(e.bytes) for e in content[: len(ids)]] == [tok.token_bytes(i) for i in ids]


# -- a forced tool call cut by max_tokens -------------------------------------------------------


def streamed_calls(chunks: list[Any]) -> tuple[list[tuple[str, str]], str | None, str]:
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    content, reason = "", None
    for c in chunks:
        for choice in c.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                if call.function.name:
                    names[call.index] = call.function.name
                calls.setdefault(call.index, []).append(call.function.arguments or "")
            reason = choice.finish_reason or reason
    return [(names[i], "".join(calls[i])) for i in sorted(calls)], reason, content


# Budgets well inside the call on any CPU's arithmetic: a named call's arguments are all it
# generates, and on a Zen 4 SmolLM2 closed them within 14 tokens (finish "tool_calls").
@pytest.mark.parametrize(
    "choice,max_tokens",
    [("required", 14), ({"type": "function", "function": {"name": "get_weather"}}, 6)],
    ids=["required", "named"],
)
def test_forced_call_cut_by_max_tokens_is_the_same_both_ways(client, choice, max_tokens) -> None:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        "tools": [WEATHER],
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    done = client.chat.completions.create(**request)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "length"
    assert message.content is None and message.tool_calls, message
    full = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert [name for name, _ in full] == ["get_weather"]
    arguments = full[0][1]
    assert arguments.startswith("{")
    with pytest.raises(json.JSONDecodeError):  # cut: partial arguments
        json.loads(arguments)

    calls, reason, content = streamed_calls(
        list(client.chat.completions.create(stream=True, **request))
    )
    assert (calls, reason, content) == (full, "length", "")


def test_forced_call_that_completes_is_unchanged(client) -> None:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 80,
    }
    done = client.chat.completions.create(**request)
    assert done.choices[0].finish_reason == "tool_calls"
    arguments = json.loads(done.choices[0].message.tool_calls[0].function.arguments)
    assert isinstance(arguments, dict)
    calls, reason, _ = streamed_calls(list(client.chat.completions.create(stream=True, **request)))
    assert reason == "tool_calls"
    assert calls == [
        (c.function.name, c.function.arguments) for c in done.choices[0].message.tool_calls
    ]
