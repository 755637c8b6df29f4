"""Tool calls (controlplane.openai.tools): request parsing and its 400s, the prompt, the
constraint, and the parsing of outputs, whole and streamed. Pure Python: no model, no server."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jinja2
import jsonschema
import pytest

from controlplane.http.errors import APIError
from controlplane.openai.tools import (
    MAX_TOOLS,
    Tool,
    ToolCall,
    ToolCallStream,
    ToolChoice,
    ToolRequest,
    constrained_schema,
    default_system_prompt,
    has_tools_variable,
    parse_auto,
    parse_constrained,
    parse_tools,
    render_messages,
    validate_history,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}


def fn(name: str, parameters: Any = None, **extra: Any) -> dict[str, Any]:
    function = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS_BODY = [fn("get_weather", WEATHER, description="Current weather"), fn("search", SEARCH)]
TOOLS = [Tool("get_weather", "Current weather", WEATHER), Tool("search", "", SEARCH)]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def request(mode: str = "auto", name: str | None = None, parallel: bool = True) -> ToolRequest:
    return ToolRequest(TOOLS, ToolChoice(mode, name), parallel)


def rejected(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        parse_tools(body)
    return info.value


# -- parse_tools ------------------------------------------------------------------------------


def test_parse_tools_defaults() -> None:
    req = parse_tools({"tools": [*TOOLS_BODY, fn("ping")]})
    assert req is not None
    assert req.tools[:2] == TOOLS
    assert req.tools[2] == Tool("ping", "", {"type": "object", "properties": {}})
    assert req.choice == ToolChoice("auto")
    assert req.parallel is True
    assert req.legacy is False


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"tools": None},
        {"tools": []},
        {"tool_choice": "none"},
        {"tools": [], "tool_choice": "none"},
    ],
)
def test_no_tools_is_none(body: dict[str, Any]) -> None:
    assert parse_tools(body) is None


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("none", ToolChoice("none")),
        ("auto", ToolChoice("auto")),
        ("required", ToolChoice("required")),
        ({"type": "function", "function": {"name": "search"}}, ToolChoice("named", "search")),
    ],
)
def test_tool_choice_forms(choice: Any, expected: ToolChoice) -> None:
    req = parse_tools({"tools": TOOLS_BODY, "tool_choice": choice, "parallel_tool_calls": False})
    assert req is not None
    assert req.choice == expected
    assert req.parallel is False


def test_schema_field_names_what_a_grammar_error_is_about() -> None:
    search = {"type": "function", "function": {"name": "search"}}
    named = parse_tools({"tools": TOOLS_BODY, "tool_choice": search})
    required = parse_tools({"tools": TOOLS_BODY, "tool_choice": "required"})
    functions = [t["function"] for t in TOOLS_BODY]
    legacy = parse_tools({"functions": functions, "function_call": {"name": "search"}})
    assert named is not None and required is not None and legacy is not None
    assert named.schema_field == "tools[1].function.parameters"
    assert required.schema_field == "tools"
    assert legacy.schema_field == "functions[1].parameters"


def test_legacy_functions_map_onto_tools() -> None:
    functions = [t["function"] for t in TOOLS_BODY]
    req = parse_tools({"functions": functions, "function_call": {"name": "get_weather"}})
    assert req == ToolRequest(TOOLS, ToolChoice("named", "get_weather"), False, legacy=True)
    req = parse_tools({"functions": functions})
    assert req is not None
    assert (req.choice, req.parallel) == (ToolChoice("auto"), False)
    none = parse_tools({"functions": functions, "function_call": "none"})
    assert none is not None
    assert none.choice == ToolChoice("none")


MANY = [fn(f"f{i}") for i in range(MAX_TOOLS + 1)]
BAD_REQUESTS = [
    ({"tools": {"a": 1}}, "tools", "must be an array"),
    ({"tools": "get_weather"}, "tools", "must be an array"),
    ({"tools": MANY}, "tools", f"has {MAX_TOOLS + 1} entries; the limit is {MAX_TOOLS}"),
    ({"tools": ["get_weather"]}, "tools[0]", "must be an object"),
    ({"tools": [TOOLS_BODY[0], {"type": "retrieval"}]}, "tools[1].type", "'function'"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "function object"),
    ({"tools": [fn("get weather")]}, "tools[0].function.name", "1 to 64 characters"),
    ({"tools": [fn("x" * 65)]}, "tools[0].function.name", "1 to 64 characters"),
    ({"tools": [fn("")]}, "tools[0].function.name", "1 to 64 characters"),
    ({"tools": [fn("ok\n")]}, "tools[0].function.name", "1 to 64 characters"),
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name", "3"),
    (
        {"tools": [*TOOLS_BODY, fn("get_weather")]},
        "tools[2].function.name",
        "'get_weather' is already the name of tools[0]",
    ),
    ({"tools": [fn("f", [1])]}, "tools[0].function.parameters", "must be a JSON object"),
    ({"tools": [fn("f", "{}")]}, "tools[0].function.parameters", "must be a JSON object"),
    ({"tools": [fn("f", {"type": "array"})]}, "tools[0].function.parameters.type", "'object'"),
    ({"tools": [fn("f", description=7)]}, "tools[0].function.description", "must be a string"),
    ({"tools": TOOLS_BODY, "tool_choice": "always"}, "tool_choice", "'required'"),
    ({"tools": TOOLS_BODY, "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tools": TOOLS_BODY, "tool_choice": {"name": "search"}}, "tool_choice", "must be"),
    ({"tools": TOOLS_BODY, "tool_choice": 1}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "is 'required' but the request has no tools"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "has no tools"),
    (
        {"tool_choice": {"type": "function", "function": {"name": "search"}}},
        "tool_choice",
        "names the function 'search' but the request has no tools",
    ),
    (
        {"tools": TOOLS_BODY, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "'nope', which is not in tools (known: get_weather, search)",
    ),
    ({"tools": TOOLS_BODY, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls", "boolean"),
    ({"functions": {}}, "functions", "must be an array"),
    ({"functions": [{"name": "a b"}]}, "functions[0].name", "1 to 64 characters"),
    ({"functions": [{"name": "a", "parameters": []}]}, "functions[0].parameters", "JSON object"),
    ({"functions": [{"name": "a"}], "function_call": "required"}, "function_call", "must be"),
    (
        {"functions": [{"name": "a"}], "function_call": {"name": "b"}},
        "function_call",
        "not in functions (known: a)",
    ),
    ({"tools": TOOLS_BODY, "functions": [{"name": "a"}]}, "functions", "cannot be combined"),
    ({"tool_choice": "auto", "function_call": "auto"}, "function_call", "cannot be combined"),
]


@pytest.mark.parametrize(("body", "param", "says"), BAD_REQUESTS)
def test_bad_tool_requests_name_the_field(body: dict[str, Any], param: str, says: str) -> None:
    error = rejected(body)
    assert error.status == 400
    assert error.param == param
    assert error.message.startswith(f"{param}: ")
    assert says in error.message


def test_long_bad_values_are_shortened_in_errors() -> None:
    error = rejected({"tools": [fn("x" * 10_000)]})
    assert len(error.message) < 200


# -- validate_history -------------------------------------------------------------------------


def call(
    name: Any = "get_weather", arguments: Any = '{"city": "Paris"}', id: str = "call_1"
) -> Any:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [call()]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    {"role": "user", "content": "Thanks"},
]


def test_valid_history_passes() -> None:
    validate_history(HISTORY)
    validate_history([{"role": "assistant", "content": "hi", "tool_calls": None}])


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "21"}, "messages[1].tool_call_id"),
        ({"role": "tool", "content": "21", "tool_call_id": 1}, "messages[1].tool_call_id"),
        ({"role": "assistant", "content": "", "tool_calls": call()}, "messages[1].tool_calls"),
        ({"role": "assistant", "content": "", "tool_calls": ["x"]}, "messages[1].tool_calls[0]"),
        (
            {"role": "assistant", "content": "", "tool_calls": [call(), {**call(), "id": 5}]},
            "messages[1].tool_calls[1].id",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{**call(), "type": "code"}]},
            "messages[1].tool_calls[0].type",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function"}]},
            "messages[1].tool_calls[0].function",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [call(name=None)]},
            "messages[1].tool_calls[0].function.name",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [call(arguments={"a": 1})]},
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_history_names_the_field(message: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        validate_history([{"role": "user", "content": "hi"}, message])
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(f"{param}: ")


# -- The prompt -------------------------------------------------------------------------------

LLAMA_31_LIKE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if tools is not none and not tools_in_user_message %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- for t in tools %}
    {{- t | tojson(indent=4) }}
{%- endfor %}
"""
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    ("source", "reads"),
    [
        (LLAMA_31_LIKE, True),
        ("{%- if tools %}{{ tools | tojson }}{% endif %}", True),
        ("{% for tool in tools -%}{{ tool.function.name }}{% endfor %}", True),
        (SMOLLM2, False),
        ("You can use tools. {{ messages[0]['content'] }}", False),  # text, not a variable
        ("{# tools are not supported #}{{ messages }}", False),  # a comment
        ("{{ 'tools' }}{{ \"no tools\" }}", False),  # string literals
        ("{{ custom_tools }}{{ message.tools }}{{ tools_in_user_message }}", False),
    ],
)
def test_has_tools_variable(source: str, reads: bool) -> None:
    assert has_tools_variable(source) is reads


