"""Structured outputs and tool calls over HTTP, with real clients (the openai library's
parse(), LangChain's with_structured_output, vLLM-style fields) against a real daemon serving
SmolLM2: outputs parse and validate, tool calls stream as OpenAI streams them, bad schemas get
400s naming the field, and rows, /admin/stats and /metrics show what was constrained."""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Any

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from harness import InProcessDaemon, wait_rows
from tests.conftest import require_smollm2
from tests.engine.test_structured import FAILS_LATER, PERSON

TOKEN = "structured-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
BAD_TOOL = {
    "type": "function",
    "function": {
        "name": "bad",
        "parameters": {"type": "object", "properties": {"a": {"type": "x"}}},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def served(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        require_smollm2(),
        engine={"max_model_len": 1024, "max_num_seqs": 8},
        server={"max_grammar_bytes": 60_000},
        store={"flush_interval_s": 0.05},
        admin_tokens=[{"name": "ops", "token": TOKEN}],
    )


def _post(d: InProcessDaemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(d.url + path, json={"model": MODEL, **body}, timeout=120)


def _engine(d: InProcessDaemon) -> Any:
    return d.daemon.runtime.engine.aengine.engine


def _released(d: InProcessDaemon, timeout: float = 30) -> None:
    """Every grammar state and KV block is back (read from the engine's published stats)."""
    engine = _engine(d)
    deadline = time.monotonic() + timeout
    while True:
        st = engine.stats()
        if st.grammar_states == 0 and st.kv_blocks_used == 0 and st.num_running == 0:
            return
        assert time.monotonic() < deadline, st
        time.sleep(0.05)


def _row(cfg: Any, row_id: str) -> dict[str, Any]:
    found = wait_rows(
        cfg.store_url,
        lambda r: len(r) == 1 and r[0]["status"] != "running",
        where=f"id = '{row_id}'",
    )
    return found[0]


def test_openai_parse_with_pydantic_and_rows_record_the_compile(served, client) -> None:
    d = served
    cfg = d.cfg

    class City(BaseModel):  # bounded: greedy decoding can loop in an open string or number
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population: int = Field(ge=0, le=100_000_000)

    first = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    city = first.choices[0].message.parsed
    assert isinstance(city, City) and first.choices[0].finish_reason == "stop"
    again = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Tokyo as JSON."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    assert isinstance(again.choices[0].message.parsed, City)
    cold, warm = _row(cfg, first.id), _row(cfg, again.id)
    assert cold["structured"] == warm["structured"] == "json_schema"
    assert cold["grammar_compile_ms"] > 0
    assert warm["grammar_compile_ms"] == 0  # the same schema: from the cache
    _released(d)


def test_langchain_with_structured_output_json_schema(served) -> None:
    from langchain_openai import ChatOpenAI

    d = served
    llm = ChatOpenAI(
        base_url=d.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=80
    )
    schema = {"title": "Person", "description": "A person", **PERSON}
    structured = llm.with_structured_output(schema, method="json_schema")
    result = structured.invoke("Invent a person who lives in a big city.")
    assert isinstance(result, dict)
    jsonschema.validate(result, PERSON)


def test_vllm_fields_constrain_completions_and_chat(served) -> None:
    d = served
    r = _post(
        d, "/v1/completions", {"prompt": "The best colour is", "guided_choice": ["red", "blue"]}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("red", "blue")
    r = _post(
        d,
        "/v1/completions",
        {
            "prompt": "A product code:",
            "structured_outputs": {"regex": r"[A-Z]{3}-\d{4}"},
            "max_tokens": 20,
        },
    )
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", r.json()["choices"][0]["text"]), r.text
    r = _post(
        d,
        "/v1/chat/completions",
        {"messages": ASK, "guided_json": PERSON, "max_tokens": 80, "temperature": 1, "n": 3},
    )
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    r = _post(
        d, "/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_object"}}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{")
    _released(d)


def _arguments_valid(call: dict[str, Any], tools: list[dict[str, Any]]) -> None:
    fn = {t["function"]["name"]: t["function"] for t in tools}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), fn["parameters"])
    assert call["type"] == "function" and call["id"].startswith("call_")


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_calls_validate_and_stream_as_openai_does(served, choice) -> None:
    d = served
    cfg = d.cfg
    tools = [WEATHER, TIME]
    body = {"messages": ASK, "tools": tools, "tool_choice": choice, "max_tokens": 120}
    # One call: the grammar bounds it (strings of at most 30 characters, no free whitespace)
    # well inside max_tokens, so every sample must finish as a valid call.
    for seed in range(4):
        one = {**body, "temperature": 1, "seed": seed, "parallel_tool_calls": False}
        r = _post(d, "/v1/chat/completions", one)
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        assert out["message"]["content"] is None and len(out["message"]["tool_calls"]) == 1
        call = out["message"]["tool_calls"][0]
        _arguments_valid(call, tools)
        if isinstance(choice, dict):
            assert call["function"]["name"] == "get_time"
    assert _row(cfg, r.json()["id"])["structured"] == "tools"
    # Parallel calls: the array has no length bound, so a sampled 135M model may still be
    # listing calls at max_tokens; that answer is "length" with the calls as far as they got
    # (the last one's arguments cut), as streaming sends them, and no content. Every finished
    # answer's calls validate.
    for seed in range(4):
        r = _post(d, "/v1/chat/completions", {**body, "temperature": 1, "seed": seed})
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        if out["finish_reason"] == "length":
            assert out["message"]["content"] is None and out["message"].get("tool_calls"), out
            continue
        assert out["finish_reason"] == "tool_calls", out
        assert out["message"]["content"] is None and out["message"]["tool_calls"]
        for call in out["message"]["tool_calls"]:
            _arguments_valid(call, tools)
            if isinstance(choice, dict):
                assert call["function"]["name"] == "get_time"

    whole = _post(d, "/v1/chat/completions", {**body, "temperature": 0}).json()
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    with httpx.stream(
        "POST",
        d.url + "/v1/chat/completions",
        json={"model": MODEL, **body, "temperature": 0, "stream": True},
        timeout=120,
    ) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice_delta = json.loads(line[6:])["choices"][0]
            finish = choice_delta["finish_reason"] or finish
            for tc in choice_delta["delta"].get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"name": None, "arguments": "", "id": None})
                if "id" in tc:
                    assert slot["id"] is None  # the header comes once, first
                    slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
                slot["arguments"] += tc["function"].get("arguments") or ""
    expected = whole["choices"][0]["message"]["tool_calls"]
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in expected
    ]
    _released(d)


