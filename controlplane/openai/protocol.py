"""OpenAI request parsing and response shapes.

A body is first decoded into its typed struct (controlplane.openai.bodies: msgspec checks
every field's type natively, in one pass); the rest is by hand, because no schema library
says it the API's way: every error names the offending field the way OpenAI's API does
(`param`) and says the limit, the unions (`prompt`, `stop`, `messages`, the output
constraints, the tools) and the rules across fields. A body the struct refuses is read again
here from scratch (`_opt` checks each type), so its error is the one it always was.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from controlplane.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from controlplane.engine.structured import StructuredOutput
from controlplane.errors import FieldError
from controlplane.http.body import check_json, load_json
from controlplane.http.errors import invalid
from controlplane.openai.bodies import ChatBody, Checked, CompletionBody, decode
from controlplane.openai.schema import (
    CHAT_FIELDS,
    CHAT_ROLES,
    COMPLETION_FIELDS,
    MAX_CACHE_SALT_CHARS,
    MAX_USER_CHARS,
)
from controlplane.openai.tools import (
    ToolRequest,
    constrained_schema,
    parse_tools,
    validate_history,
)

# A JSON schema sent as a string (guided_json, response_format.json_schema.schema,
# structured_outputs.json) is parsed apart from the body: its own bound, serde_json's default
# recursion limit (what llguidance parses it with). Deeper is a 400 naming the field.
MAX_SCHEMA_DEPTH = 128

Prompt = str | list[int]  # text, or token ids


@dataclass(slots=True, kw_only=True)
class OpenAIRequest:
    """What a parsed /v1 request of either endpoint carries."""

    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    # stream_options.continuous_usage_stats (with include_usage): usage on every chunk
    continuous_usage: bool = False
    user: str | None = None  # OpenAI's end-user id (None: not sent, or empty)
    n: int = 1  # choices returned per prompt (see CompletionRequest.best_of)
    ignored_fields: tuple[str, ...] = ()  # top-level fields this endpoint does not read
    cache_salt: str | None = None  # vLLM's cache_salt (the server adds the API key's part)

    @property
    def structured(self) -> StructuredOutput | None:
        return self.params.structured


@dataclass(slots=True, kw_only=True)
class CompletionRequest(OpenAIRequest):
    # One engine request (and one choice per `n`, and one row) per prompt, in order.
    prompts: list[Prompt]
    # The engine samples `params.n` choices: best_of when given, of which the best `n` return.
    best_of: int | None = None
    echo: bool = False  # the prompt before each choice's text (and in its logprobs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (top N), per choice


@dataclass(slots=True, kw_only=True)
class ChatRequest(OpenAIRequest):
    messages: list[dict[str, Any]]
    logprobs: bool = False  # chat's boolean logprobs (top_logprobs is in params.logprobs)
    default_max_tokens: bool = False  # no max_tokens: fill the context
    tools: ToolRequest | None = None  # the tools offered, tool_choice, parallel calls
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs of the rendered prompt


def _type(name: str, value: Any, types: tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) and bool not in types:
        raise invalid(name, f"must be {what}, got {value!r}")
    if not isinstance(value, types):
        raise invalid(name, f"must be {what}, got {type(value).__name__}")
    return value


def _opt(body: dict[str, Any], name: str, types: tuple[type, ...], what: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if type(body) is Checked:  # msgspec has checked it against the struct's (same) type
        return value
    return _type(name, value, types, what)


def _schema(value: Any, name: str) -> StructuredOutput:
    if isinstance(value, str):  # vLLM accepts the schema as JSON text too
        try:
            value = json.loads(value)
        except RecursionError:  # nested beyond the interpreter's limit (~1,000 levels)
            raise invalid(name, f"is nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError as exc:
            raise invalid(name, f"is not valid JSON ({exc})") from None
        check_json(value, name, MAX_SCHEMA_DEPTH)
    if not isinstance(value, dict | bool):
        raise invalid(name, "must be a JSON schema (an object)")
    return StructuredOutput.json_schema(value, name)


def _response_format(fmt: Any) -> StructuredOutput | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("response_format", "must be an object with a `type`")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "", "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid(
                "response_format.json_schema", "must be an object with `name` and `schema`"
            )
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid("response_format.json_schema.name", "must be a string")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid("response_format.json_schema.strict", "must be a boolean")
        if "schema" not in spec:
            raise invalid("response_format.json_schema.schema", "is required (a JSON schema)")
        return _schema(spec["schema"], "response_format.json_schema.schema")
    raise invalid("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _vllm_structured(name: str, kind: str, value: Any) -> StructuredOutput:
    """vLLM's guided_* fields and the members of its `structured_outputs` object."""
    if kind == "json":
        return _schema(value, name)
    if kind == "json_object":
        if value is not True:
            raise invalid(name, "must be true")
        return StructuredOutput("json_object", "", name)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise invalid(name, "must be a non-empty array of non-empty strings")
        return StructuredOutput("choice", json.dumps(value), name)
    if not isinstance(value, str) or not value:
        raise invalid(name, "must be a non-empty string")
    return StructuredOutput("regex" if kind == "regex" else "grammar", value, name)


