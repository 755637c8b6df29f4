"""Chat templates, rendered the way transformers renders them (an immutable sandboxed jinja2
environment with `trim_blocks` and `lstrip_blocks`, the `raise_exception` and `strftime_now`
globals and a `tojson` filter that does not escape HTML), and the escape that keeps special-token
text inside messages from being read as special tokens."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from controlplane.engine.errors import ModelLoadError


def plain(value: Any) -> Any:
    """A copy of `value` made of plain JSON types, so templates never see callers' rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return f"<{type(value).__name__}>"


def compile_chat_template(source: str):
    """Compile a chat template in the environment transformers uses for chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks in
        # transformers; for rendering it is a no-op, but templates using it must still parse.
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        # Namespaces refuse underscore-prefixed attributes, as in transformers.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore-prefixed namespace attributes: {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


# Where the escape's marker character comes from: the private-use areas (the BMP's, then planes
# 15 and 16), first one the template and the special tokens do not use.
MARK_CANDIDATES = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))


class SpecialTokenEscape:
    """The escape of special-token text inside chat messages while the template renders.

    One marker character M, chosen once per tokenizer among those that occur in neither the
    template nor any special token (never from the messages, so no input can exhaust it),
    escapes the messages' text: the i-th special-token text becomes M + i + M, and M itself,
    if a message holds it, becomes M + len(specials) + M. Once hidden, the messages hold M only
    inside such groups and no special-token text at all (none contains M), and the template adds
    no M; so the special-token text of the rendered prompt is the template's own, and `restore`
    turns each group back into the text it stands for, which is then encoded as plain text.
    Works for any input: nothing depends on which characters the messages use.
    """

    def __init__(self, specials: Sequence[str], template: str | None) -> None:
        self.specials = list(specials)
        self.special_re = re.compile("|".join(re.escape(t) for t in self.specials))
        used = set(template or "").union(*self.specials)
        mark = next((chr(c) for r in MARK_CANDIDATES for c in r if chr(c) not in used), None)
        if mark is None:  # the template would have to hold 137,000 private-use characters
            raise ModelLoadError("chat template: no private-use character is free for escaping")
        self.mark = mark
        self._texts = [*self.specials, mark]
        # Longest first (self.specials is sorted so), then M: no special-token text contains M.
        self._hide_re = re.compile("|".join(re.escape(t) for t in self._texts))
        self._groups = {t: f"{mark}{i}{mark}" for i, t in enumerate(self._texts)}
        self._mark_re = re.compile(f"{re.escape(mark)}([0-9]+){re.escape(mark)}")

    def hide(self, value: Any) -> Any:
        """A copy of the messages with every special-token text (and M) replaced by its group."""
        if isinstance(value, str):
            # Without M (nearly always) the specials alone: their regex scans fast for their
            # common first character, which an alternative of one more character would defeat.
            pattern = self._hide_re if self.mark in value else self.special_re
            return pattern.sub(lambda m: self._groups[m.group()], value)
        if isinstance(value, Mapping):
            return {k: self.hide(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.hide(v) for v in value]
        return value

    def restore(self, text: str) -> str:
        if self.mark not in text:
            return text
        texts = self._texts

        def back(m: re.Match[str]) -> str:
            i = int(m.group(1))
            return texts[i] if i < len(texts) else m.group()

        return self._mark_re.sub(back, text)