def test_default_system_prompt_lists_the_tools_and_the_format() -> None:
    text = default_system_prompt(TOOLS, parallel=True)
    for tool in TOOLS:
        assert tool.name in text
        assert json.dumps(tool.parameters) in text
    assert "Current weather" in text
    assert (
        '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
        in (text)
    )
    assert "several" in text
    single = default_system_prompt(TOOLS, parallel=False)
    assert "at most one" in single
    assert "several" not in single


def test_render_for_a_template_with_tools() -> None:
    messages, extra = render_messages(HISTORY, request(), template_has_tools=True)
    assert extra == {"tools": [t.to_openai() for t in TOOLS]}
    assert extra["tools"][0] == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": WEATHER,
        },
    }
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2]["tool_calls"][0]["id"] == "call_1"
    assert messages[3] == HISTORY[3]
    assert messages[:2] == HISTORY[:2]
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # a copy

    # What templates do with them: `arguments | tojson` writes the object, not a string in a string.
    template = jinja2.Environment().from_string(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}"
    )
    assert template.render(messages=messages) == 'get_weather{"city": "Paris"}'


def test_render_for_a_template_with_tools_without_tools_offered() -> None:
    bad = [{"role": "assistant", "content": "", "tool_calls": [call(arguments="{not json")]}]
    for req in (None, request("none")):
        messages, extra = render_messages(bad, req, template_has_tools=True)
        assert extra == {}
        assert messages[0]["tool_calls"][0]["function"]["arguments"] == "{not json"