_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """The request's output constraint: `response_format`, vLLM's `guided_json` /
    `guided_regex` / `guided_choice` / `guided_grammar`, or its `structured_outputs` object
    (one kind). At most one of them may constrain the request."""
    found: list[StructuredOutput] = []
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        found.append(fmt)
    for kind in ("json", "regex", "choice", "grammar"):
        value = body.get(f"guided_{kind}")
        if value is not None:
            found.append(_vllm_structured(f"guided_{kind}", kind, value))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("structured_outputs", "must be an object")
        given = [k for k in _VLLM_KINDS if so.get(k) not in (None, False)]
        if len(given) != 1:
            raise invalid("structured_outputs", f"must set exactly one of {', '.join(_VLLM_KINDS)}")
        kind = given[0]
        found.append(_vllm_structured(f"structured_outputs.{kind}", kind, so[kind]))
    if len(found) > 1:
        names = " and ".join(f.field for f in found)
        raise invalid(found[1].field, f"only one output constraint per request ({names} given)")
    return found[0] if found else None


def _prompt_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's `prompt_logprobs`: the top N alternatives of each prompt token, 0 to MAX_LOGPROBS."""
    return _opt(body, "prompt_logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]", None)


def _sampling(
    body: dict[str, Any],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    num = (int, float)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise invalid("stop", "must be a string or an array of strings")
    n = _opt(body, "n", (int,), "an integer", 1)
    if n < 1:
        raise invalid("n", f"must be at least 1, got {n}")
    if body.get("logit_bias"):
        raise invalid("logit_bias", "is not supported")
    stop_ids = _opt(body, "stop_token_ids", (list,), "an array of token ids", [])
    try:
        return SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens,
            n=n,
            temperature=float(_opt(body, "temperature", num, "a number", 1.0)),
            top_p=float(_opt(body, "top_p", num, "a number", 1.0)),
            top_k=_opt(body, "top_k", (int,), "an integer", 0),
            min_p=float(_opt(body, "min_p", num, "a number", 0.0)),
            repetition_penalty=float(_opt(body, "repetition_penalty", num, "a number", 1.0)),
            presence_penalty=float(_opt(body, "presence_penalty", num, "a number", 0.0)),
            frequency_penalty=float(_opt(body, "frequency_penalty", num, "a number", 0.0)),
            seed=_opt(body, "seed", (int,), "an integer", None),
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=_opt(body, "ignore_eos", (bool,), "a boolean", False),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=_opt(body, "skip_special_tokens", (bool,), "a boolean", True),
            structured=structured_output(body),
            priority=_opt(body, "priority", (int,), "an integer", 0),
        )
    except FieldError as exc:
        raise invalid(exc.field, exc.message) from None


@dataclass(frozen=True, slots=True)
class _Common:
    """What both endpoints read the same way."""

    model: str
    stream: bool
    include_usage: bool
    user: str | None
    ignored: tuple[str, ...]
    continuous_usage: bool = False


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's `cache_salt`: a non-empty string of at most MAX_CACHE_SALT_CHARS characters."""
    salt = _opt(body, "cache_salt", (str,), "a string", None)
    if salt is None:
        return None
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise invalid(
            "cache_salt",
            f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
            f"got {len(salt)}",
        )
    return salt


def _user(body: dict[str, Any]) -> str | None:
    user = _opt(body, "user", (str,), "a string", None)
    if user is None or user == "":
        return None
    if len(user) > MAX_USER_CHARS:
        raise invalid("user", f"is {len(user)} characters long; the limit is {MAX_USER_CHARS}")
    if "\x00" in user:  # PostgreSQL text cannot hold NUL: the row would be refused
        raise invalid("user", "must not contain NUL characters")
    return user


def _common(body: Any, allowed: set[str]) -> _Common:
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required (a string; see GET /v1/models)")
    stream = _opt(body, "stream", (bool,), "a boolean", False)
    options = _opt(body, "stream_options", (dict,), "an object", {})
    if options and not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    include_usage = _type(
        "stream_options.include_usage", options.get("include_usage", False), (bool,), "a boolean"
    )
    # vLLM's continuous_usage_stats: usage on every chunk, only together with include_usage.
    continuous = _type(
        "stream_options.continuous_usage_stats",
        options.get("continuous_usage_stats", False),
        (bool,),
        "a boolean",
    )
    ignored = tuple(key for key in body if key not in allowed)
    return _Common(model, stream, include_usage, _user(body), ignored, include_usage and continuous)


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _prompts(prompt: Any) -> list[Prompt]:
    """`prompt` as a list of prompts: a string, token ids, or a non-empty list of either (all
    of one kind, as OpenAI's API defines it)."""
    what = (
        "must be a non-empty string, an array of token ids, or a non-empty array of either "
        "(one choice per prompt)"
    )
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", what)
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt", what)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]  # one prompt of token ids
    kind = str if isinstance(prompt[0], str) else list
    for i, p in enumerate(prompt):
        if kind is str and not (isinstance(p, str) and p):
            raise invalid(f"prompt[{i}]", "must be a non-empty string, like prompt[0]")
        if kind is list and not _is_token_ids(p):
            raise invalid(f"prompt[{i}]", "must be a non-empty array of token ids")
    return list(prompt)


