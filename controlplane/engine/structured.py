"""Structured outputs: grammars that constrain what a request may sample.

A request's `StructuredOutput` (a JSON schema, any JSON object, a regex, a choice of strings
or a Lark / GBNF grammar) is compiled once by llguidance into a matcher over the model's
vocabulary; compiled grammars are kept in a bounded LRU cache (`Grammars`), keyed by the
spec's text. Each sequence gets its own copy of the matcher (its grammar state), which
follows the sequence through preemption, swapping and speculation, and is dropped when the
sequence ends.

Torch-free (the /v1 parser builds StructuredOutput); the per-step masks are in
controlplane.engine.grammar_mask. Why llguidance and not xgrammar: docs/structured-outputs.md,
"Why llguidance, not xgrammar".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controlplane.engine.errors import GrammarFailedError, InvalidSettingError

if TYPE_CHECKING:
    from controlplane.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON output without free whitespace: a sampled model at temperature 1 could otherwise pad
# forever; these separators are the ones models write (Python's json.dumps defaults).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own bounds on grammar work (it reports an error instead of running away); the
# compile timeout at the HTTP front bounds the wall time on top of these. step_max_items bounds
# one mask's Earley items, so one request's mask work per step: at llguidance's default (50,000)
# an ambiguous grammar (`x ::= x x | x x x | [a-z ]`) grew to 0.75 s a mask by token 80 and
# held every request's step; at 6,000 the ambiguous grammars of the probe are refused at
# compile time, one that grows slower fails part-way (a 400 naming its field) after a worst
# mask of 2.6 ms, while the 50 test schemas need < 1 ms a mask and a tool_choice over 1,000
# tools compiles (2,000 do not: OpenAI's own limit is 128).
PARSER_LIMITS = {
    "max_grammar_size": 200_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 6_000,
    "verbose_errors": False,
}


# The oldest llguidance that takes a list of EOS ids (LLTokenizer's eos_token): pyproject's
# bound, named again in the error a server with an older one answers (an H200 image carried
# 1.6.1 as a wheel, and every constrained request would have failed there).
LLGUIDANCE_MIN = (1, 7)


class GrammarEngineError(RuntimeError):
    """llguidance cannot serve this model on this server (it refused the vocabulary): every
    constrained request fails alike, through no fault of its own."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's output must match. `spec` is text: the schema as JSON, the regex, the
    choices as a JSON array, or the grammar; `field` names the request field it came from (for
    errors: "response_format", "guided_json", "tools[0].function.parameters", ...)."""

    kind: str
    spec: str
    field: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidSettingError("structured", f"kind must be one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str):
            raise InvalidSettingError(self.field, "the grammar spec must be text")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, field: str = "response_format") -> Any:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), field)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.spec


@dataclass(slots=True)
class CompiledGrammar:
    """A compiled grammar: a matcher in its start state, copied for each sequence."""

    output: StructuredOutput
    template: Any  # llguidance.LLMatcher, never advanced
    compile_s: float
    cached: bool = False  # this handle came from the cache (the compile happened earlier)

    def new_state(self) -> Any:
        return self.template.deep_copy()


@dataclass(slots=True)
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0


def _unavailable(exc: Exception) -> str:
    """What a constrained request is told when llguidance refused the vocabulary: its
    version, its words and, where it is older than LLGUIDANCE_MIN, the fix."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version("llguidance")
    except PackageNotFoundError:  # imported from a path, not installed
        have = "(version unknown)"
    return (
        f"structured outputs are unavailable on this server: llguidance {have} refused the "
        f"model's vocabulary ({type(exc).__name__}: {short_error(exc)})" + upgrade_hint(have)
    )


def upgrade_hint(have: str) -> str:
    """'; this server needs llguidance >= 1.7 (...)' where version `have` is older, else ''."""
    parts = tuple(int(p) for p in have.split(".")[:2] if p.isdigit())
    if len(parts) < 2 or parts >= LLGUIDANCE_MIN:
        return ""
    need = ".".join(map(str, LLGUIDANCE_MIN))
    return f"; this server needs llguidance >= {need} (pip install -U 'llguidance>={need}')"