def test_render_for_a_template_without_tools() -> None:
    messages, extra = render_messages(HISTORY, request(parallel=False), template_has_tools=False)
    assert extra == {}
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n")
    assert system.endswith(default_system_prompt(TOOLS, parallel=False))
    assistant = messages[2]
    assert "tool_calls" not in assistant
    assert assistant["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert messages[3] == {
        "role": "tool",
        "content": '<tool_response>\n{"temp": 21}\n</tool_response>',
        "tool_call_id": "call_1",
    }
    assert messages[4] == HISTORY[4]
    # What the model wrote is what it reads back.
    content, calls = parse_auto(assistant["content"], TOOLS)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_render_without_tools_prepends_a_system_message_and_keeps_content() -> None:
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call(), call("search", "{}")]},
    ]
    messages, _ = render_messages(history, request(), template_has_tools=False)
    assert messages[0] == {"role": "system", "content": default_system_prompt(TOOLS, True)}
    assert messages[2]["content"] == (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    )


def test_render_without_tools_offered_still_renders_past_calls() -> None:
    for req in (None, request("none")):
        messages, extra = render_messages(HISTORY, req, template_has_tools=False)
        assert extra == {}
        assert messages[0] == HISTORY[0]  # no tools described
        assert messages[2]["content"].startswith("<tool_call>\n")
        assert messages[3]["content"].startswith("<tool_response>\n")