def parse_completion_bytes(raw: bytes) -> CompletionRequest:
    """A /v1/completions body as it came: the typed struct's pass, or the hand parser's."""
    body = decode(raw, CompletionBody)
    return parse_completion(load_json(raw) if body is None else body)


def parse_chat_bytes(raw: bytes) -> ChatRequest:
    """A /v1/chat/completions body as it came: the typed struct's pass, or the hand parser's."""
    body = decode(raw, ChatBody)
    return parse_chat(load_json(raw) if body is None else body)


def parse_completion(body: Any) -> CompletionRequest:
    common = _common(body, COMPLETION_FIELDS)
    prompts = _prompts(body.get("prompt"))
    echo = _opt(body, "echo", (bool,), "a boolean", False)
    if body.get("suffix"):
        raise invalid("suffix", "is not supported")
    max_tokens = _opt(body, "max_tokens", (int,), "an integer", None)
    if max_tokens == 0 and not echo:
        raise invalid(
            "max_tokens",
            "must be >= 1 (0 only with echo: true, to score the prompt without generating)",
        )
    logprobs = _opt(body, "logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]", None)
    prompt_lp = _prompt_logprobs(body)
    # What the engine scores: echo's logprobs over the prompt, vLLM's prompt_logprobs, the
    # larger top N of the two; echo with max_tokens 0 scores (top 0) even without logprobs.
    wanted = [v for v in (logprobs if echo else None, prompt_lp) if v is not None]
    engine_lp = max(wanted) if wanted else (0 if max_tokens == 0 else None)
    params = _sampling(body, max_tokens, logprobs, engine_lp)
    n = params.n
    best_of = _opt(body, "best_of", (int,), "an integer", None)
    if best_of is not None:
        if best_of < n:
            raise invalid("best_of", f"must be at least n ({n}), got {best_of}")
        if best_of > 1 and common.stream:
            # OpenAI's rule: which choices are best is known only once all have finished.
            raise invalid("best_of", "cannot be used with stream: true")
        try:  # best_of choices are sampled as n: the engine's bound on n is best_of's
            params = dataclasses.replace(params, n=best_of)
        except FieldError as exc:
            raise invalid("best_of", exc.message) from None
    return CompletionRequest(
        model=common.model,
        params=params,
        stream=common.stream,
        include_usage=common.include_usage,
        continuous_usage=common.continuous_usage,
        prompts=prompts,
        user=common.user,
        n=n,
        best_of=best_of,
        ignored_fields=common.ignored,
        cache_salt=_cache_salt(body),
        echo=echo,
        prompt_logprobs=prompt_lp,
    )


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat body's `messages`, text parts joined, the conversation checked (400 naming the
    field): what /v1/chat/completions and POST /tokenize render with the chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty array")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            got = f", got {m.get('role')!r}" if isinstance(m, dict) and "role" in m else ""
            raise invalid(
                f"messages[{i}].role", f"is required: one of {', '.join(CHAT_ROLES)}{got}"
            )
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise invalid(f"messages[{i}].content[{j}]", "only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise invalid(f"messages[{i}].content", "must be a string or an array of text parts")
        parsed.append({**m, "content": content})
    validate_history(parsed)
    return parsed


def parse_chat(body: Any) -> ChatRequest:
    common = _common(body, CHAT_FIELDS)
    parsed = parse_messages(body)
    tools = parse_tools(body)
    mt = _opt(body, "max_completion_tokens", (int,), "an integer", None)
    if mt is None:
        mt = _opt(body, "max_tokens", (int,), "an integer", None)
    want = _opt(body, "logprobs", (bool,), "a boolean", False)
    top = _opt(body, "top_logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]", None)
    if top is not None and not want:
        raise invalid("top_logprobs", "requires logprobs: true")
    if mt == 0:
        raise invalid("max_tokens", "must be >= 1")
    prompt_lp = _prompt_logprobs(body)
    params = _sampling(body, mt, (top or 0) if want else None, prompt_lp)
    schema = constrained_schema(tools) if tools is not None else None
    if schema is not None:
        if params.structured is not None:
            raise invalid(
                params.structured.field,
                f"cannot be combined with tool_choice {tools.choice.mode!r} (the output is "
                "constrained to the tool call)",
            )
        params = dataclasses.replace(
            params, structured=StructuredOutput.json_schema(schema, tools.schema_field)
        )
    return ChatRequest(
        model=common.model,
        params=params,
        stream=common.stream,
        include_usage=common.include_usage,
        continuous_usage=common.continuous_usage,
        messages=parsed,
        logprobs=want,
        default_max_tokens=mt is None,
        user=common.user,
        n=params.n,
        ignored_fields=common.ignored,
        tools=tools,
        cache_salt=_cache_salt(body),
        prompt_logprobs=prompt_lp,
    )


# -- responses ------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now() -> int:
    return int(time.time())
