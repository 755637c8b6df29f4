"""Tokenizer from GGUF metadata: `tokenizer.ggml.*` -> a `tokenizers` BPE -> our `Tokenizer`.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, SmolLM, Llama 3, Qwen2...) is
built. Its vocabulary is stored already spelled in GPT-2's byte alphabet ("Ġthe"), and the
merges in rank order, so they go into `tokenizers.models.BPE` as they are. What a GGUF does not
store is the pre-tokenizer: llama.cpp names it (`tokenizer.ggml.pre`) and hard-codes its
regexes, so the known names are mapped to the same splits here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from controlplane.engine.errors import ModelLoadError
from controlplane.engine.gguf.file import GGUFFile, open_gguf
from controlplane.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type).
CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _smollm() -> pre_tokenizers.PreTokenizer:
    # SmolLM's tokenizer.json: every digit on its own, then GPT-2's regex (llama.cpp "smollm":
    # `\p{N}`, then the GPT-2 expression).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt-2": _gpt2,
    "gpt2": _gpt2,
    "smollm": _smollm,
    "llama-bpe": lambda: _split(_LLAMA3_SPLIT),
    "llama3": lambda: _split(_LLAMA3_SPLIT),
    "qwen2": lambda: _split(_QWEN2_SPLIT),
}


def _strings(f: GGUFFile, key: str) -> list[str]:
    value = f.require(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"{f.path}: metadata {key!r} must be an array of strings")
    return value


def build_backend(f: GGUFFile) -> BackendTokenizer:
    """The `tokenizers.Tokenizer` the file's metadata describes."""
    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{f.path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    tokens = _strings(f, "tokenizer.ggml.tokens")
    merges = []
    for merge in _strings(f, "tokenizer.ggml.merges"):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ModelLoadError(f"{f.path}: malformed merge {merge!r} in tokenizer.ggml.merges")
        merges.append((pair[0], pair[1]))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{f.path}: tokenizer.ggml.tokens has duplicate tokens")
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges))
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        log.warning(
            "%s: pre-tokenizer %r is not known here; splitting text like GPT-2", f.path, pre
        )
    backend.pre_tokenizer = PRE_TOKENIZERS.get(pre, _gpt2)()
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>...) match whole and are skipped when decoding; user-defined
    # ones match whole but are ordinary text. Both already have their ids in the vocabulary.
    types = f.get("tokenizer.ggml.token_type") or []
    backend.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(tokens, types, strict=False)
            if kind == CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, types, strict=False)
            if kind == USER_DEFINED
        ]
    )
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ModelLoadError(f"{f.path}: added tokens changed the vocabulary size")
    return backend


def _token(tokens: list[str], f: GGUFFile, key: str) -> str | None:
    i = f.get(f"tokenizer.ggml.{key}")
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """Our `Tokenizer`: backend, special tokens, `add_bos_token` and the chat template."""
    f = open_gguf(path)
    backend = build_backend(f)
    tokens = f.metadata["tokenizer.ggml.tokens"]
    config: dict[str, object] = {
        name: tok
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
        if (tok := _token(tokens, f, key)) is not None
    }
    # llama.cpp adds BOS unless the file says not to; so does this tokenizer.
    config["add_bos_token"] = bool(f.get("tokenizer.ggml.add_bos_token", True))
    template = f.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    eos_ids = [
        i
        for key in ("eos_token_id", "eot_token_id")
        if isinstance(i := f.get(f"tokenizer.ggml.{key}"), int)
    ]
    return Tokenizer(
        backend,
        config=config,
        model_config={"eos_token_id": eos_ids},
        source=f"{f.path} (tokenizer.* metadata)",
    )