def _grammar_text(out: StructuredOutput) -> str:
    import llguidance

    m = llguidance.LLMatcher
    if out.kind == "json_schema":
        return m.grammar_from_json_schema(out.spec, overrides=JSON_OPTIONS)
    if out.kind == "json_object":
        return m.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if out.kind == "regex":
        return m.grammar_from_regex(out.spec)
    if out.kind == "choice":
        return llguidance.grammar_from("choice", out.spec)
    return llguidance.grammar_from("grammar", out.spec)  # Lark, or GBNF converted to Lark


class Grammars:
    """The compiler and its LRU cache. Thread-safe: the HTTP front compiles in worker threads
    while the engine thread looks grammars up."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = 256) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.capacity = capacity
        self._lltok: Any = None
        self._lltok_error: str | None = None  # why llguidance refused the vocabulary, once
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self.stats = GrammarStats()

    def _llg_tokenizer(self) -> Any:
        # Built once (0.35 s for SmolLM2's 49k vocabulary): the daemon warms it in the
        # background when the model loads (`warm`), other callers on first use.
        with self._tok_lock:
            if self._lltok_error is not None:  # refused once: refused for good
                raise GrammarEngineError(self._lltok_error)
            if self._lltok is None:
                import llguidance

                tok = self._tokenizer
                try:
                    self._lltok = llguidance.LLTokenizer(
                        tok.backend.to_str(),
                        n_vocab=self._vocab_size,
                        eos_token=list(tok.eos_token_ids) or None,
                    )
                except Exception as exc:
                    self._lltok_error = _unavailable(exc)
                    raise GrammarEngineError(self._lltok_error) from exc
            return self._lltok

    def warm(self) -> None:
        try:
            self._llg_tokenizer()
        except GrammarEngineError as exc:  # each constrained request will answer the same
            log.error("%s", exc)

    def cached(self, out: StructuredOutput) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(out.key)
            if hit is not None:
                self._cache.move_to_end(out.key)
                self.stats.cache_hits += 1
                return CompiledGrammar(hit.output, hit.template, hit.compile_s, cached=True)
        return None

    def compile(self, out: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar, from the cache or compiled now (InvalidSettingError naming
        out.field if llguidance refuses it)."""
        hit = self.cached(out)
        if hit is not None:
            return hit
        import llguidance

        lltok = self._llg_tokenizer()
        t0 = time.perf_counter()
        try:
            text = _grammar_text(out)
            matcher = llguidance.LLMatcher(
                lltok, text, log_level=0, limits=llguidance.LLParserLimits(**PARSER_LIMITS)
            )
        except (ValueError, TypeError, RuntimeError) as exc:
            raise InvalidSettingError(
                out.field, f"cannot be compiled: {short_error(exc)}"
            ) from None
        # The first mask and the tokens the grammar forces too: llguidance builds parts of a
        # grammar lazily, and some schemas (hundreds of optional properties) fail only there,
        # as "parser too complex"; better a 400 now than a failed request later.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        forced = lltok.tokenize_bytes(probe.compute_ff_bytes())
        if forced:
            probe.consume_tokens(forced)
            probe.compute_bitmask()
        for m in (matcher, probe):
            if m.is_error():
                raise InvalidSettingError(
                    out.field, f"cannot be compiled: {short_error(m.get_error())}"
                )
        compiled = CompiledGrammar(out, matcher, time.perf_counter() - t0)
        with self._lock:
            self.stats.compiles += 1
            self._cache[out.key] = compiled
            self._cache.move_to_end(out.key)
            while len(self._cache) > max(self.capacity, 0):
                self._cache.popitem(last=False)
        return compiled


def grammar_failed(output: StructuredOutput, matcher: Any, num_tokens: int) -> GrammarFailedError:
    """What to raise when a request's grammar gives up after `num_tokens` output tokens."""
    return GrammarFailedError(
        output.field,
        f"the output could not follow this grammar after {num_tokens} tokens: "
        f"{short_error(matcher.get_error())}",
    )


def short_error(exc: object, limit: int = 300) -> str:
    text = str(exc).replace("<non-verbose/>", "").strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
