"""API keys managed live, through real in-process daemons (tiny model, real HTTP on loopback,
real SQLite and PostgreSQL): /admin/keys create -> authenticate -> rotate -> revoke, the audit
rows, hostile bodies, allowed_models, suspension of a table key, a brute-force loop, and a
revoke on one daemon of a PostgreSQL fleet reaching the other within server.key_refresh_s."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from controlplane.tenants.keys import AuthFailures, hash_secret
from harness import InProcessDaemon, wait_rows
from tests.admin.test_admin_api import MODEL, TOKEN

CONFIG_KEY = {"name": "from-file", "key": "sk-from-file-0123456789"}
REFRESH_S = 0.5


@pytest.fixture(scope="module")
def served(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        admin=True,
        server={"key_refresh_s": REFRESH_S},
        engine={"max_num_seqs": 4, "max_model_len": 256},
        api_keys=[CONFIG_KEY],
    )


def admin(d: InProcessDaemon) -> httpx.Client:
    return d.client(TOKEN)


def models(d: InProcessDaemon, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(d.url + "/v1/models", headers=headers, timeout=30)


def complete(d: InProcessDaemon, key: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    return httpx.post(
        d.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def key_history(c: httpx.Client, name: str) -> list[dict[str, Any]]:
    rows = c.get("/admin/config/history", params={"limit": 1000}).json()["changes"]
    return [r for r in rows if r["field"].split(".")[:2] == ["api_keys", name]]


def test_create_authenticate_rotate_revoke(served):
    d = served
    with admin(d) as c:
        made = c.post("/admin/keys", json={"name": "team-a", "owner": "alice"})
        assert made.status_code == 201, made.text
        secret = made.json()["secret"]
        assert made.json()["prefix"] == secret[:8]
        assert complete(d, secret).status_code == 200  # at once on the daemon that made it
        assert complete(d, CONFIG_KEY["key"]).status_code == 200  # the file's key still works
        listed = {k["name"]: k for k in c.get("/admin/keys").json()["keys"]}
        assert listed["team-a"]["source"] == "table" and listed["from-file"]["source"] == "config"
        assert "secret" not in listed["team-a"] and secret not in json.dumps(listed)

        patched = c.patch("/admin/keys/team-a", json={"requests_per_minute": 120})
        assert patched.status_code == 200, patched.text
        assert patched.json()["limits"]["requests_per_minute"] == 120

        rotated = c.post("/admin/keys/team-a/rotate")
        assert rotated.status_code == 200, rotated.text
        secret2 = rotated.json()["secret"]
        assert models(d, secret).status_code == 401
        assert models(d, secret2).status_code == 200

        revoked = c.post("/admin/keys/team-a/revoke")
        assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
        assert models(d, secret2).status_code == 401
        assert c.post("/admin/keys/team-a/rotate").status_code == 409

        rows = key_history(c, "team-a")
        assert [r["field"] for r in reversed(rows)] == [
            "api_keys.team-a",
            "api_keys.team-a.requests_per_minute",
            "api_keys.team-a.prefix",
            "api_keys.team-a.revoked_at",
        ]
        assert all(r["actor"] == "ops" for r in rows)
        text = json.dumps(rows)
        for s in (secret, secret2):
            assert s not in text and hash_secret(s) not in text
        # The request rows carry the key's name and the hash of its secret, as config keys'.
        assert complete(d, CONFIG_KEY["key"]).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"name": "h1", "requests_per_minute": -5}, 422, "requests_per_minute"),
        ({"name": "h2", "tokens_per_minute": 10**40}, 422, "tokens_per_minute"),
        ({"name": "h3", "max_concurrent": 10**9}, 422, "max_concurrent"),
        ({"name": "h4", "color": "red"}, 422, "color"),
        ({"name": "from-file"}, 409, "name"),
    ],
)
def test_hostile_bodies(served, body, status, param):
    with admin(served) as c:
        r = c.post("/admin/keys", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
        assert param in r.json()["error"]["message"]
        assert body["name"] not in {k["name"] for k in c.get("/admin/keys").json()["keys"]} or (
            body["name"] == "from-file"
        )


def test_nan_budget_duplicate_and_patch_limits(served):
    with admin(served) as c:
        nan = c.post(
            "/admin/keys",
            content=b'{"name": "nan-key", "budget_usd": NaN}',
            headers={"Content-Type": "application/json"},
        )
        assert nan.status_code == 422 and nan.json()["error"]["param"] == "budget_usd"
        assert c.post("/admin/keys", json={"name": "dup"}).status_code == 201
        again = c.post("/admin/keys", json={"name": "dup"})
        assert again.status_code == 409 and again.json()["error"]["param"] == "name"
        bad = c.patch("/admin/keys/dup", json={"max_tokens_per_request": 0})
        assert bad.status_code == 422
        assert "from 1 to" in bad.json()["error"]["message"]
        assert c.patch("/admin/keys/dup", json={"name": "other"}).status_code == 422
        assert c.patch("/admin/keys/nobody", json={"owner": "x"}).status_code == 404
        assert key_history(c, "dup")[0]["field"] == "api_keys.dup"  # only the creation


def test_allowed_models_and_suspension(served):
    d = served
    with admin(d) as c:
        other = c.post("/admin/keys", json={"name": "other-model", "allowed_models": ["gpt-x"]})
        ok = c.post("/admin/keys", json={"name": "this-model", "allowed_models": [MODEL]})
        refused = complete(d, other.json()["secret"])
        assert refused.status_code == 403, refused.text
        err = refused.json()["error"]
        assert err["code"] == "model_not_allowed" and f"`{MODEL}`" in err["message"]
        secret = ok.json()["secret"]
        assert complete(d, secret).status_code == 200
        # server.suspended_keys applies to table keys by name.
        assert c.post("/admin/keys/this-model/suspend").status_code == 200
        assert complete(d, secret).json()["error"]["code"] == "api_key_suspended"
        assert c.post("/admin/keys/this-model/unsuspend").status_code == 200
        assert complete(d, secret).status_code == 200


def test_brute_force_is_rate_limited(served):
    d = served
    with admin(d) as c:
        secret = c.post("/admin/keys", json={"name": "target"}).json()["secret"]
    d.daemon.runtime.auth_failures = AuthFailures()  # the earlier tests' wrong keys forgotten
    statuses = []
    for i in range(30):
        r = models(d, f"cp-guess-{i}")
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert 1 <= int(r.headers["retry-after"]) <= 10
            assert r.json()["error"]["code"] == "too_many_authentication_failures"
    assert statuses[:10] == [401] * 10 and set(statuses[10:]) == {429}
    assert models(d, secret).status_code == 429  # not even the right key is tried
    # Another address is not held back meanwhile: its right key works, its wrong key is a 401.
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30)
    with other:
        for key, status in ((secret, 200), ("cp-guess-other", 401), (secret, 200)):
            r = other.get(d.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == status, r.text
    assert models(d, secret).status_code == 429  # the guessing address still is
    d.daemon.runtime.auth_failures = AuthFailures()  # the next tests' address is clean
    assert models(d, secret).status_code == 200


def test_a_key_revoked_mid_stream_finishes_it_and_an_abort_cuts_it(served):
    """A revoke refuses the key's new requests at once (401); a stream already running goes on
    to its end, its row final (success, its 120 tokens): docs/tenants.md says why. Revoked and
    then aborted (POST /admin/keys/{name}/abort, which works on a revoked key), the stream ends
    at once with finish_reason abort, its row aborted with the tokens it produced."""
    d = served
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with admin(d) as c:
        for name, cut in (("revoked-mid-stream", False), ("revoked-then-aborted", True)):
            secret = c.post("/admin/keys", json={"name": name}).json()["secret"]
            headers = {"Authorization": f"Bearer {secret}"}
            url = d.url + "/v1/completions"
            with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as s:
                assert s.status_code == 200
                lines = (line[5:].strip() for line in s.iter_lines() if line.startswith("data:"))
                first = json.loads(next(lines))
                assert c.post(f"/admin/keys/{name}/revoke").status_code == 200
                live = c.get("/admin/requests", params={"api_key_name": name}).json()["live"]
                assert len(live) == 1, live  # revoked while its stream runs
                assert models(d, secret).status_code == 401  # new requests refused at once
                assert complete(d, secret).status_code == 401
                if cut:
                    aborted = c.post(f"/admin/keys/{name}/abort")
                    assert aborted.status_code == 200 and aborted.json()["aborted"] == 1
                rest = list(lines)
            assert rest[-1] == "[DONE]"  # either way the stream ends in order
            chunks = [json.loads(x) for x in rest[:-1]]
            usage = chunks[-1]["usage"]
            reasons = [ch["finish_reason"] for x in [first, *chunks] for ch in x["choices"]]
            text = "".join(ch["text"] for x in [first, *chunks] for ch in x["choices"])
            (row,) = wait_rows(
                d.daemon.cfg.store_url,
                lambda rs: len(rs) == 1 and rs[0]["status"] != "running",
                where=f"api_key_name = '{name}'",
            )
            assert row["prompt_tokens"] == usage["prompt_tokens"] > 0
            assert row["completion_tokens"] == usage["completion_tokens"]
            assert row["finish_time"] is not None and row["id"] == first["id"]
            if cut:
                assert reasons[-1] == "abort" and row["status"] == "aborted", row
                assert row["error"] == "aborted by admin (ops)"
                assert 0 < row["completion_tokens"] < 120
            else:
                assert reasons[-1] == "length" and row["status"] == "success", row
                assert row["completion_tokens"] == 120 and text
    d.daemon.runtime.auth_failures = AuthFailures()  # the revoked keys' 401s forgotten


def wait_status(d: InProcessDaemon, key: str, status: int, timeout: float) -> float:
    start = time.monotonic()
    while (got := models(d, key).status_code) != status:
        assert time.monotonic() - start < timeout, got
        time.sleep(0.02)
    return time.monotonic() - start


def test_revoke_reaches_the_other_daemon_within_the_refresh(make_daemon, pg_url):
    """Two daemons on one PostgreSQL database: a key made on A works on B after one refresh;
    revoked on A, it stops on B within server.key_refresh_s (plus a margin for the reload and
    this loaded machine)."""
    fleet = [
        make_daemon(
            admin=True,
            server={"instance_id": n, "key_refresh_s": REFRESH_S},
            store={"url": pg_url},
            engine={"max_num_seqs": 2, "max_model_len": 128},
        )
        for n in ("a", "b")
    ]
    a, b = fleet
    with admin(a) as c:
        secret = c.post("/admin/keys", json={"name": "fleet-key"}).json()["secret"]
        assert models(b, secret).status_code in (200, 401)
        seen = wait_status(b, secret, 200, REFRESH_S + 5)
        revoked_at = time.monotonic()
        assert c.post("/admin/keys/fleet-key/revoke").status_code == 200
        assert models(a, secret).status_code == 401  # at once where it was revoked
    wait_status(b, secret, 401, REFRESH_S + 5)
    lag = time.monotonic() - revoked_at  # from before the revoke was sent
    print(f"key seen on b after {seen:.3f} s; revoke reached b after {lag:.3f} s")
    assert lag <= REFRESH_S + 2.0  # the bound, plus a margin for the reload on a loaded machine
    with admin(a) as c:  # audited by the daemon that made the changes (its instance id)
        assert [r["field"] for r in key_history(c, "fleet-key")] == [
            "api_keys.fleet-key.revoked_at",
            "api_keys.fleet-key",
        ]


def test_cli(served, capsys):
    """`controlplane keys ...` against the daemon's admin API: the secret printed once."""
    from controlplane.cli import main

    base = ["--url", served.url, "--token", TOKEN]

    def run(*argv: str) -> tuple[int, str]:
        code = main(["keys", *argv, *base])
        out = capsys.readouterr()
        return code, out.out + out.err

    code, out = run("create", "cli-key", "--owner", "bob", "--requests-per-minute", "30")
    assert code == 0, out
    secret = out.split("shown this once, only its hash is kept): ")[1].strip()
    assert models(served, secret).status_code == 200
    code, out = run("list")
    assert code == 0 and "cli-key" in out and "requests_per_minute=30" in out
    assert secret not in out
    code, out = run("update", "cli-key", "--max-concurrent", "-1")
    assert code == 1 and "max_concurrent" in out
    code, out = run("update", "cli-key", "--allowed-models", MODEL, "--budget-usd", "5")
    assert code == 0 and f"models={MODEL}" in out and "budget=$5/month" in out
    code, out = run("rotate", "cli-key")
    assert code == 0
    secret2 = out.split("only its hash is kept): ")[1].strip()
    assert models(served, secret).status_code == 401
    assert models(served, secret2).status_code == 200
    code, out = run("revoke", "cli-key")
    assert code == 0 and "revoked" in out
    assert models(served, secret2).status_code == 401
    served.daemon.runtime.auth_failures = AuthFailures()


def test_a_table_keys_own_limits_apply_over_the_defaults(served):
    """A table key's requests_per_minute (set at creation, then raised live) is the limit its
    requests meet; the config file's key keeps the [limits] default (none here)."""
    d = served
    with admin(d) as c:
        made = c.post("/admin/keys", json={"name": "limited", "requests_per_minute": 2})
        assert made.status_code == 201, made.text
        secret = made.json()["secret"]
        statuses = [complete(d, secret).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        refused = complete(d, secret)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["x-ratelimit-limit-requests"] == "2"
        assert [complete(d, CONFIG_KEY["key"]).status_code for _ in range(3)] == [200] * 3
        # Raised live: the new limit holds as soon as this daemon's cache reloads (at once). The
        # bucket keeps its level (empty) and refills at the new rate: 100 a minute, one in 0.6 s.
        raised = c.patch("/admin/keys/limited", json={"requests_per_minute": 100})
        assert raised.status_code == 200, raised.text
        assert complete(d, secret).headers["x-ratelimit-limit-requests"] == "100"
        time.sleep(1.5)
        ok = complete(d, secret)
        assert ok.status_code == 200, ok.text
