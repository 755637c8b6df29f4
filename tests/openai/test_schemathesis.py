"""Property-based fuzzing of every documented operation: no input produces a 5xx, and every
4xx is an error in the OpenAI shape (the admin API uses the same shape)."""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from harness import InProcessDaemon

TOKEN = "fuzz-token-0123456789abcdef"
MODEL = "model"  # the tiny demo model's directory name
# Draining is a 503 by design (and would turn every later call into one): not fuzzed here;
# tests/admin/test_admin_api.py covers drain/resume.
SKIP = {("POST", "/admin/drain")}


@pytest.fixture(scope="module")
def fuzz_daemon(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        admin_tokens=[{"name": "fuzz", "token": TOKEN}],
        engine={"max_model_len": 256},
    )


def test_no_operation_returns_5xx(fuzz_daemon):
    d = fuzz_daemon
    schema = schemathesis.openapi.from_url(d.url + "/schema/openapi.json")
    checked = []
    for result in schema.get_all_operations():
        op = result.ok()
        if (op.method.upper(), op.path) in SKIP:
            continue
        _fuzz(op, d.url, schemathesis.GenerationMode.POSITIVE)()
        checked.append((op.method.upper(), op.path))
    assert ("PATCH", "/admin/config") in checked and ("POST", "/v1/completions") in checked
    assert len(checked) >= 12


def test_v1_schemas_document_every_field_the_parser_reads():
    # The accepted-field sets are the schemas' properties (controlplane.openai.schema), so a
    # field the hand parser reads must be in a schema, or requests would report it ignored.
    import ast
    from pathlib import Path

    from controlplane.openai import schema

    root = Path(schema.__file__).parent
    read: set[str] = set()
    for path in (root / "protocol.py", *sorted((root / "tools").glob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            fn, first = node.func, node.args[0]
            if isinstance(fn, ast.Name) and fn.id == "_opt" and len(node.args) > 1:
                first = node.args[1]  # _opt(body, "name", ...)
            elif not (
                isinstance(fn, ast.Attribute)
                and fn.attr == "get"
                and isinstance(fn.value, ast.Name)
                and fn.value.id == "body"
            ):
                continue
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                read.add(first.value)
    assert {"prompt", "messages", "tools", "max_completion_tokens", "cache_salt"} <= read
    assert read - (schema.COMPLETION_FIELDS | schema.CHAT_FIELDS) == set()
    assert set(schema.COMPLETION_SCHEMA["properties"]) == schema.COMPLETION_FIELDS


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_v1_bodies_valid_and_invalid_never_5xx(fuzz_daemon, path):
    """The /v1 request bodies are documented in the schema, so both schema-valid bodies (which
    reach the tokenizer and the engine) and schema-violating ones are generated."""
    d = fuzz_daemon
    schema = schemathesis.openapi.from_url(d.url + "/schema/openapi.json")
    op = schema[path]["POST"]
    body = op.definition.raw["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["model", "prompt" if path == "/v1/completions" else "messages"]
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
        _fuzz(op, d.url, mode)()


def _fuzz(op, base_url: str, mode):
    @settings(
        max_examples=30,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    def check(case) -> None:
        if op.path.startswith("/v1/") and isinstance(case.body, dict):
            # The served model, so that requests get past the model check into the engine.
            case.body["model"] = MODEL
        # /admin/events never ends by itself: the timeout ends it (schemathesis returns what
        # arrived).
        timeout = 5 if op.path == "/admin/events" else 60
        response = case.call(
            base_url=base_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=timeout
        )
        context = (op.method, op.path, case.body, response.status_code, response.text[:500])
        assert response.status_code < 500, context
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, context
            assert isinstance(error["message"], str) and error["message"], context

    return check