# -- The constraint ---------------------------------------------------------------------------


def valid(schema: dict[str, Any], instance: Any) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_named_schema_is_the_parameters() -> None:
    assert constrained_schema(request("named", "get_weather")) == WEATHER
    untyped = ToolRequest([Tool("f", "", {"properties": {}})], ToolChoice("named", "f"), True)
    schema = constrained_schema(untyped)
    assert schema == {"properties": {}, "type": "object"}
    assert not valid(schema, 42)  # a bare schema would let the model answer a number
    assert valid(constrained_schema(request("named", "search")) or {}, {"query": "x"})


def test_auto_and_none_have_no_schema() -> None:
    assert constrained_schema(request("auto")) is None
    assert constrained_schema(request("none")) is None


def test_required_schema_accepts_calls() -> None:
    schema = constrained_schema(request("required"))
    assert schema is not None
    one = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert valid(schema, one)
    assert valid(schema, [*one, {"name": "search", "arguments": {"query": "q"}}])


@pytest.mark.parametrize(
    "output",
    [
        [],
        [{"name": "nope", "arguments": {"city": "Paris"}}],
        [{"name": "get_weather", "arguments": {"city": "Paris"}, "extra": 1}],
        [{"name": "get_weather"}],
        [{"name": "get_weather", "arguments": {"city": 7}}],
        [{"name": "search", "arguments": {"city": "Paris"}}],  # another tool's arguments
        {"name": "get_weather", "arguments": {"city": "Paris"}},  # not in an array
    ],
)
def test_required_schema_rejects(output: Any) -> None:
    assert not valid(constrained_schema(request("required")) or {}, output)


def test_required_schema_without_parallel_calls_takes_one() -> None:
    schema = constrained_schema(request("required", parallel=False))
    assert schema is not None
    assert schema["maxItems"] == 1
    one = {"name": "search", "arguments": {"query": "q"}}
    assert valid(schema, [one])
    assert not valid(schema, [one, one])


# -- parse_constrained ------------------------------------------------------------------------


def test_parse_constrained_named() -> None:
    calls = parse_constrained(
        ' {"city": "Paris", "unit": "celsius"}\n', request("named", "get_weather")
    )
    assert calls is not None
    assert len(calls) == 1
    assert CALL_ID.match(calls[0].id)
    assert (calls[0].name, calls[0].arguments) == (
        "get_weather",
        '{"city": "Paris", "unit": "celsius"}',
    )
    assert calls[0].to_openai() == {
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }


REQUIRED_OUTPUT = json.dumps(
    [
        {"name": "get_weather", "arguments": {"city": 'Pa"ris ]}', "unit": "celsius"}},
        {"name": "search", "arguments": {"query": "a{b[c\\", "tags": [1, [2, {"x": None}]]}},
    ]
)


def test_parse_constrained_required_roundtrip() -> None:
    calls = parse_constrained(REQUIRED_OUTPUT, request("required"))
    assert calls is not None
    expected = json.loads(REQUIRED_OUTPUT)
    assert [c.name for c in calls] == ["get_weather", "search"]
    assert [json.loads(c.arguments) for c in calls] == [e["arguments"] for e in expected]
    # The arguments are the output's own text.
    assert [c.arguments for c in calls] == [json.dumps(e["arguments"]) for e in expected]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize(
    ("text", "req"),
    [
        ('{"city": "Par', request("named", "get_weather")),  # cut short by max_tokens
        ("", request("named", "get_weather")),
        ("[1, 2]", request("named", "get_weather")),
        (REQUIRED_OUTPUT[:-5], request("required")),
        ("[]", request("required")),
        ('[{"name": "nope", "arguments": {}}]', request("required")),
        ('[{"name": "search", "arguments": "{}"}]', request("required")),
        (REQUIRED_OUTPUT, request("required", parallel=False)),
        (REQUIRED_OUTPUT, request("auto")),
    ],
)
def test_parse_constrained_none_when_it_does_not_parse(text: str, req: ToolRequest) -> None:
    assert parse_constrained(text, req) is None


