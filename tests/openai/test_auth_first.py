"""Issue 24, defect 6: with API keys configured, the key is checked before anything else on
every /v1 route (nothing about an anonymous request is parsed, validated or counted), and a JSON
schema sent as a deeply nested string is a 400 naming its field, never a RecursionError (500)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.http.errors import APIError
from controlplane.openai import protocol
from harness import InProcessDaemon
from tests.admin.test_admin_api import MODEL

KEY = "sk-tenant-a-0123456789"
IGNORED = "controlplane:ignored_request_fields_total"


@pytest.fixture(scope="module")
def daemon(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        admin=True,
        engine={"max_num_seqs": 4, "max_model_len": 512},
        api_keys=[{"name": "tenant-a", "key": KEY}],
    )


def ignored_samples(c: httpx.Client) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            if s.name == IGNORED:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def nested_schema(levels: int) -> str:
    """A JSON schema, as text, of `levels` nested objects (2 JSON levels each)."""
    return '{"type":"object","properties":{"a":' * levels + "{}" + "}}" * levels


def deep_list(levels: int) -> str:
    return "[" * levels + "]" * levels


def structured_bodies(schema: str) -> dict[str, dict]:
    """A chat body carrying `schema` in each of the three fields that take a schema as text."""
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {
        "guided_json": {**base, "guided_json": schema},
        "response_format.json_schema.schema": {
            **base,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        },
        "structured_outputs.json": {**base, "structured_outputs": {"json": schema}},
    }


# Bodies that an authenticated caller gets a 400 for: an anonymous one gets 401 for each.
INVALID = {
    "not json": b"{not json",
    "not an object": b"[1, 2]",
    "no prompt": b'{"model": "model"}',
    "n over the limit": b'{"model": "model", "prompt": "x", "n": 100000}',
    "deep body": ('{"model": "model", "prompt": ' + deep_list(1000) + "}").encode(),
    "deeper body": deep_list(100_000).encode(),
    "bad cache_salt": b'{"model": "model", "prompt": "x", "cache_salt": 5}',
}


@pytest.mark.parametrize("name", list(INVALID))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_anonymous_invalid_body_is_401_not_400(daemon, name, path):
    body = INVALID[name]
    with daemon.client() as anon, daemon.client("sk-wrong") as wrong:
        for c in (anon, wrong):
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 401, (name, r.status_code, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert "x-request-id" in r.headers
    if path == "/v1/completions":
        with daemon.client(KEY) as c:  # the same body, authenticated: a 400 (it is invalid)
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (name, r.text)


def test_anonymous_requests_are_not_counted(daemon):
    with daemon.client(KEY) as c, daemon.client() as anon:
        before = ignored_samples(c)
        for i in range(5):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
            body.update({f"anon_{i}_{j}": 1 for j in range(40)})
            assert anon.post("/v1/completions", json=body).status_code == 401
            bad = anon.post("/v1/completions", json=body, headers={"X-Request-Id": "a" * 500})
            assert bad.status_code == 401
        assert ignored_samples(c) == before
        assert not any("anon_" in dict(k).get("field", "") for k in ignored_samples(c))
        # An authenticated request's ignored field is counted, as before.
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "authed_field": 1}
        assert c.post("/v1/completions", json=body).status_code == 200
        assert any(dict(k).get("field") == "authed_field" for k in ignored_samples(c))


def test_models_needs_the_key(daemon):
    with daemon.client() as anon, daemon.client(KEY) as c:
        assert anon.get("/v1/models").status_code == 401
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL


@pytest.mark.parametrize("levels", [1000, 20_000])
def test_deeply_nested_schema_string_is_400_naming_the_field(daemon, levels):
    schema = nested_schema(levels)
    with daemon.client(KEY) as c, daemon.client() as anon:
        for field, body in structured_bodies(schema).items():
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (field, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert error["param"] == field and "nested deeper than" in error["message"]
            assert anon.post("/v1/chat/completions", json=body).status_code == 401
        # The daemon still serves.
        ok = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        assert c.post("/v1/completions", json=ok).status_code == 200


def test_deeply_nested_body_is_400(daemon):
    with daemon.client(KEY) as c:
        for body in (deep_list(1000), deep_list(100_000), '{"prompt": ' + deep_list(5000) + "}"):
            r = c.post(
                "/v1/completions", content=body, headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 400, r.text[:300]
            assert "nested deeper than" in r.json()["error"]["message"]


def test_schema_depth_bound_in_the_parser():
    """A schema string may nest up to MAX_SCHEMA_DEPTH levels (deeper than the body's bound:
    it is parsed on its own); deeper is a 400 naming the field, whatever the depth."""
    ok = nested_schema(protocol.MAX_SCHEMA_DEPTH // 2 - 1)  # 127 levels
    assert protocol.structured_output({"guided_json": ok}).field == "guided_json"
    for levels in (protocol.MAX_SCHEMA_DEPTH // 2, 1000, 50_000):
        for field, body in structured_bodies(nested_schema(levels)).items():
            with pytest.raises(APIError) as err:
                protocol.structured_output(body)
            assert err.value.status == 400 and err.value.param == field


# -- issue 52, item 5: authentication before the body, on every route ---------------------------

# Each kind of route: the fleet-signed ones (the guard verifies a signature over the body), the
# other admin writes (a bearer token only) and /v1 (an API key).
OVER_LIMIT_ROUTES = [
    ("PATCH", "/admin/config"),
    ("POST", "/admin/drain"),
    ("POST", "/admin/resume"),
    ("POST", "/admin/config/save"),
    ("PATCH", "/admin/autopilot"),
    ("POST", "/admin/keys/tenant-a/suspend"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("instance", ["made up", "this daemon's"])
def test_anonymous_over_limit_body_with_made_up_fleet_headers_is_401_not_413(
    daemon, instance, framing
):
    """No credentials, fleet-signature headers that look right (the current time; the
    daemon's own instance id, or another), a body over server.max_body_bytes: 401 on every
    route, never a 413 that tells the limit to whoever asks."""
    import secrets
    import time
    from urllib.parse import quote

    from controlplane.http import signing

    limit = daemon.daemon.cfg.server.max_body_bytes
    body = b"x" * (limit + 1)
    target = daemon.daemon.instance_id if instance == "this daemon's" else "cp-somewhere-else"
    for method, path in OVER_LIMIT_ROUTES:
        headers = {
            signing.INSTANCE_HEADER: quote(target, safe=""),
            signing.TIME_HEADER: f"{time.time():.3f}",
            signing.NONCE_HEADER: secrets.token_hex(16),
            signing.SIGNATURE_HEADER: secrets.token_hex(32),
            "Content-Type": "application/json",
        }
        # chunked: no Content-Length to refuse early by; the limit is met while reading.
        content = body if framing == "content-length" else iter([body[: limit // 2], body])
        r = httpx.request(method, daemon.url + path, content=content, headers=headers, timeout=60)
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        assert str(limit) not in r.text
