"""`IncrementalDetokenizer` turns a stream of token ids into a stream of text without ever
emitting half a UTF-8 character, decoding only a short window of recent tokens per step."""

from __future__ import annotations

from typing import Any

# What a byte-level decoder produces for a byte sequence that is not (yet) valid UTF-8.
REPLACEMENT_CHAR = "\ufffd"


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

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, new_text: str) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
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
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids[self._prefix_offset :])
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if len(new_text) > len(self._prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            return self._emit(new_text)
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (U+FFFD included, if the bytes really are invalid)."""
        if self._read_offset >= len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
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