# -- parse_auto -------------------------------------------------------------------------------

PARIS = '{"city": "Paris"}'
BLOCK = f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>'
SEARCH_BLOCK = '<tool_call>\n{"name": "search", "arguments": {"query": "café"}}\n</tool_call>'


def calls_of(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        (BLOCK, None, [("get_weather", {"city": "Paris"})]),
        (
            f"{BLOCK}\n{SEARCH_BLOCK}",
            None,
            [("get_weather", {"city": "Paris"}), ("search", {"query": "café"})],
        ),
        (
            '<tool_call>[{"name": "search", "arguments": {"query": "a"}}, '
            '{"name": "search", "arguments": {"query": "b"}}]</tool_call>',
            None,
            [("search", {"query": "a"}), ("search", {"query": "b"})],
        ),
        (f"Let me check.\n{BLOCK}\n", "Let me check.", [("get_weather", {"city": "Paris"})]),
        (f"{BLOCK} and after", "and after", [("get_weather", {"city": "Paris"})]),
        (  # arguments as JSON text, as some models write them
            '<tool_call>{"name": "get_weather", '
            '"arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (  # the model ended its turn without closing the block
            '<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n',
            None,
            [("search", {"query": "q"})],
        ),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            ' {"name": "get_weather", "arguments": {"city": "Paris"}}; '
            '{"name": "search", "parameters": {"query": "q"}}\n',
            None,
            [("get_weather", {"city": "Paris"}), ("search", {"query": "q"})],
        ),
        (
            '{"type": "function", "name": "search", "parameters": {"query": ";"}};',
            None,
            [("search", {"query": ";"})],
        ),
    ],
)
def test_parse_auto_finds_calls(text: str, content: str | None, expected: list[Any]) -> None:
    got_content, calls = parse_auto(text, TOOLS)
    assert got_content == content
    assert calls_of(calls) == expected
    assert all(CALL_ID.match(c.id) for c in calls)
    assert all(
        c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False) for c in calls
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Just text, no calls.",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par}</tool_call>',  # bad JSON
        f"{BLOCK}<tool_call>not json</tool_call>",  # one bad block spoils them all
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # unknown function
        '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "search", "arguments": "[1]"}</tool_call>',
        '<tool_call>{"name": "search", "arguments": "{bad"}</tool_call>',
        "<tool_call></tool_call>",
        "<tool_call>[]</tool_call>",
        '{"name": "nope", "parameters": {}}',
        '{"answer": 42}',  # JSON that is no call
        '{"name": "search", "parameters": {"query": "q"}} trailing',
        '{"name": "search", "parameters": {"query": "q"}}; {"name": "search"',
        "<|python_tag|>brave_search.call(query='x')",
        "[" * 100_000,  # deeper than Python's recursion limit
        "<tool_call>" + "[" * 100_000 + "</tool_call>",
    ],
)
def test_parse_auto_falls_back_to_content(text: str) -> None:
    assert parse_auto(text, TOOLS) == (text, [])


def test_parse_auto_ignores_unknown_tools_list() -> None:
    assert parse_auto(BLOCK, []) == (BLOCK, [])


# -- ToolCallStream ---------------------------------------------------------------------------


