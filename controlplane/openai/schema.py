"""The /v1 request bodies as JSON Schema: the OpenAPI documentation, what schemathesis fuzzes,
and the one list of the fields each endpoint reads (COMPLETION_FIELDS, CHAT_FIELDS, derived from
the schemas). The schemas document; the parser (controlplane.openai.bodies' structs, then
controlplane.openai.protocol's rules) decides, so that every error names its field the way
OpenAI's API does.
"""

from __future__ import annotations

from typing import Any

from controlplane.store.records import MAX_END_USER_CHARS

# OpenAI's `user` (an end-user id) is stored in the request row (requests.end_user), whose
# column holds this many characters.
MAX_USER_CHARS = MAX_END_USER_CHARS
# vLLM's `cache_salt`: the request's prefix-cache partition (hashed, never stored).
MAX_CACHE_SALT_CHARS = 256

_NUMBER = {"type": "number"}
_INT = {"type": "integer"}
_COMMON_SCHEMA: dict[str, Any] = {
    "model": {"type": "string", "description": "the served model's id (GET /v1/models)"},
    "max_tokens": _INT,
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": _INT,
    "min_p": _NUMBER,
    "n": _INT,
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {
            "include_usage": {"type": "boolean"},
            "continuous_usage_stats": {
                "type": "boolean",
                "description": "vLLM: with include_usage, usage (tokens so far) on every chunk",
            },
        },
    },
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "seed": _INT,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "repetition_penalty": _NUMBER,
    "ignore_eos": {"type": "boolean"},
    "stop_token_ids": {"type": "array", "items": _INT},
    "skip_special_tokens": {"type": "boolean"},
    "user": {
        "type": "string",
        "maxLength": MAX_USER_CHARS,
        "description": "end-user id, stored in the request row (reports group by it)",
    },
    "logit_bias": {"type": "object", "description": "not supported: must be empty"},
    "response_format": {
        "type": "object",
        "description": "text, json_object, or json_schema ({name, schema, strict}): the output "
        "is constrained to the schema (strict or not)",
    },
    "guided_json": {"description": "vLLM: a JSON schema the output must match"},
    "guided_regex": {"type": "string", "description": "vLLM: a regex the output must match"},
    "guided_choice": {"type": "array", "items": {"type": "string"}},
    "guided_grammar": {"type": "string", "description": "vLLM: a Lark or GBNF grammar"},
    "guided_decoding_backend": {"type": "string", "description": "vLLM: accepted, ignored"},
    "structured_outputs": {
        "type": "object",
        "description": "vLLM's newer form: one of json, regex, choice, grammar, json_object",
    },
    "prompt_logprobs": {
        "type": "integer",
        "description": "vLLM: logprob of every prompt token (null for the first) with the top "
        "N alternatives, per choice; at most server.max_prompt_logprobs_tokens prompt tokens",
    },
    "priority": {
        "type": "integer",
        "description": "vLLM: lower runs sooner, under engine.scheduling_policy priority or "
        "fair (within the API key's priority class; ignored under fcfs)",
    },
    "cache_salt": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_CACHE_SALT_CHARS,
        "description": "vLLM: only requests with the same salt (and, with API keys, the same "
        "key unless engine.prefix_cache_isolation is none) share cached prefixes",
    },
}
_PROMPT_TEXT = {"type": "string", "minLength": 1}
_PROMPT_IDS = {"type": "array", "items": _INT, "minItems": 1}
# Fields not listed here are ignored (not refused): additionalProperties stays open.
COMPLETION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_COMMON_SCHEMA,
        "prompt": {
            "description": "one prompt (text or token ids), or a list of them: one choice each",
            "oneOf": [
                _PROMPT_TEXT,
                _PROMPT_IDS,
                {"type": "array", "items": _PROMPT_TEXT, "minItems": 1},
                {"type": "array", "items": _PROMPT_IDS, "minItems": 1},
            ],
        },
        "logprobs": _INT,
        "echo": {
            "type": "boolean",
            "description": "the prompt before each choice's text, and its tokens in logprobs "
            "(scored; with max_tokens 0, scored without generating)",
        },
        # Accepted for compatibility; only its default is supported (else a 400).
        "suffix": {"type": "string"},
        "best_of": _INT,
    },
}
# The message roles of OpenAI's chat API ("function": the deprecated tool result).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
CHAT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_COMMON_SCHEMA,
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"enum": list(CHAT_ROLES)},
                    "content": {
                        "oneOf": [
                            {"type": "string"},
                            {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        "type": {"enum": ["text"]},
                                        "text": {"type": "string"},
                                    },
                                },
                            },
                        ]
                    },
                },
            },
        },
        "max_completion_tokens": _INT,
        "logprobs": {"type": "boolean"},
        "top_logprobs": _INT,
        "tools": {"type": "array", "description": "functions the model may call"},
        "tool_choice": {},
        "functions": {"type": "array"},
        "function_call": {},
        "parallel_tool_calls": {"type": "boolean"},
        "metadata": {"type": "object"},
        "store": {"type": "boolean"},
        "service_tier": {"type": "string"},
        "modalities": {"type": "array"},
    },
}


# The fields each endpoint reads (or accepts at their default only, with a 400 naming the field
# otherwise). Any other field is ignored, as vLLM does (see `OpenAIRequest.ignored_fields`):
# clients such as the openai library's parse() helpers, LangChain and LiteLLM send fields a
# server may not use.
COMPLETION_FIELDS = frozenset(COMPLETION_SCHEMA["properties"])
CHAT_FIELDS = frozenset(CHAT_SCHEMA["properties"])
