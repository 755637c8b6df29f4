"""Tokenizer wrapper: round trips, incremental detokenization, special ids, chat templates."""

import json
import random
import re
import shutil

import pytest

from controlplane.engine.demo_model import write_demo_model
from controlplane.engine.errors import ModelLoadError
from controlplane.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  \n\tand tabs\n",
    "emoji: 🦙🚀👍🏽 and a family 👨‍👩‍👧",
    "CJK: 日本語のテキスト, 中文文本, 한국어",
    "accents: café, naïve, Ångström, résumé, Œuvre, ß",
    "mixed: ¿Qué tal? Привет! مرحبا 🎉 ∑x² ≤ ∞",
]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("tiny-tok") / "model", size="tiny")


@pytest.fixture(scope="session")
def tok(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def hf_tok(tiny_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


def _copy_tokenizer_json(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return dst


# --- encode / decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.bos_token_id not in ids
    assert tok.decode(ids) == text
    with_bos = tok.encode(text)
    assert with_bos == [tok.bos_token_id, *ids]
    assert tok.decode(with_bos) == text
    assert tok.decode(with_bos, skip_special_tokens=False) == "<|begin_of_text|>" + text


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    assert (
        tok.encode(text, add_special_tokens=False)
        == hf_tok(text, add_special_tokens=False)["input_ids"]
    )


def test_vocab_and_special_ids(tok, tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert tok.vocab_size == config["vocab_size"] == 1024
    assert tok.bos_token_id == tok.token_to_id("<|begin_of_text|>") == config["bos_token_id"]
    assert tok.add_bos_token is True
    # tokenizer_config eos_token <|eot_id|>, config.json eos_token_id (eot) and
    # generation_config.json [<|end_of_text|>, <|eot_id|>].
    assert tok.eos_token_ids == frozenset(
        {tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")}
    )
    assert len(tok.eos_token_ids) == 2


def test_eos_ids_are_the_union_of_all_sources(tiny_dir, tmp_path):
    d = _copy_tokenizer_json(tiny_dir, tmp_path / "m")
    # eos_token as a serialized AddedToken, config.json as a list, generation_config as an int.
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|end_header_id|>", "__type": "AddedToken"}})
    )
    (d / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == frozenset({tok.token_to_id("<|end_header_id|>"), 7, 8, 9})
    assert tok.eos_token == "<|end_header_id|>"


def test_only_tokenizer_json(tiny_dir, tmp_path):
    d = _copy_tokenizer_json(tiny_dir, tmp_path / "bare")
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == frozenset()
    assert tok.bos_token_id is None
    # No bos token known, so the post-processor's prepended token is not recognised as bos.
    assert tok.add_bos_token is False
    assert tok.decode(tok.encode("hi there")) == "hi there"


def test_add_bos_token_false_overrides_post_processor(tiny_dir, tmp_path):
    d = _copy_tokenizer_json(tiny_dir, tmp_path / "nobos")
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "add_bos_token": False})
    )
    tok = Tokenizer.from_dir(d)
    assert tok.add_bos_token is False
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello")[0] != tok.bos_token_id


def test_add_bos_token_true_without_post_processor(tiny_dir, tmp_path):
    d = _copy_tokenizer_json(tiny_dir, tmp_path / "addbos")
    data = json.loads((d / "tokenizer.json").read_text())
    data["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(data))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "add_bos_token": True})
    )
    tok = Tokenizer.from_dir(d)
    plain = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == [tok.bos_token_id, *plain]


def test_missing_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        Tokenizer.from_dir(tmp_path)
    assert issubclass(ModelLoadError, ValueError)


def test_bad_tokenizer_config_names_the_file(tiny_dir, tmp_path):
    d = _copy_tokenizer_json(tiny_dir, tmp_path / "badcfg")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=re.escape(str(d / "tokenizer_config.json"))):
        Tokenizer.from_dir(d)


# --- incremental detokenizer -------------------------------------------------------------------


def _stream(tok, ids, skip=True):
    d = tok.detokenizer(skip_special_tokens=skip)
    parts = [d.add(i) for i in ids]
    return d, parts


def test_multibyte_character_is_held_until_complete(tok):
    prefix = tok.encode("ok ", add_special_tokens=False)
    llama = tok.encode("🦙", add_special_tokens=False)
    suffix = tok.encode(" done", add_special_tokens=False)
    # The tokenizer was trained on ASCII, so the 4-byte emoji is one token per byte.
    assert len(llama) == 4
    d, parts = _stream(tok, prefix + llama + suffix)
    emoji_parts = parts[len(prefix) : len(prefix) + 4]
    assert emoji_parts[:3] == ["", "", ""]
    assert emoji_parts[3] == "🦙"
    assert "".join(parts) == "ok 🦙 done"
    assert d.flush() == ""
    assert d.text == "ok 🦙 done"


@pytest.mark.parametrize("text", TEXTS)
def test_stream_never_emits_partial_characters(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d, parts = _stream(tok, ids)
    emitted = ""
    for k, part in enumerate(parts, start=1):
        assert "\ufffd" not in part
        emitted += part
        assert text.startswith(emitted)
        # Whenever the ids so far decode to complete text, all of it has been emitted.
        full = tok.decode(ids[:k])
        if not full.endswith("\ufffd"):
            assert emitted == full
    assert d.flush() == ""
    assert emitted == d.text == tok.decode(ids) == text


def test_stream_equals_decode_for_random_ids(tok):
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            d, parts = _stream(tok, ids, skip)
            tail = d.flush()
            assert "".join(parts) + tail == d.text == tok.decode(ids, skip_special_tokens=skip)


class _PlainBackend:
    """The tokenizer's backend without its `decoder` attribute: the detokenizer cannot tell it
    is byte-level, so every token goes through the decoded window (the general path)."""

    def __init__(self, inner):
        self.decode = inner.decode


def _same_stream_on_both_paths(backend, streams):
    """The byte-level path against the window path, token by token: never behind it (it may
    release a complete character the window still holds, such as the space of a token that is a
    space and the first byte of a character), never past the whole stream's text, all of that
    text once it ends in a complete character; both end on the whole stream decoded at once.
    Returns the tokens that went through the bytes."""
    through_bytes = 0
    for ids in streams:
        for skip in (True, False):
            fast = IncrementalDetokenizer(backend, skip_special_tokens=skip)
            plain = IncrementalDetokenizer(_PlainBackend(backend), skip_special_tokens=skip)
            assert fast._by_token is not None and plain._by_token is None
            fast_out = plain_out = ""
            for k, i in enumerate(ids, start=1):
                fast_out += fast.add(i)
                plain_out += plain.add(i)
                assert fast_out.startswith(plain_out), (ids, k)
                if len(ids) <= 100:  # each prefix decoded whole: quadratic in the stream
                    whole = backend.decode(ids[:k], skip_special_tokens=skip)
                    assert whole.startswith(fast_out), (ids, k)
                    if not whole.endswith("\ufffd"):
                        assert fast_out == whole
            through_bytes += len(ids)
            assert not fast._ids  # no window was ever decoded
            assert fast_out + fast.flush() == plain_out + plain.flush()
            assert fast.text == plain.text == backend.decode(ids, skip_special_tokens=skip)
    return through_bytes


def test_byte_level_path_gives_the_windows_texts(tok):
    """Random ids (bytes that split characters, invalid bytes, special tokens) and
    multilingual text, both skip modes, with the compaction of a long stream in between."""
    from controlplane.engine.detokenizer import _byte_level

    assert _byte_level(tok.backend) and not _byte_level(_PlainBackend(tok.backend))
    rng = random.Random(99)
    streams = [
        [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))] for _ in range(300)
    ]
    streams += [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    streams.append(tok.encode(" ".join(TEXTS) * 30, add_special_tokens=False))  # > 1,024 ids
    assert _same_stream_on_both_paths(tok.backend, streams) > 10_000


def test_every_tokens_bytes_decode_to_its_text(tok):
    """Each vocabulary entry's bytes, as the byte-level path keeps them, read as UTF-8 give the
    token decoded alone: the alphabet mapping agrees with `tokenizers` for every token."""
    from controlplane.engine.detokenizer import token_bytes

    for skip in (True, False):
        for i in range(tok.vocab_size):
            raw = token_bytes(tok.backend, i, skip)
            assert raw.decode("utf-8", "replace") == tok.decode([i], skip_special_tokens=skip)
    # A byte of a multi-byte character is that byte, not U+FFFD's three.
    lead = tok.encode("\U0001f999", add_special_tokens=False)[0]
    assert token_bytes(tok.backend, lead, True) == b"\xf0"
    eot = tok.token_to_id("<|eot_id|>")
    assert token_bytes(tok.backend, eot, True) == b""
    assert token_bytes(tok.backend, eot, False) == b"<|eot_id|>"


def test_byte_level_path_on_smollm2s_tokenizer():
    """The same on the real model's vocabulary (49,152 byte-level BPE tokens from its GGUF,
    with multi-byte merges): random ids and the multilingual texts, both skip modes."""
    from controlplane.engine.gguf.tokenizer import tokenizer_from_gguf
    from tests.conftest import require_smollm2

    real = tokenizer_from_gguf(require_smollm2())
    rng = random.Random(7)
    streams = [
        [rng.randrange(real.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(200)
    ]
    streams += [real.encode(t, add_special_tokens=False) for t in TEXTS]
    assert _same_stream_on_both_paths(real.backend, streams) > 5_000


def test_flush_releases_invalid_trailing_bytes(tok):
    ids = tok.encode("abc", add_special_tokens=False)
    lead_byte = tok.encode("🦙", add_special_tokens=False)[0]  # 0xF0: starts a 4-byte char
    d, parts = _stream(tok, [*ids, lead_byte])
    assert "".join(parts) == "abc"
    assert parts[-1] == ""
    assert d.flush() == "\ufffd"
    assert d.text == tok.decode([*ids, lead_byte]) == "abc\ufffd"
    # An invalid byte followed by valid text is released as soon as the text arrives.
    d, parts = _stream(tok, [lead_byte, *ids])
    assert parts[0] == ""
    assert "".join(parts) == "\ufffdabc"


def test_special_tokens_in_stream(tok):
    eot = tok.token_to_id("<|eot_id|>")
    ids = [*tok.encode("hi", add_special_tokens=False), eot]
    _, parts = _stream(tok, ids, skip=True)
    assert "".join(parts) == "hi"
    _, parts = _stream(tok, ids, skip=False)
    assert parts[-1] == "<|eot_id|>"
    assert "".join(parts) == "hi<|eot_id|>"


def test_detokenizer_decodes_a_bounded_window(tok):
    class CountingBackend:
        def __init__(self, inner):
            self.inner = inner
            self.lengths = []

        def decode(self, ids, skip_special_tokens=True):
            self.lengths.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    text = " ".join(TEXTS) * 40
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 3000
    backend = CountingBackend(tok.backend)
    d = IncrementalDetokenizer(backend)
    for i in ids:
        d.add(i)
    d.flush()
    assert d.text == text
    # Each step decodes only recent tokens (a multi-byte char spans at most 4), and at most
    # two decodes happen per token.
    assert max(backend.lengths) <= 10
    assert len(backend.lengths) <= 2 * len(ids) + 2


# --- chat templates ----------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "  What is 2+2?  "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 日本語 🦙?"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}],
        }
    ],
    [{"role": "assistant", "content": None}, {"role": "user", "content": "x"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.startswith("<|begin_of_text|><|start_header_id|>")
    assert ours.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") == (
        add_generation_prompt
    )


def test_chat_template_prompt_tokens(tok, hf_tok):
    prompt = tok.apply_chat_template(CONVERSATIONS[1])
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    assert tok.token_to_id("<|eot_id|>") in ids
    assert ids == hf_tok.apply_chat_template(
        CONVERSATIONS[1], tokenize=True, add_generation_prompt=True, return_dict=False
    )


FEATURE_TEMPLATE = (
    "{% for m in messages %}\n"
    "  {% if m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('bad role: ' + m.role) }}{% endif %}\n"
    "  [{{ m.role }}] {{ m.content | tojson }}\n"
    "{% endfor %}\n"
    "{% if tools %}TOOLS {{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}{{ eos_token }}>{% endif %}"
    "{{ strftime_now('%Y') | length }}|{{ custom | default('none') }}"
)


def _write_config(d, config):
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_chat_template_jinja_environment_matches_transformers(tiny_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    d = _copy_tokenizer_json(tiny_dir, tmp_path / "feat")
    _write_config(
        d,
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS ONLY"},
                {"name": "default", "template": FEATURE_TEMPLATE},
            ],
        },
    )
    tok = Tokenizer.from_dir(d)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(d / "tokenizer.json"),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    messages = [
        {"role": "user", "content": '<b>café</b> & "quotes"'},
        {"role": "assistant", "content": "日本"},
    ]
    for kwargs in ({}, {"custom": "yes"}, {"tools": [{"name": "f", "description": "<é>"}]}):
        ours = tok.apply_chat_template(messages, **kwargs)
        theirs = hf.apply_chat_template(
            messages,
            chat_template=FEATURE_TEMPLATE,
            tokenize=False,
            add_generation_prompt=True,
            **kwargs,
        )
        assert ours == theirs
    ours = tok.apply_chat_template(messages)
    # tojson escapes neither HTML nor non-ASCII; trim_blocks and lstrip_blocks leave no trace of
    # the lines holding only block tags.
    assert ours == '  [user] "<b>café</b> & \\"quotes\\""\n  [assistant] "日本"\n<|eot_id|>>4|none'
    assert "TOOLS ONLY" not in ours
    with pytest.raises(ValueError, match="bad role: system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_chat_template_list_without_default(tiny_dir, tmp_path):
    d = _copy_tokenizer_json(tiny_dir, tmp_path / "nodefault")
    _write_config(d, {"chat_template": [{"name": "tool_use", "template": "x"}]})
    with pytest.raises(ValueError, match="default"):
        Tokenizer.from_dir(d)


def test_missing_chat_template_error(tiny_dir, tmp_path):
    d = _copy_tokenizer_json(tiny_dir, tmp_path / "notemplate")
    _write_config(d, {"bos_token": "<|begin_of_text|>"})
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*'chat_template'"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
