"""The smaller defects of issue 24 (item 10), against a real daemon on loopback:

- `/admin/requests` with a `since` / `until` / cursor whose conversion to UTC leaves the years
  a datetime can hold (year 1 with a positive offset, year 9999 with a negative one) is a 4xx
  naming the parameter, not a 500 (`OverflowError`);
- `controlplane report ... --since 99999999d` (and those dates) exits 2 with one line naming
  the flag, not a traceback;
- a chat message's `role` must be one the API defines;
- `Bearer <token>` followed by a non-breaking space (or any non-ASCII space) is not the token:
  only ASCII whitespace around it is ignored.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import pytest

from controlplane.common import parse_time
from controlplane.engine.errors import InvalidSettingError
from controlplane.http.auth import match_bearer
from controlplane.store.queries import decode_cursor
from harness import InProcessDaemon

MODEL = "model"  # the tiny demo model's directory name
TOKEN = "small-token-0123456789"
KEY = "sk-small-0123456789"
EARLY = "0001-01-01T00:00:00+05:00"  # 31 Dec of year 0 in UTC: not a datetime
LATE = "9999-12-31T23:59:59-05:00"  # year 10000 in UTC


@pytest.fixture(scope="module")
def served(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        server={"config_watch_interval_s": 3600.0},
        engine={"max_model_len": 512},
        store={"flush_interval_s": 0.05},
        admin_tokens=[{"name": "small", "token": TOKEN}],
        api_keys=[{"name": "team", "key": KEY}],
    )


def _cursor(at: str) -> str:
    raw = json.dumps([at, "chatcmpl-x"], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


# -- /admin/requests and the time parser --------------------------------------------------------


@pytest.mark.parametrize("value", [EARLY, LATE])
def test_parse_time_and_cursor_out_of_range_name_the_field(value):
    with pytest.raises(InvalidSettingError, match="out of range") as exc:
        parse_time("since", value, relative=False)
    assert exc.value.field == "since"
    with pytest.raises(InvalidSettingError) as exc:
        decode_cursor(_cursor(value))
    assert exc.value.field == "cursor"
    for relative in ("99999999d", "999999999999d", "99999999999999999999w"):
        with pytest.raises(InvalidSettingError, match="out of range") as exc:
            parse_time("since", relative)
        assert exc.value.field == "since"


def test_admin_requests_out_of_range_times_are_4xx_naming_the_field(served):
    d = served
    with d.client(TOKEN, timeout=30) as c:
        for params, field in (
            ({"since": EARLY}, "since"),
            ({"until": LATE}, "until"),
            ({"since": LATE}, "since"),
            ({"until": EARLY}, "until"),
            ({"cursor": _cursor(EARLY)}, "cursor"),
            ({"cursor": _cursor(LATE)}, "cursor"),
        ):
            r = c.get("/admin/requests", params=params)
            assert 400 <= r.status_code < 500, (params, r.status_code, r.text)
            err = r.json()["error"]
            assert err["param"] == field and err["message"].startswith(f"{field}: "), (params, err)
        # The extremes that do convert still work.
        r = c.get(
            "/admin/requests",
            params={"since": "0001-01-01T00:00:00Z", "until": "9999-12-31T23:59:59Z"},
        )
        assert r.status_code == 200, r.text


# -- controlplane report --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "flags"),
    [
        ("--since", ("--since", "99999999d")),
        ("--since", ("--since", "999999999999d")),
        ("--since", ("--since", EARLY)),
        ("--until", ("--since", "2026-01-01", "--until", LATE)),
        ("--since", ("--since", "0001-01-01T00:00:00Z", "--until", "0001-01-02T00:00:00Z")),
        ("--until", ("--since", "2026-01-01", "--until", "9999-12-31T23:30:00Z")),
    ],
)
def test_report_cli_out_of_range_dates_exit_2_with_one_line(tmp_path, flag, flags):
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    for kind in ("cost", "requests"):
        p = subprocess.run(
            [sys.executable, "-m", "controlplane", "report", kind, "--url", url, *flags],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert p.returncode == 2, (flags, p.returncode, p.stderr)
        assert "Traceback" not in p.stderr, p.stderr
        errors = [line for line in p.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and "out of range" in errors[0], p.stderr
        assert f"argument {flag}:" in errors[0], p.stderr


# -- chat roles -----------------------------------------------------------------------------------


def test_chat_role_must_be_one_the_api_defines(served):
    d = served
    with d.client(KEY) as c:
        for role in ("hacker", "User", "", "system ", "ipython"):
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": role, "content": "x"},
                    ],
                    "max_tokens": 1,
                },
            )
            assert r.status_code == 400, (role, r.status_code, r.text)
            err = r.json()["error"]
            assert err["param"] == "messages[1].role", err
            assert "developer" in err["message"] and "user" in err["message"], err
        # Every role the API defines is accepted (the tiny model's template renders them).
        for role in ("system", "developer", "user"):
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": role, "content": "hi"}],
                    "max_tokens": 1,
                },
            )
            assert r.status_code == 200, (role, r.text)


# -- bearer tokens ----------------------------------------------------------------------------------


def test_match_bearer_strips_only_ascii_whitespace():
    secrets = [TOKEN.encode()]
    assert match_bearer(f"Bearer {TOKEN}", secrets) == 0
    assert match_bearer(f"Bearer  {TOKEN} \t", secrets) == 0
    for space in ("\u00a0", "\u2003", "\u3000", "\u0085", "\u200b", "\ufeff"):
        assert match_bearer(f"Bearer {TOKEN}{space}", secrets) is None, repr(space)
        assert match_bearer(f"Bearer {space}{TOKEN}", secrets) is None, repr(space)


def test_bearer_with_a_non_breaking_space_is_refused(served):
    d = served
    for path, secret in (("/admin/config", TOKEN), ("/v1/models", KEY)):
        ok = httpx.get(d.url + path, headers={"Authorization": f"Bearer {secret}"}, timeout=30)
        assert ok.status_code == 200, (path, ok.text)
        # Sent as bytes: latin-1 0xA0 is the non-breaking space the server decodes.
        header = b"Bearer " + secret.encode() + b"\xa0"
        r = httpx.get(d.url + path, headers={"Authorization": header}, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text)
