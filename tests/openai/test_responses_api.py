"""POST /v1/responses (OpenAI's Responses API, stateless) with the openai library's
`responses.create` / `responses.stream` against a real daemon serving SmolLM2: text, the
incomplete status at max_output_tokens, JSON schemas through text.format, a function-call round
trip, streamed text and calls (events in the SDK's order, numbered), one priced SQL row per
response; and hostile requests: previous_response_id, malformed items, fuzzed bodies, each a
400 naming the Responses field, never a 5xx."""

from __future__ import annotations

import json
from typing import Any

import httpx
import hypothesis
import jsonschema
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from harness import InProcessDaemon, wait_rows
from tests.conftest import require_smollm2
from tests.engine.test_structured import FAILS_LATER

MODEL = "smollm2-135m-instruct"
TOKEN = "responses-token-0123456789"
PRICES = [
    {
        "model": "*",
        "effective_from": "2020-01-01T00:00:00Z",
        "prompt_per_mtok": 1.0,
        "cached_prompt_per_mtok": 0.5,
        "completion_per_mtok": 3.0,
    },
]
WEATHER = {
    "type": "function",
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
    "strict": True,
}
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        require_smollm2(),
        engine={"max_model_len": 1024, "max_num_seqs": 8},
        server={"max_grammar_bytes": 60_000},  # FAILS_LATER's size
        store={"flush_interval_s": 0.05},
        prices=PRICES,
        admin_tokens=[{"name": "ops", "token": TOKEN}],
    )


def _row(cfg: Any, row_id: str) -> dict[str, Any]:
    (row,) = wait_rows(
        cfg.store_url,
        lambda r: len(r) == 1 and r[0]["status"] != "running",
        where=f"id = '{row_id}'",
    )
    return row


def _post(d: InProcessDaemon, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(d.url + "/v1/responses", json={"model": MODEL, **body}, timeout=120)


def _cost(usage: Any) -> float:
    fresh = usage.input_tokens - usage.input_tokens_details.cached_tokens
    cached = usage.input_tokens_details.cached_tokens
    return (fresh * 1.0 + cached * 0.5 + usage.output_tokens * 3.0) / 1e6


def test_text_response_shape_usage_and_its_priced_row(served, client) -> None:
    cfg = served.cfg
    r = client.responses.create(
        model=MODEL,
        instructions="Answer in one short sentence.",
        input="What is the capital of France?",
        max_output_tokens=40,
        temperature=0,
        user="alice",
        store=True,  # accepted; nothing is kept
        metadata={"ticket": "42"},
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    assert r.output_text.strip() and "Paris" in r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_")
    assert [(c.type, c.annotations) for c in item.content] == [("output_text", [])]
    assert r.instructions == "Answer in one short sentence." and r.metadata == {"ticket": "42"}
    assert r.text.format.type == "text" and r.tools == [] and r.tool_choice == "auto"
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens > 0
    assert u.output_tokens_details.reasoning_tokens == 0
    row = _row(cfg, r.id)  # one row per response, its id the response's
    assert row["endpoint"] == "responses" and row["status"] == "success"
    assert row["finish_reason"] == "stop" and row["end_user"] == "alice"
    assert row["prompt_tokens"] == u.input_tokens
    assert row["cached_prompt_tokens"] == u.input_tokens_details.cached_tokens
    assert row["completion_tokens"] == u.output_tokens
    assert float(row["cost_usd"]) == pytest.approx(_cost(u), rel=1e-9)


def test_the_same_conversation_as_items_is_the_same_prompt(served, client) -> None:
    # A string input and the same user message as an item (content parts, a developer message
    # for instructions) render the same chat prompt: same input tokens, same greedy answer.
    kw = {"model": MODEL, "max_output_tokens": 12, "temperature": 0}
    a = client.responses.create(instructions="Be brief.", input="Name a color.", **kw)
    b = client.responses.create(
        input=[
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Name a color."}],
            },
        ],
        **kw,
    )
    assert a.usage.input_tokens == b.usage.input_tokens and a.output_text == b.output_text


def test_max_output_tokens_makes_it_incomplete(served, client) -> None:
    cfg = served.cfg
    r = client.responses.create(
        model=MODEL,
        input="Tell me a long story about a dragon.",
        max_output_tokens=5,
        temperature=0,
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete" and r.output_text
    row = _row(cfg, r.id)
    assert row["finish_reason"] == "length" and row["completion_tokens"] == 5


def test_json_schema_through_text_format(served, client) -> None:
    cfg = served.cfg
    r = client.responses.create(
        model=MODEL,
        input="Describe Paris as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        max_output_tokens=80,
        temperature=0,
    )
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"
    assert _row(cfg, r.id)["structured"] == "json_schema"
    obj = client.responses.create(
        model=MODEL,
        input="Give me a JSON object with a key 'a'.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
        temperature=0,
    )
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)
    assert _row(cfg, obj.id)["structured"] == "json_object"


def test_function_call_round_trip(served, client) -> None:
    cfg = served.cfg
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(
        model=MODEL,
        input=[ask],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.status == "completed" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and first.output_text == ""
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert first.tools[0].name == "get_weather" and first.tool_choice.name == "get_weather"
    assert _row(cfg, first.id)["structured"] == "tools"
    # The call and its output go back in the input (nothing is stored): a text answer.
    second = client.responses.create(
        model=MODEL,
        input=[
            ask,
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=40,
        temperature=0,
    )
    assert second.output[0].type == "message" and second.output_text.strip()
    # The call and its output are in the prompt: more than the question alone.
    alone = client.responses.create(
        model=MODEL, input=[ask], tools=[WEATHER], tool_choice="none", max_output_tokens=1
    )
    assert second.usage.input_tokens > alone.usage.input_tokens + 10


def test_required_tool_choice_gives_calls(served, client) -> None:
    r = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris and in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=120,
        temperature=0,
    )
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and calls
    for c in calls:
        assert c.name == "get_weather"
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])


