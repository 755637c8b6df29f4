"""Tokenizer wrapper on the `tokenizers` library, with chat templates rendered by jinja2.

`Tokenizer.from_dir` reads a Hugging Face model directory (tokenizer.json, and optionally
tokenizer_config.json, config.json and generation_config.json) without importing transformers.
Chat templates: controlplane.engine.chat_template.

Streaming text out of token ids: controlplane.engine.detokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from controlplane.engine.chat_template import SpecialTokenEscape, compile_chat_template, plain
from controlplane.engine.detokenizer import IncrementalDetokenizer, alphabet_bytes
from controlplane.engine.errors import ModelLoadError

# tokenizer_config.json keys that transformers hands to chat templates (its special_tokens_map).
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None if there is no such file, ModelLoadError if not JSON."""
    if not path.is_file():
        return None
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_ids(value: Any) -> list[int]:
    """An `eos_token_id`-style value (int, list of ints or null) as a list of ints."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """A Hugging Face fast tokenizer (tokenizer.json) plus its special tokens and chat template."""

    def __init__(
        self,
        backend: Any,
        *,
        config: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        source: str = "tokenizer_config.json",
    ) -> None:
        """`backend` is a `tokenizers.Tokenizer`; the mappings are the parsed JSON files."""
        config = dict(config or {})
        model_config = dict(model_config or {})
        generation_config = dict(generation_config or {})
        self._backend = backend
        self._config_source = source
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                self.special_tokens[key] = content
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")

        bos_id = backend.token_to_id(self.bos_token) if self.bos_token is not None else None
        if bos_id is None:
            for cfg in (model_config, generation_config):
                ids = _int_ids(cfg.get("bos_token_id"))
                if ids:
                    bos_id = ids[0]
                    break
        self.bos_token_id: int | None = bos_id

        eos: set[int] = set()
        if self.eos_token is not None:
            eos_id = backend.token_to_id(self.eos_token)
            if eos_id is not None:
                eos.add(eos_id)
        eos.update(_int_ids(model_config.get("eos_token_id")))
        eos.update(_int_ids(generation_config.get("eos_token_id")))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

        # What tokenizer.json's post-processor does on its own, probed once.
        with_special = backend.encode("a", add_special_tokens=True).ids
        without = backend.encode("a", add_special_tokens=False).ids
        self._post_processor_adds_bos = (
            self.bos_token_id is not None
            and len(with_special) > len(without)
            and with_special[0] == self.bos_token_id
        )
        add_bos = config.get("add_bos_token")
        if isinstance(add_bos, bool):
            self.add_bos_token: bool = add_bos and self.bos_token_id is not None
        else:
            self.add_bos_token = self._post_processor_adds_bos

        template = config.get("chat_template", chat_template)
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            if "default" not in named:
                raise ModelLoadError(
                    f"{source}: 'chat_template' is a list without a template named 'default' "
                    f"(names: {sorted(str(n) for n in named)})"
                )
            template = named["default"]
        if template is not None and not isinstance(template, str):
            raise ModelLoadError(f"{source}: 'chat_template' must be a string or a list")
        self.chat_template: str | None = template
        self._compiled_template = None
        # Special tokens as text (longest first, so a regex alternation prefers the longest), and
        # a copy of the backend that reads them as plain text: built on first escaped chat.
        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        self.special_token_texts: tuple[str, ...] = tuple(sorted(specials, key=len, reverse=True))
        self._plain_backend: Any = None
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        self._byte_level: bool | None = None  # token_bytes, found on first use
        self._marks: SpecialTokenEscape | None = (
            None  # the escape (encode_chat), built on first use
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json (required) and the optional config files from a model directory."""
        from tokenizers import Tokenizer as BackendTokenizer

        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{tokenizer_file}: tokenizer file not found")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"{tokenizer_file}: cannot load tokenizer: {e}") from e

        config_file = model_dir / "tokenizer_config.json"
        config = _read_json(config_file) or {}
        chat_template = None
        jinja_file = model_dir / "chat_template.jinja"
        if "chat_template" not in config and jinja_file.is_file():
            # Newer transformers versions save the template next to tokenizer_config.json.
            chat_template = jinja_file.read_text(encoding="utf-8")
        return cls(
            backend,
            config=config,
            model_config=_read_json(model_dir / "config.json"),
            generation_config=_read_json(model_dir / "generation_config.json"),
            chat_template=chat_template,
            source=str(config_file),
        )

    @property
    def backend(self) -> Any:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = _encode(self._backend, text, add_special_tokens)
        if add_special_tokens and self.add_bos_token != self._post_processor_adds_bos:
            if self.add_bos_token:
                ids = [self.bos_token_id, *ids]
            elif ids and ids[0] == self.bos_token_id:
                ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Render the chat template to a prompt string (which already holds any bos token, so
        encode it with `add_special_tokens=False`). Template errors, including the template's
        own `raise_exception(...)`, come out as ValueError. `continue_final_message`: the
        prompt ends right after the last message's text (its end-of-turn cut off), as in
        transformers, so the model continues that message."""
        import jinja2

        if self.chat_template is None:
            raise ValueError(
                f"{self._config_source} has no 'chat_template': this model has no chat template, "
                "so it can only serve plain completions"
            )
        if self._compiled_template is None:
            try:
                self._compiled_template = compile_chat_template(self.chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"{self._config_source}: invalid 'chat_template': {e}") from e

        # Like transformers: keys whose value is None are dropped, since many templates test
        # `is defined` rather than `is none`.
        chat = [
            {k: v for k, v in plain(message).items() if v is not None}
            for message in messages
            if isinstance(message, Mapping)
        ]
        if len(chat) != len(messages):
            raise ValueError("chat messages must be objects")
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update({k: plain(v) for k, v in extra.items()})
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        variables["messages"] = chat
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            text = self._compiled_template.render(**variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e
        if continue_final_message:
            final = chat[-1].get("content") if chat else None
            final = final.strip() if isinstance(final, str) else ""
            if not final or final not in text:
                raise ValueError(
                    "continue_final_message: the final message's text does not appear in the "
                    "rendered chat"
                )
            text = text[: text.rindex(final) + len(final)]
        return text

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        escape: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> list[int]:
        """Token ids of the rendered chat template (which holds any bos token itself).

        `escape`: special-token text inside the messages (`<|eot_id|>` typed by a user) is
        tokenized as the plain text it is, so a message cannot forge the template's control
        tokens (end its turn, open a system turn); only the template's own special tokens are
        control tokens. Without it, the rendered text is encoded as a whole (transformers'
        behaviour). Template errors come out as ValueError, as in `apply_chat_template`.
        `extra`: more template variables (`tools`), escaped like the messages.
        """
        if not escape or not self.special_token_texts:
            text = self.apply_chat_template(
                messages,
                add_generation_prompt,
                continue_final_message=continue_final_message,
                **extra,
            )
            return self.encode(text, add_special_tokens=False)
        if self._marks is None:
            self._marks = SpecialTokenEscape(self.special_token_texts, self.chat_template)
        marks = self._marks
        text = self.apply_chat_template(
            marks.hide(messages),
            add_generation_prompt,
            continue_final_message=continue_final_message,
            **marks.hide(extra),
        )
        return self._encode_marked(text, marks)

    def _encode_marked(self, text: str, marks: SpecialTokenEscape) -> list[int]:
        # The library splits text at special tokens and encodes the pieces in between on their
        # own; doing the same split here, with the messages' special text restored inside the
        # pieces and read by a backend that treats it as text, gives the same ids as `encode`
        # wherever the messages hold no special-token text.
        if self._plain_backend is None:
            from tokenizers import Tokenizer as BackendTokenizer

            plain = BackendTokenizer.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        ids: list[int] = []
        pos = 0
        for m in [*marks.special_re.finditer(text), None]:
            end = len(text) if m is None else m.start()
            if end > pos:
                ids += _encode(self._plain_backend, marks.restore(text[pos:end]), False)
            if m is not None:
                ids.append(self._backend.token_to_id(m.group()))
                pos = m.end()
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (logprobs' `bytes`): for a byte-level BPE (GPT-2, Llama 3,
        SmolLM2, Qwen) its vocabulary string mapped back through the byte alphabet, so a token
        that is part of a multi-byte character gives its raw bytes, not U+FFFD's; `<0xNN>`
        byte-fallback pieces their byte; added tokens and other models' pieces their text."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level is None:
            self._byte_level = _has_byte_level_decoder(self._backend)
        if self._byte_level and (raw := alphabet_bytes(piece)) is not None:
            return raw  # else not a byte-level piece after all
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._backend, skip_special_tokens=skip_special_tokens)


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _has_byte_level_decoder(backend: Any) -> bool:
    """Whether the tokenizer decodes with ByteLevel (alone or in a sequence of decoders)."""
    spec = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {spec.get("type")} | {d.get("type") for d in spec.get("decoders") or ()}
    return "ByteLevel" in kinds


# Texts at least this long are encoded with `encode_batch`, which releases the GIL (`encode`
# holds it): a megabyte prompt tokenized in a worker thread then leaves the event loop free.
_RELEASE_GIL_CHARS = 4096


def _encode(backend: Any, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) < _RELEASE_GIL_CHARS:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
