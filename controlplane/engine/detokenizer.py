"""`IncrementalDetokenizer` turns a stream of token ids into a stream of text without ever
emitting half a UTF-8 character.

Two paths. A byte-level BPE (GPT-2's decoder: Llama 3, Qwen2, SmolLM2) maps each token to its
own bytes, and a text is those bytes read as UTF-8: there the detokenizer keeps each token's
bytes and feeds them to Python's incremental UTF-8 decoder, which holds an unfinished character
back by itself, so no token is ever decoded in a window. Any other decoder (SentencePiece's
Metaspace, byte fallback, WordPiece) gets the window of recent tokens decoded each step."""

from __future__ import annotations

import codecs
import weakref
from typing import Any

# What a byte-level decoder produces for a byte sequence that is not (yet) valid UTF-8.
REPLACEMENT_CHAR = "\ufffd"


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte: printable bytes stand for themselves,
    the others for the code points from 256 up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_ALPHABET = _gpt2_byte_alphabet()


def alphabet_bytes(piece: str) -> bytes | None:
    """A byte-level vocabulary string's bytes, read back through GPT-2's alphabet; None when a
    character of it is outside the alphabet (not a byte-level piece)."""
    try:
        return bytes(_ALPHABET[c] for c in piece)
    except KeyError:
        return None


# Per backend and skip_special_tokens: each token's text where its bytes are whole characters,
# else its bytes (byte-level backends); each token's text decoded alone (the others' window
# context). At most one entry per vocabulary entry; gone with the backend.
_TOKEN_BYTES: weakref.WeakKeyDictionary[
    Any, tuple[dict[int, str | bytes], dict[int, str | bytes]]
] = weakref.WeakKeyDictionary()
_ONE_TOKEN: weakref.WeakKeyDictionary[Any, tuple[dict[int, str], dict[int, str]]] = (
    weakref.WeakKeyDictionary()
)

# Whether a backend's decoder is byte-level, per backend.
_BYTE_LEVEL: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _byte_level(backend: Any) -> bool:
    """Whether `backend` decodes tokens as bytes joined, then read as UTF-8 (a `tokenizers`
    ByteLevel decoder, nothing else in its chain)."""
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


def _cache(table: weakref.WeakKeyDictionary[Any, Any], backend: Any, skip: bool) -> Any:
    try:
        caches = table.get(backend)
        if caches is None:
            caches = table[backend] = ({}, {})
    except TypeError:  # a backend without weak references: no cache
        return None
    return caches[skip]


def _whole_text(raw: bytes) -> str | bytes:
    """`raw` as text when it is whole characters (nothing held back after it: not ending in
    U+FFFD either), else as it is."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return raw
    return raw if text.endswith(REPLACEMENT_CHAR) else text


def token_bytes(backend: Any, token: int, skip: bool) -> bytes:
    """`token`'s own bytes under a byte-level decoder, as `tokenizers` joins them: a vocabulary
    string mapped back through the alphabet (a token whose string strays outside it, such as an
    added token with a space, stands for its UTF-8 bytes); a special token skipped, none.
    Checked against the token decoded alone, so a backend that disagrees still gets its own
    text for every token."""
    text = backend.decode([token], skip_special_tokens=skip)
    if not text:
        return b""
    piece = backend.id_to_token(token) or ""
    raw = alphabet_bytes(piece)
    if raw is None:
        raw = piece.encode()
    return raw if raw.decode("utf-8", "replace") == text else text.encode()


class IncrementalDetokenizer:
    """Streams text for a growing sequence of token ids.

    Byte-level backends: each token's bytes through an incremental UTF-8 decoder (an unfinished
    character waits inside it for its last byte). Others: the prefix-offset trick of vLLM/TGI,
    where the tokens in `[prefix_offset, read_offset)` are the last ones already emitted,
    decoded again only as context (so decoders that treat the start of a sequence specially,
    or merge bytes across tokens, give the right text), and everything from `read_offset` on is
    new. On both paths text is emitted only when it does not end in U+FFFD: a character whose
    bytes span several tokens comes out whole once its last byte arrives, and invalid bytes
    come out with the text that follows them (or at `flush`).
    """

    # Drop consumed ids once this many have piled up in front of the window.
    _COMPACT_AT = 1024

    def __init__(self, backend: Any, skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._parts: list[str] = []
        self._text_cache: str | None = ""
        # The byte-level path: per token, its text where its bytes are whole characters, else
        # its bytes; the UTF-8 decoder; text ending in U+FFFD held back for the next token;
        # whether neither holds anything (then a whole token's text is all it adds).
        self._by_token: dict[int, str | bytes] | None = None
        if _byte_level(backend):
            self._by_token = _cache(_TOKEN_BYTES, backend, skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""
        self._clean = True
        # The window path.
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text: str | None = ""
        self._one_token = _cache(_ONE_TOKEN, backend, skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete)."""
        by_token = self._by_token
        if by_token is None:
            return self._add_window(token_id)
        known = by_token.get(token_id)
        if known is None:
            known = by_token[token_id] = _whole_text(
                token_bytes(self._backend, int(token_id), self._skip)
            )
        if self._clean and known.__class__ is str:  # most tokens: their own text, as it is
            if known:
                self._parts.append(known)  # type: ignore[arg-type]
                self._text_cache = None
            return known  # type: ignore[return-value]
        return self._add_bytes(known.encode() if isinstance(known, str) else known)

    def flush(self) -> str:
        """Emit whatever is held back (U+FFFD included, if the bytes really are invalid)."""
        if self._by_token is not None:
            text, self._held = self._held + self._utf8.decode(b"", True), ""
            self._clean = True
            return self._append(text)
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

    def _append(self, text: str) -> str:
        if text:
            self._parts.append(text)
            self._text_cache = None
        return text

    def _add_bytes(self, raw: bytes) -> str:
        text = self._utf8.decode(raw)
        if self._held:
            text, self._held = self._held + text, ""
        if text and text[-1] == REPLACEMENT_CHAR:
            self._held = text
            self._clean = False
            return ""
        self._clean = not self._utf8.getstate()[0]
        return self._append(text)

    # -- the window path -----------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def _context_text(self) -> str:
        """The text of [prefix_offset, read_offset) decoded alone."""
        lo, hi = self._prefix_offset, self._read_offset
        cache = self._one_token
        if hi - lo != 1 or cache is None:
            return self._decode(self._ids[lo:hi])
        token = self._ids[lo]
        text = cache.get(token)
        if text is None:
            text = cache[token] = self._decode([token])
        return text

    def _add_window(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids[self._prefix_offset :])
        if self._prefix_text is None:
            self._prefix_text = self._context_text()
        if len(new_text) > len(self._prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            return self._emit(new_text)
        return ""

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
        return self._append(delta)
