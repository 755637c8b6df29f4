"""`IncrementalDetokenizer` turns a stream of token ids into a stream of text without ever
emitting half a UTF-8 character, decoding only a short window of recent tokens per step."""

from __future__ import annotations

import weakref
from typing import Any

# What a byte-level decoder produces for a byte sequence that is not (yet) valid UTF-8.
REPLACEMENT_CHAR = "\ufffd"

# One token's text decoded alone, per tokenizer backend and skip_special_tokens: the window's
# context text is most often the one token emitted last step, so a step decodes once, not
# twice. At most one entry per vocabulary entry; gone with the backend.
_ONE_TOKEN: weakref.WeakKeyDictionary[Any, tuple[dict[int, str], dict[int, str]]] = (
    weakref.WeakKeyDictionary()
)


# Whether a backend's decoder is byte-level (GPT-2's: Llama 3, Qwen2, SmolLM2), per backend.
_BYTE_LEVEL: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _byte_level(backend: Any) -> bool:
    """Whether `backend` decodes tokens as bytes joined, then read as UTF-8 (a `tokenizers`
    ByteLevel decoder): then, after a complete character, a token whose bytes are complete
    characters adds exactly its own text, whatever came before."""
    try:
        known = _BYTE_LEVEL.get(backend)
    except TypeError:  # no weak references: not a tokenizers backend
        return False
    if known is None:
        try:
            from tokenizers.decoders import ByteLevel
        except ImportError:
            return False
        known = _BYTE_LEVEL[backend] = isinstance(getattr(backend, "decoder", None), ByteLevel)
    return known


def _one_token_texts(backend: Any, skip: bool) -> dict[int, str] | None:
    try:
        caches = _ONE_TOKEN.get(backend)
        if caches is None:
            caches = _ONE_TOKEN[backend] = ({}, {})
    except TypeError:  # a backend without weak references: no cache
        return None
    return caches[skip]


class IncrementalDetokenizer:
    """Streams text for a growing sequence of token ids.

    Uses the prefix-offset trick of vLLM/TGI: the tokens in `[prefix_offset, read_offset)` are the
    last ones already emitted and are decoded again only as context (so decoders that treat the
    start of a sequence specially, or merge bytes across tokens, give the right text); everything
    from `read_offset` on is new. Text is emitted only when it does not end in U+FFFD, so a
    character whose bytes span several tokens comes out whole once its last byte arrives.
    """

    # Drop consumed ids once this many have piled up in front of the window.
    _COMPACT_AT = 1024

    def __init__(self, backend: Any, skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text: str | None = ""
        self._parts: list[str] = []
        self._text_cache: str | None = ""
        self._one_token = _one_token_texts(backend, skip_special_tokens)
        # The fast path of `add` (below), where the decoder allows it.
        self._by_token = self._one_token if _byte_level(backend) else None

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def _context_text(self) -> str:
        """The text of [prefix_offset, read_offset) decoded alone."""
        lo, hi = self._prefix_offset, self._read_offset
        cache = self._one_token
        if hi - lo != 1 or cache is None:
            return self._decode(self._ids[lo:hi])
        return self._one_text(cache, self._ids[lo])

    def _one_text(self, cache: dict[int, str], token: int) -> str:
        """`token`'s text decoded alone, from the one-token texts (or into them)."""
        text = cache.get(token)
        if text is None:
            text = cache[token] = self._decode([int(token)])
        return text

    def _emit(self, new_text: str) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._context_text()
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if self._prefix_offset >= self._COMPACT_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        if delta:
            self._parts.append(delta)
            self._text_cache = None
        return delta

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete)."""
        by_token = self._by_token
        if by_token is not None and self._read_offset == len(self._ids):
            # Byte-level decoder, nothing held back: a token whose own text is whole characters
            # adds just that text, known from the one-token texts without decoding a window
            # (docs/benchmarks.md#host-overhead). The window becomes that one token, as `_emit`
            # would leave it.
            text = self._one_text(by_token, token_id)
            if text and REPLACEMENT_CHAR not in text:
                ids = self._ids
                ids.append(int(token_id))
                if len(ids) > self._COMPACT_AT:
                    del ids[:-1]
                self._prefix_offset = len(ids) - 1
                self._read_offset = len(ids)
                self._prefix_text = text
                self._parts.append(text)
                self._text_cache = None
                return text
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids[self._prefix_offset :])
        if self._prefix_text is None:
            self._prefix_text = self._context_text()
        if len(new_text) > len(self._prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            return self._emit(new_text)
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (U+FFFD included, if the bytes really are invalid)."""
        if self._read_offset >= len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        if self._prefix_text is None:
            self._prefix_text = self._context_text()
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._emit(new_text)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
            self._parts = [self._text_cache] if self._text_cache else []
        return self._text_cache
