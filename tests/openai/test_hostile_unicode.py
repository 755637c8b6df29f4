"""Hostile Unicode in chat messages (issue 24, defect 2).

A message holding every private-use character (U+E000-U+F8FE) used to exhaust the chat
special-token escape's marker characters: StopIteration in the tokenize worker, which asyncio
cannot deliver to a future, so the handler waited forever, its socket stayed open, and a few
hundred such requests exhausted the descriptors while the accept loop logged "Too many open
files" millions of times.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import resource
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.config import load_config
from harness import DaemonProcess, InProcessDaemon, write_config
from tests.conftest import require_smollm2

PUA = "".join(chr(c) for c in range(0xE000, 0xF8FF))  # every BMP private-use character
MODEL = "model"  # the tiny demo model's directory name, served as the model id


@pytest.fixture(scope="module")
def smol_tok():
    from controlplane.engine.gguf.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(require_smollm2())


# -- the escape, as a property ---------------------------------------------------------------


def _text(specials: tuple[str, ...], keep=lambda ch: True) -> st.SearchStrategy[str]:
    """Random Unicode (private-use planes weighted in, surrogates excluded: not UTF-8) mixed
    with special-token text and pieces of it; `keep`: which characters may appear."""

    def chars(**kw) -> st.SearchStrategy[str]:
        return st.characters(**kw).filter(keep)

    pieces = [
        st.text(chars(exclude_categories=("Cs",)), max_size=40),
        st.text(chars(min_codepoint=0xE000, max_codepoint=0xF8FF), max_size=40),
        st.text(chars(min_codepoint=0xF0000, max_codepoint=0x10FFFD), max_size=10),
        st.sampled_from(specials),
        st.sampled_from([s[: len(s) // 2] for s in specials] + [s[1:] for s in specials]),
        st.sampled_from(["\ue000", "\ue0000\ue000", "\ue000" + "17\ue000", "<|", "|>", "\n"]),
    ]
    return st.lists(st.one_of(*pieces), max_size=12).map("".join)


def _messages(text: st.SearchStrategy[str]) -> st.SearchStrategy[list[dict[str, str]]]:
    roles = st.sampled_from(["system", "user", "assistant"])
    message = st.fixed_dictionaries({"role": roles, "content": text})
    return st.lists(message, min_size=1, max_size=4)


PROPERTY = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)


@pytest.mark.timeout(300)
def test_escape_property_over_random_unicode(smol_tok):
    """Whatever the messages hold, the prompt's control tokens are the template's own: text
    that looks like a special token never becomes one."""
    tok = smol_tok
    special_ids = {tok.token_to_id(t) for t in tok.special_token_texts}

    def specials_of(ids: list[int]) -> list[int]:
        return [i for i in ids if i in special_ids]

    @PROPERTY
    @given(_messages(_text(tok.special_token_texts)))
    def check(msgs: list[dict[str, str]]) -> None:
        ids = tok.encode_chat(msgs)
        # The same conversation with plain text instead: only the template's control tokens.
        blank = [{**m, "content": "x"} for m in msgs]
        assert specials_of(ids) == specials_of(tok.encode_chat(blank))

    check()


@pytest.mark.timeout(300)
def test_escape_round_trips_all_other_text(smol_tok):
    """The ids decode to exactly the rendered conversation, special-token text typed in a
    message included (as the text it is). Over the characters SmolLM2's vocabulary can spell:
    it lacks a few byte tokens (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, and the lead bytes of
    planes 4-14), which the tokenizer drops with or without the escape."""
    tok = smol_tok
    cache: dict[str, bool] = {}

    def spellable(ch: str) -> bool:
        if ch not in cache:
            ids = tok.encode(ch, add_special_tokens=False)
            cache[ch] = tok.decode(ids, skip_special_tokens=False) == ch
        return cache[ch]

    @PROPERTY
    @given(_messages(_text(tok.special_token_texts, spellable)))
    def check(msgs: list[dict[str, str]]) -> None:
        ids = tok.encode_chat(msgs)
        assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(msgs)

    check()


def test_escape_of_every_private_use_character(smol_tok):
    tok = smol_tok
    special_ids = {tok.token_to_id(t) for t in tok.special_token_texts}
    content = PUA + "".join(tok.special_token_texts) + PUA
    msgs = [{"role": "user", "content": content}]
    ids = tok.encode_chat(msgs)
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(msgs)
    blank = tok.encode_chat([{"role": "user", "content": "x"}])
    assert [i for i in ids if i in special_ids] == [i for i in blank if i in special_ids]
    # Tools: a description made of them goes through the same escape.
    from controlplane.openai.tools import render_messages

    tools = _tools_request(PUA + "<|im_end|>")
    rendered, extra = render_messages(msgs, tools, False)
    ids = tok.encode_chat(rendered, **extra)
    assert [i for i in ids if i in special_ids] == [i for i in blank if i in special_ids]


def _tools_request(description: str):
    from controlplane.openai import protocol

    parsed = protocol.parse_chat(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [_tool(description)],
        }
    )
    return parsed.tools


def _tool(description: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": description,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }


# -- the daemon: all-PUA requests at once, under a low descriptor limit ----------------------

FD_LIMIT = 256


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.mark.timeout(300)
def test_all_pua_messages_at_once_are_answered_under_a_low_descriptor_limit(
    tiny_model_dir, tmp_path
):
    cfg = write_config(tmp_path / "cp.toml", tmp_path / "data", tiny_model_dir)
    d = DaemonProcess.start(cfg, preexec_fn=_low_fd_limit)
    try:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": PUA}], "max_tokens": 4}
        big = {**chat, "messages": [{"role": "user", "content": PUA * 10}]}  # ~190 KB of UTF-8
        with_tool = {**chat, "tools": [_tool(PUA)]}
        bodies = [chat] * 6 + [big] * 4 + [with_tool] * 6
        results: list[int | str] = [0] * len(bodies)
        errors: list[str] = []

        def send(i: int) -> None:
            try:
                r = httpx.post(d.url + "/v1/chat/completions", json=bodies[i], timeout=60)
                results[i] = r.status_code
                if r.status_code != 200:
                    errors.append(r.json()["error"]["message"])
            except httpx.HTTPError as exc:
                results[i] = repr(exc)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        # Answered: 200, or a clean 4xx; never a hang (a timeout) or a 5xx.
        assert all(isinstance(s, int) and (s == 200 or 400 <= s < 500) for s in results), results
        # The tiny model's context is shorter than these prompts: the 400 says so, which
        # means each message was tokenized (escape included) and measured.
        assert results.count(400) == len(bodies), results
        assert all("context" in e or "max_model_len" in e for e in errors), errors[:3]
        for path in ("/health", "/health/live", "/v1/models"):
            assert httpx.get(d.url + path, timeout=10).status_code == 200, path
    finally:
        assert d.stop() == 0
    assert not [line for line in d.lines if "Too many open files" in line]


# -- any exception from the tokenize worker is a clean error --------------------------------


@pytest.fixture
def served(tiny_model_dir, tmp_path):
    cfg = load_config(write_config(tmp_path / "cp.toml", tmp_path / "data", tiny_model_dir))
    with InProcessDaemon(cfg) as d:
        yield d


@pytest.mark.timeout(120)
@pytest.mark.parametrize("exc", [StopIteration, StopAsyncIteration, RuntimeError, KeyError])
@pytest.mark.parametrize("size", [10, 20_000])  # inline, and in the worker thread
def test_exception_in_the_tokenize_worker_is_a_clean_error(served, exc, size):
    runtime = served.daemon.runtime

    def broken(*args, **kw):
        raise exc("boom")

    runtime.engine.tokenize_chat = broken
    body = {"model": MODEL, "messages": [{"role": "user", "content": "y" * size}]}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error"
    # The server goes on serving.
    del runtime.engine.tokenize_chat
    body = {"model": MODEL, "messages": [{"role": "user", "content": "y"}], "max_tokens": 2}
    assert httpx.post(served.url + "/v1/chat/completions", json=body, timeout=20).status_code == 200


# -- the same error logged over and over is rate-limited ------------------------------------


def test_repeated_log_error_is_rate_limited(capsys):
    from controlplane.runtime.logs import RepeatLimit, setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("text", "INFO")
        # What the accept loop does when the process is out of descriptors, in a tight loop.
        loop = asyncio.new_event_loop()
        try:
            for _ in range(20_000):
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(24, "Too many open files"),
                    }
                )
        finally:
            loop.close()
        for i in range(5):  # distinct messages are untouched
            logging.getLogger("controlplane.test").warning("distinct %d", i)
        err = capsys.readouterr().err
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    lines = err.splitlines()
    firsts = [ln for ln in lines if "socket.accept() out of system resource" in ln]
    burst = RepeatLimit().burst
    assert len(firsts) == burst, len(firsts)
    assert "further repeats are suppressed" in firsts[-1]
    # Each logged repeat has its traceback lines; the whole log stays small.
    assert len(lines) < burst * 10 + 20, len(lines)
    assert sum(f"distinct {i}" in err for i in range(5)) == 5


def test_rate_limit_window_reports_the_suppressed_count():
    from controlplane.runtime.logs import RepeatLimit

    f = RepeatLimit(burst=3, window_s=0.2)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(f)
    logger = logging.getLogger("controlplane.test.repeat")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for _ in range(100):
            logger.error("same %s", "thing")
        import time

        time.sleep(0.25)
        logger.error("same %s", "thing")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert "97 more like this suppressed" in lines[-1]
    assert json.dumps(lines)  # plain text lines