def stream(req: ToolRequest, chunks: list[str]) -> tuple[str, list[tuple[str, str]], bool]:
    """Feed the chunks; the joined content, the calls (name, joined arguments) and the flag,
    checking each delta's shape on the way."""
    s = ToolCallStream(req, req.tools)
    deltas = [d for chunk in chunks for d in s.feed(chunk)]
    rest, emitted = s.finish()
    content: list[str] = []
    calls: list[list[str]] = []
    for d in [*deltas, *rest]:
        if "content" in d:
            assert d.keys() == {"content"}
            assert d["content"]
            content.append(d["content"])
            continue
        assert d.keys() == {"tool_calls"}
        (tc,) = d["tool_calls"]
        if "id" in tc:  # a call's first delta
            assert tc["index"] == len(calls)
            assert CALL_ID.match(tc["id"])
            assert tc["type"] == "function"
            assert tc["function"]["arguments"] == ""
            calls.append([tc["function"]["name"]])
        else:
            assert tc.keys() == {"index", "function"}
            assert tc["function"].keys() == {"arguments"}
            assert tc["index"] == len(calls) - 1  # only the latest call grows
            calls[tc["index"]].append(tc["function"]["arguments"])
    assert emitted == bool(calls)
    return "".join(content), [(c[0], "".join(c[1:])) for c in calls], emitted


def chunkings(text: str, seed: int = 0) -> list[list[str]]:
    """The text whole, split in two at every position, one character at a time, and in random
    chunks."""
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(
    "text",
    ['{"city": "Paris", "unit": "celsius"}', ' \n{"city": "Pa ris\\" }"} \n', '{"city":"x"}'],
)
def test_stream_named(text: str) -> None:
    req = request("named", "get_weather")
    (whole,) = parse_constrained(text, req) or []
    for chunks in chunkings(text):
        assert stream(req, chunks) == ("", [("get_weather", whole.arguments)], True)


def test_stream_named_sends_the_header_first() -> None:
    s = ToolCallStream(request("named", "search"), TOOLS)
    (header,) = s.feed("")
    assert header["tool_calls"][0]["function"] == {"name": "search", "arguments": ""}
    assert s.feed('{"query"') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"query"'}}]}
    ]
    assert s.finish() == ([], True)


@pytest.mark.parametrize(
    "text",
    [
        REQUIRED_OUTPUT,
        json.dumps(json.loads(REQUIRED_OUTPUT), indent=2),  # other whitespace
        '[{"name":"search","arguments":{}}]',
        '[{"name": "se\\u0061rch", "arguments": {"query": "\\u00e9\\n"}}]',  # escapes in the name
        '[{"name": "search", "arguments": {"query": "x"}}, {"name": "get_weather", "arguments": '
        '{"city": "\\\\"}}]',
    ],
)
def test_stream_required(text: str) -> None:
    req = request("required")
    whole = parse_constrained(text, req)
    assert whole is not None
    expected = [(c.name, c.arguments) for c in whole]
    for chunks in chunkings(text):
        assert stream(req, chunks) == ("", expected, True)


def test_stream_required_arguments_before_the_name() -> None:
    # Not what the grammar writes, but the scanner must not lose arguments that come first.
    text = '[{"arguments": {"query": "q"}, "name": "search"}]'
    for chunks in chunkings(text):
        assert stream(request("required"), chunks) == ("", [("search", '{"query": "q"}')], True)


def test_stream_required_streams_arguments_as_they_come() -> None:
    s = ToolCallStream(request("required"), TOOLS)
    assert s.feed('[{"name": "sea') == []
    (header,) = s.feed('rch", "arguments": {"qu')[:1]
    assert header["tool_calls"][0]["function"]["name"] == "search"
    assert s.feed('ery": "x"}}, {"name"') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ery": "x"}'}}]}
    ]


def test_stream_required_cut_short() -> None:
    full = [
        (c.name, c.arguments) for c in parse_constrained(REQUIRED_OUTPUT, request("required")) or []
    ]
    for n in range(len(REQUIRED_OUTPUT)):
        text = REQUIRED_OUTPUT[:n]
        assert parse_constrained(text, request("required")) is None
        _, calls, emitted = stream(request("required"), [text])
        assert emitted == (n >= len('[{"name": "get_weather"'))
        for (name, arguments), (full_name, full_arguments) in zip(calls, full, strict=False):
            assert name == full_name
            assert full_arguments.startswith(arguments)