def test_openai_client_streams_tool_call_deltas(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    pieces = [c.choices[0].delta.tool_calls for c in stream if c.choices[0].delta.tool_calls]
    assert pieces[0][0].function.name == "get_weather" and pieces[0][0].id
    arguments = "".join(p[0].function.arguments or "" for p in pieces)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_legacy_functions_answer_in_the_function_call_shape(served) -> None:
    d = served
    body = {
        "messages": ASK,
        "functions": [WEATHER["function"]],
        "function_call": {"name": "get_weather"},
        "max_tokens": 60,
        "temperature": 0,
    }
    out = _post(d, "/v1/chat/completions", body).json()["choices"][0]
    assert out["finish_reason"] == "function_call" and "tool_calls" not in out["message"]
    call = out["message"]["function_call"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
    streamed, finish = "", None
    with httpx.stream(
        "POST",
        d.url + "/v1/chat/completions",
        json={"model": MODEL, **body, "stream": True},
        timeout=120,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                finish = choice["finish_reason"] or finish
                streamed += (choice["delta"].get("function_call") or {}).get("arguments", "")
    assert finish == "function_call" and streamed == call["arguments"]


def test_tool_messages_in_the_conversation_are_accepted(client) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=30, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls  # text or a parsed call, no 500


def test_client_disconnect_and_admin_abort_release_grammar_states(served) -> None:
    d = served
    body = {
        "model": MODEL,
        "messages": ASK,
        "guided_regex": "[a-z ]{400}",
        "max_tokens": 400,
        "stream": True,
    }
    host, port = d.url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    got = b""
    while got.count(b"data: ") < 4:
        got += sock.recv(65536)
    assert _engine(d).stats().grammar_states == 1
    sock.close()
    _released(d)

    with httpx.stream("POST", d.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        rid = resp.headers["x-request-id"]
        lines = resp.iter_lines()
        next(lines)
        r = httpx.post(d.url + f"/admin/requests/{rid}/abort", headers=ADMIN, timeout=30)
        assert r.status_code in (200, 202), r.text
        for _ in lines:
            pass
    _released(d)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format.json_schema.schema",
            "cannot be compiled: Invalid type: x",
        ),
        ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
        (
            # Compiles, but its first token needs more parser work than llguidance allows
            # (structured.PARSER_LIMITS): found at compile time (the forced prefix is tried),
            # not mid-request.
            {"guided_json": {"type": "object", "properties": {f"p{i}": {} for i in range(3000)}}},
            "guided_json",
            "cannot be compiled: parser error: Too many items",
        ),
        (
            {"guided_json": {"type": "object", "description": "x" * 70_000}},
            "guided_json",
            "the limit is 60000 (server.max_grammar_bytes)",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "known: get_weather",
        ),
        (
            # A tool's parameters that cannot be compiled: the error names that tool...
            {
                "tools": [WEATHER, BAD_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "bad"}},
            },
            "tools[1].function.parameters",
            "cannot be compiled: Invalid type: x",
        ),
        # ... or, with `required` (any tool's schema may be at fault), the list.
        ({"tools": [WEATHER, BAD_TOOL], "tool_choice": "required"}, "tools", "Invalid type: x"),
        (
            {"guided_json": PERSON, "response_format": {"type": "json_object"}},
            "guided_json",
            "only one output constraint",
        ),
        (
            {"structured_outputs": {"json": PERSON, "regex": "a"}},
            "structured_outputs",
            "exactly one",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(served, extra, param, words) -> None:
    d = served
    r = _post(d, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert httpx.get(d.url + "/health", timeout=10).status_code == 200


def test_grammar_failing_part_way_is_a_400_naming_the_field_streamed_or_not(served) -> None:
    d = served
    cfg = d.cfg
    body = {"messages": ASK, "max_tokens": 40, "temperature": 0, "guided_json": FAILS_LATER}
    r = _post(d, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "guided_json" and error["type"] == "invalid_request_error"
    assert "could not follow this grammar" in error["message"], error
    assert _row(cfg, r.headers["x-request-id"])["status"] == "error"

    with httpx.stream(
        "POST", d.url + "/v1/chat/completions", json={"model": MODEL, **body, "stream": True}
    ) as resp:
        assert resp.status_code == 200  # the headers went out before the grammar gave up
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] != "[DONE]"
    last = json.loads(data[-1])["error"]
    assert last["param"] == "guided_json" and "could not follow" in last["message"], last
    assert httpx.get(d.url + "/health", timeout=10).status_code == 200
    _released(d)


def test_a_server_whose_llguidance_refuses_the_vocabulary_answers_500_saying_why(served) -> None:
    """The server's fault, not the request's: a 500 `server_error` with the code
    `structured_outputs_unavailable` and llguidance's own words; unconstrained requests are
    served as before. (The refusal is real: a grammar engine built for a 5-token vocabulary.)"""
    from controlplane.engine.structured import Grammars

    d = served
    engine = _engine(d)
    kept = engine.grammars
    engine.grammars = Grammars(engine.tokenizer, vocab_size=5)
    try:
        body = {"messages": ASK, "max_tokens": 4, "response_format": {"type": "json_object"}}
        r = _post(d, "/v1/chat/completions", body)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["param"] is None
        assert error["code"] == "structured_outputs_unavailable", error
        assert "llguidance" in error["message"] and "vocab size too small" in error["message"]
        plain = _post(d, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4})
        assert plain.status_code == 200, plain.text
    finally:
        engine.grammars = kept


def test_compile_timeout_is_a_400_and_the_grammar_is_cached_after(served) -> None:
    d = served
    big = {
        "type": "object",
        "properties": {
            f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 13 + 20}}}x"}
            for i in range(900)
        },
        "required": [f"p{i}" for i in range(900)],
    }
    r = httpx.patch(
        d.url + "/admin/config",
        json={"server.grammar_compile_timeout_s": 0.002},
        headers=ADMIN,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    try:
        r = _post(d, "/v1/chat/completions", {"messages": ASK, "guided_json": big, "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "guided_json"
        assert "longer than 0.002 s (server.grammar_compile_timeout_s)" in error["message"]
    finally:
        httpx.patch(
            d.url + "/admin/config",
            json={"server.grammar_compile_timeout_s": 10},
            headers=ADMIN,
            timeout=30,
        )
    # The compile finished in the background: the same schema is now served from the cache.
    time.sleep(1)
    r = _post(d, "/v1/chat/completions", {"messages": ASK, "guided_json": big, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_stats_and_metrics_show_constrained_requests(served) -> None:
    d = served
    for i in range(2):
        _post(d, "/v1/completions", {"prompt": f"{i}", "max_tokens": 4})
        _post(d, "/v1/completions", {"prompt": f"{i}", "max_tokens": 8, "guided_json": PERSON})
    tools = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 8}
    assert _post(d, "/v1/chat/completions", {"messages": ASK, **tools}).status_code == 200
    stats = httpx.get(d.url + "/admin/stats", headers=ADMIN, timeout=30).json()
    assert 0 < stats["structured_share"] < 1
    assert stats["grammar_mask_ms_per_step"] > 0
    assert stats["grammar_cache_hit_rate"] > 0
    assert stats["grammar_states"] == 0
    text = httpx.get(d.url + "/metrics", timeout=30).text

    def value(name: str, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in sorted({"model_name": MODEL, **labels}.items()))
        match = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
        assert match, name
        return float(match.group(1))

    assert value("controlplane:structured_requests_total", type="json_schema") >= 2
    assert value("controlplane:structured_requests_total", type="tools") >= 1
    assert value("controlplane:grammar_cache_hits_total") >= 1
    assert value("controlplane:grammar_compile_seconds_count") >= 1
    assert value("controlplane:grammar_mask_seconds_total") > 0
