"""Issue 24, defect 5: the prefix cache is partitioned per API key (by default, when keys are
configured), so tenant B's cached_tokens for tenant A's exact prompt equal those for a wrong
guess; vLLM's `cache_salt` partitions further; engine.prefix_cache_isolation = none shares."""

from __future__ import annotations

import httpx
import pytest

from controlplane.config import load_config
from controlplane.engine import LLM, SamplingParams
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.settings import EngineSettings, validate_changes
from harness import InProcessDaemon
from tests.admin.test_admin_api import MODEL, TOKEN, admin_cfg

BS = 16  # the engine's default block size
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
PREFIX = [(7 * i) % 900 + 10 for i in range(3 * BS)]  # a shared "system prompt": 3 blocks
SECRET = [(11 * i) % 800 + 50 for i in range(2 * BS)]  # A's secret: 2 blocks
WRONG = [(13 * i) % 700 + 60 for i in range(2 * BS)]  # B's wrong guess: 2 blocks


ENGINE = {"max_num_seqs": 8, "max_model_len": 1024}


@pytest.fixture(scope="module")
def keyed(make_module_daemon) -> InProcessDaemon:
    keys = [{"name": "tenant-a", "key": KEY_A}, {"name": "tenant-b", "key": KEY_B}]
    return make_module_daemon(admin=True, engine=ENGINE, api_keys=keys)


@pytest.fixture(scope="module")
def open_api(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(admin=True, engine=ENGINE)


def cached(c: httpx.Client, prompt: list[int], **extra) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def reset(d: InProcessDaemon) -> None:
    with d.client(TOKEN) as admin:
        assert admin.post("/admin/cache/reset").status_code == 200


def set_isolation(d: InProcessDaemon, value: str) -> None:
    with d.client(TOKEN) as admin:
        r = admin.patch("/admin/config", json={"engine": {"prefix_cache_isolation": value}})
        assert r.status_code == 200, r.text


def probe(d: InProcessDaemon) -> dict[str, int]:
    """The issue's attack: A sends PREFIX + SECRET; B, whose own requests cached PREFIX, sends
    the right guess and a wrong one (fresh tails, so only the guess can hit)."""
    reset(d)
    with d.client(KEY_A) as a, d.client(KEY_B) as b:
        cached(a, [*PREFIX, *SECRET, 1, 2, 3])
        cached(b, [*PREFIX, 4, 5, 6])  # B's own request with the shared system prompt
        return {
            "right": cached(b, [*PREFIX, *SECRET, 7, 8]),
            "wrong": cached(b, [*PREFIX, *WRONG, 9, 10]),
            "a_again": cached(a, [*PREFIX, *SECRET, 11, 12]),
        }


def test_another_key_learns_nothing_from_the_cache(keyed):
    got = probe(keyed)
    # B's hits are its own (the shared system prompt it sent), right guess or wrong.
    assert got["right"] == got["wrong"] == 3 * BS
    assert got["a_again"] == 5 * BS  # the same key does hit its own prefix


def test_isolation_none_shares_between_keys(keyed):
    set_isolation(keyed, "none")
    try:
        got = probe(keyed)
        assert got["right"] == 5 * BS and got["wrong"] == 3 * BS  # shared: the signal is back
    finally:
        set_isolation(keyed, "key")


def test_cache_salt_with_keys(keyed):
    reset(keyed)
    with keyed.client(KEY_A) as a, keyed.client(KEY_B) as b:
        cached(a, [*PREFIX, 1], cache_salt="s1")
        assert cached(a, [*PREFIX, 2], cache_salt="s1") == 3 * BS
        assert cached(a, [*PREFIX, 3], cache_salt="s2") == 0
        assert cached(a, [*PREFIX, 4]) == 0  # no salt: A's own unsalted partition
        assert cached(b, [*PREFIX, 5], cache_salt="s1") == 0  # the salt does not cross keys
    set_isolation(keyed, "none")
    try:
        with keyed.client(KEY_A) as a, keyed.client(KEY_B) as b:
            cached(a, [*PREFIX, 6], cache_salt="team")
            assert cached(b, [*PREFIX, 7], cache_salt="team") == 3 * BS
            assert cached(b, [*PREFIX, 8], cache_salt="other") == 0
    finally:
        set_isolation(keyed, "key")


def test_open_api_shares_unless_salted(open_api):
    c = open_api.client()
    with c:
        cached(c, [*PREFIX, 1])
        assert cached(c, [*PREFIX, 2]) == 3 * BS  # open API: one shared cache, as before
        assert cached(c, [*PREFIX, 3], cache_salt="tenant-x") == 0
        assert cached(c, [*PREFIX, 4], cache_salt="tenant-x") == 3 * BS
        assert cached(c, [*PREFIX, 5], cache_salt="tenant-y") == 0
        # Chat carries the field too.
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a b c d e f g " * 12}],
            "max_tokens": 1,
            "cache_salt": "tenant-z",
        }
        first = c.post("/v1/chat/completions", json=chat).json()["usage"]
        again = c.post("/v1/chat/completions", json=chat).json()["usage"]
        other = c.post("/v1/chat/completions", json={**chat, "cache_salt": "tenant-w"}).json()
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["prompt_tokens_details"]["cached_tokens"] > 0
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    "salt", [5, "", "x" * 257, ["a"], {"a": 1}, True], ids=lambda v: type(v).__name__
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_cache_salt_validation(open_api, salt, path):
    body = {"model": MODEL, "max_tokens": 1, "cache_salt": salt}
    body.update(
        {"prompt": "x"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    r = httpx.post(open_api.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_isolation_setting_is_validated():
    with pytest.raises(InvalidSettingError) as err:
        validate_changes(EngineSettings(), {"prefix_cache_isolation": "tenant"})
    assert err.value.field == "prefix_cache_isolation"
    assert EngineSettings().prefix_cache_isolation == "key"
    assert "prefix_cache_isolation" in EngineSettings.live_fields()


def test_config_file_names_the_field(tmp_path, tiny_model_dir):
    path = admin_cfg(tmp_path, tiny_model_dir, engine={"prefix_cache_isolation": "tenants"})
    with pytest.raises(InvalidSettingError) as err:
        load_config(path, env={})
    assert "prefix_cache_isolation" in err.value.field


def test_engine_salts_partition_the_cache(tiny_model_dir):
    """In the engine: equal salts share blocks, different salts (or none) do not."""
    llm = LLM(str(tiny_model_dir), max_num_seqs=4)

    def hits(salt: str | None, tail: int) -> int:
        params = SamplingParams(max_tokens=1, temperature=0, cache_salt=salt)
        (out,) = llm.generate([[*PREFIX, tail]], params, use_tqdm=False)
        return out.metrics.num_cached_tokens

    assert hits(None, 1) == 0
    assert hits(None, 2) == 3 * BS
    assert hits("a", 3) == 0
    assert hits("a", 4) == 3 * BS
    assert hits("b", 5) == 0
    with pytest.raises(InvalidSettingError):
        SamplingParams(cache_salt="")