def _checked_order(events: list[Any]) -> None:
    """Sequence numbers 0, 1, 2...; created, in_progress first; the terminal event last; each
    item added before its deltas and done after them."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    opened: set[int] = set()
    done: set[int] = set()
    for e in events[2:-1]:
        index = getattr(e, "output_index", None)
        if e.type == "response.output_item.added":
            assert index not in opened
            opened.add(index)
        elif e.type == "response.output_item.done":
            assert index in opened and index not in done
            done.add(index)
        else:
            assert index in opened and index not in done, e.type
    assert opened == done


def test_stream_text_deltas_make_the_final_text(served, client) -> None:
    cfg = served.cfg
    with client.responses.stream(
        model=MODEL, input="Say hello to Ada.", max_output_tokens=60, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _checked_order(events)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.output_text
    (text_done,) = [e for e in events if e.type == "response.output_text.done"]
    assert text_done.text == deltas
    assert events[0].response.status == "in_progress" and events[0].response.usage is None
    assert final.status == "completed" and final.id == events[0].response.id
    row = _row(cfg, final.id)
    assert row["endpoint"] == "responses"
    assert row["completion_tokens"] == final.usage.output_tokens
    assert row["prompt_tokens"] == final.usage.input_tokens


def test_stream_ends_incomplete_at_max_output_tokens(served) -> None:
    d = served
    body = {"input": "Tell me a long story.", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", d.url + "/v1/responses", json={"model": MODEL, **body}) as resp:
        assert resp.status_code == 200
        lines = [x for x in resp.iter_lines() if x]
    names = [x.removeprefix("event: ") for x in lines if x.startswith("event: ")]
    datas = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: ")]
    assert names == [p["type"] for p in datas]  # each event's name is its payload's type
    last = datas[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 4


def test_stream_function_call(served, client) -> None:
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _checked_order(events)
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = final.output
    assert pieces == args_done.arguments == call.arguments
    assert call.call_id == added.item.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_assistant_output_goes_back_as_input(served, client) -> None:
    kw = {"model": MODEL, "max_output_tokens": 12, "temperature": 0}
    first = client.responses.create(input="Name a fruit.", **kw)
    turns = [
        {"role": "user", "content": "Name a fruit."},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And a vegetable?"},
    ]
    second = client.responses.create(input=turns, **kw)
    assert second.status in ("completed", "incomplete") and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_grammar_failing_part_way_names_text_format_streamed_or_not(served) -> None:
    d = served
    cfg = d.cfg
    fmt = {"type": "json_schema", "name": "x", "schema": FAILS_LATER}
    body = {"input": "Some JSON please.", "text": {"format": fmt}, "max_output_tokens": 40}
    r = _post(d, {**body, "temperature": 0})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "text.format.schema" and "could not follow" in error["message"]
    assert _row(cfg, r.headers["x-request-id"])["status"] == "error"
    with httpx.stream(
        "POST", d.url + "/v1/responses", json={"model": MODEL, **body, "stream": True}
    ) as resp:
        assert resp.status_code == 200  # the headers went out before the grammar gave up
        data = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: ")]
    assert [e["type"] for e in data[-2:]] == ["error", "response.failed"]
    assert data[-2]["param"] == "text.format.schema"
    failed = data[-1]["response"]
    assert failed["status"] == "failed" and "could not follow" in failed["error"]["message"]
    assert [e["sequence_number"] for e in data] == list(range(len(data)))


def test_an_operator_abort_cancels_the_stream(served) -> None:
    d = served
    cfg = d.cfg
    body = {"model": MODEL, "input": "Write a very long essay about rivers.", "stream": True}
    body["max_output_tokens"] = 800
    data = []
    with httpx.stream("POST", d.url + "/v1/responses", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data.append(json.loads(line[6:]))
            if data[-1]["type"] == "response.output_text.delta" and len(data) == 5:
                rid = data[0]["response"]["id"]
                abort = httpx.post(
                    f"{d.url}/admin/requests/{rid}/abort",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )
                assert abort.status_code == 200, abort.text
    last = data[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "cancelled"
    assert data[-2]["type"] == "response.output_item.done"
    assert data[-2]["item"]["status"] == "incomplete"
    row = _row(cfg, rid)
    assert row["status"] == "aborted" and row["endpoint"] == "responses"
    assert row["completion_tokens"] == last["response"]["usage"]["output_tokens"]


# -- hostile ---------------------------------------------------------------------------------


def test_previous_response_id_is_a_400_naming_it(served, client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    body = err.value.body
    assert body["param"] == "previous_response_id"
    assert "not stored (stateless server)" in body["message"] and "input" in body["message"]


CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": []}, "input"),
        ({"input": None}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"role": "user", "content": "a"}, {"type": "reasoning"}]}, "input[1].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "a"}]}, "input[0].role"),
        ({"input": [{"type": "message", "content": "a"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
            "input[0].content[0].text",
        ),
        ({"input": [{**CALL, "arguments": {}}]}, "input[0].arguments"),
        ({"input": [{**CALL, "call_id": None}]}, "input[0].call_id"),
        (
            {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
            "input[0].call_id",
        ),
        (
            {"input": [CALL, {"type": "function_call_output", "call_id": "c1", "output": 1}]},
            "input[1].output",
        ),
        ({"input": [CALL, CALL]}, "input[1].call_id"),
        ({"input": "hi", "instructions": 7}, "instructions"),
        ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
        ({"input": "hi", "temperature": "hot"}, "temperature"),
        ({"input": "hi", "stream": "yes"}, "stream"),
        ({"input": "hi", "store": "yes"}, "store"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format.name",
        ),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
        ),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}},
            "text.format.schema",
        ),
        (
            {
                "input": "hi",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}},
            },
            "text.format.schema",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        (
            {"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "array"}}]},
            "tools[0].parameters.type",
        ),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
            "tool_choice",
        ),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x" * 20_000}, "input"),  # beyond max_model_len
        ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),  # with the prompt
    ],
)
def test_malformed_requests_are_400_naming_the_field(served, body, param) -> None:
    d = served
    r = _post(d, body)
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and error["type"] == "invalid_request_error"


def test_unknown_model_and_non_object_bodies(served) -> None:
    d = served
    r = httpx.post(d.url + "/v1/responses", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(d.url + "/v1/responses", json=[1, 2])
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.post(
        d.url + "/v1/responses", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400


def test_unknown_fields_are_ignored(served, client) -> None:
    r = client.responses.create(
        model=MODEL,
        input="Hi",
        max_output_tokens=4,
        reasoning={"effort": "low"},
        include=["message.output_text.logprobs"],
        service_tier="auto",
        prompt_cache_key="k",
        truncation="auto",
    )
    assert r.usage.output_tokens <= 4


# -- fuzzing: no body is a 5xx ---------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_daemon(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(engine={"max_model_len": 256})


@pytest.mark.parametrize(
    "mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
)
def test_fuzzed_bodies_never_5xx(fuzz_daemon, mode) -> None:
    d = fuzz_daemon
    op = schemathesis.openapi.from_url(d.url + "/schema/openapi.json")["/v1/responses"]["POST"]

    @settings(
        max_examples=40,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    def check(case) -> None:
        if isinstance(case.body, dict):
            case.body["model"] = "model"  # the tiny model: requests reach the engine
        response = case.call(base_url=d.url, timeout=60)
        context = (case.body, response.status_code, response.text[:500])
        assert response.status_code < 500, context
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, context

    check()


def test_stream_cut_by_max_output_tokens_final_response_is_in_the_incomplete_event(
    served, client
) -> None:
    """What docs/openai-api.md tells a client: the SDK's get_final_response() raises on a
    stream that ends with response.incomplete, and that event carries the final response."""
    with client.responses.stream(
        model=MODEL, input="Tell me a long story.", max_output_tokens=4, temperature=0
    ) as stream:
        final = None
        events = []
        for event in stream:  # the workaround, as the docs write it
            events.append(event)
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                final = event.response
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            stream.get_final_response()
    assert events[-1].type == "response.incomplete" and final is events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and final.output_text == deltas
    assert final.usage.output_tokens == 4 and final.id == events[0].response.id