AUTO_CALLS = [
    BLOCK,
    f"{BLOCK}\n{SEARCH_BLOCK}",
    f"Let me check the weather.\n{BLOCK}",
    f"  {BLOCK}\n\nDone.",
    '<tool_call>[{"name": "search", "arguments": {"query": "<tool_call>"}}]</tool_call>',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '\n<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "search", "arguments": {"query": "q"}}',
]


@pytest.mark.parametrize("text", AUTO_CALLS)
def test_stream_auto_calls(text: str) -> None:
    content, calls = parse_auto(text, TOOLS)
    assert calls
    expected = [(c.name, c.arguments) for c in calls]
    for chunks in chunkings(text):
        got_content, got_calls, emitted = stream(request(), chunks)
        assert (got_calls, emitted) == (expected, True)
        # The text before the first call streams as it comes: only whitespace may differ.
        assert got_content.split() == (content or "").split()


AUTO_TEXT = [
    "",
    "Hello!",
    "   ",
    "The answer is {42}.",
    "Use <b>bold</b> or <tool> tags, or <tool_calls>, or <|python_tag|> mid-text.",
    "a <tool_c",  # ends in what could have started a call
    "<tool_call",
    "<|python",
    '{"answer": 42}',  # JSON, but no call
    '<|python_tag|>{"name": "nope", "parameters": {}}',
    f"Almost: {BLOCK[:-3]}<tool_call>[1]</tool_call>",  # a malformed block
    '<tool_call>{"name": "search", "arguments": {"query": "unterminated',
]


@pytest.mark.parametrize("text", AUTO_TEXT)
def test_stream_auto_text_comes_out_unchanged(text: str) -> None:
    assert parse_auto(text, TOOLS) == (text, [])
    for chunks in chunkings(text):
        assert stream(request(), chunks) == (text, [], False)


def test_stream_auto_holds_back_only_what_could_start_a_call() -> None:
    s = ToolCallStream(request(), TOOLS)
    assert s.feed("Hi <tool") == [{"content": "Hi "}]
    assert s.feed("s> and {") == [{"content": "<tools> and {"}]
    assert s.feed(" <tool_c") == [{"content": " "}]
    assert s.feed("all>") == []  # a call: buffered until the end
    assert s.feed('{"name": "search", "arguments": {"query": "q"}}</tool_call>') == []
    rest, emitted = s.finish()
    assert emitted
    assert [d["tool_calls"][0]["function"] for d in rest] == [
        {"name": "search", "arguments": ""},
        {"arguments": '{"query": "q"}'},
    ]


def test_stream_auto_holds_a_leading_brace_or_whitespace() -> None:
    s = ToolCallStream(request(), TOOLS)
    assert s.feed("\n ") == []  # could precede a Llama call
    assert s.feed("{") == []
    assert s.feed('"x": 1}') == []
    assert s.finish() == ([{"content": '\n {"x": 1}'}], False)
    s = ToolCallStream(request(), TOOLS)
    assert s.feed("\n") == []
    assert s.feed("Hi") == [{"content": "\nHi"}]


def test_stream_none_is_plain_text() -> None:
    for chunks in chunkings(BLOCK):
        assert stream(request("none"), chunks) == (BLOCK, [], False)


# -- the tokenizer renders tools through a template's own `tools` variable ----------------------

TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
    "{% endfor %}</{{ m.role }}>{% endfor %}"
)


def test_templates_with_a_tools_variable_receive_the_tools(tiny_model_dir) -> None:
    from controlplane.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    tok.chat_template, tok._compiled_template = TOOLS_TEMPLATE, None
    req = parse_tools({"tools": [fn("get_weather", WEATHER)], "tool_choice": "auto"})
    history = [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
    ]
    messages, extra = render_messages(history, req, has_tools_variable(tok.chat_template))
    for escape in (True, False):
        ids = tok.encode_chat(messages, False, escape=escape, **extra)
        text = tok.decode(ids)
        # The template read the tools and the decoded arguments (an object, as HF templates
        # expect); no default-format system message was added.
        assert text.startswith("<tools>get_weather;</tools><user>Paris?</user>"), text
        assert "[call get_weather Paris]" in text and "# Tools" not in text
