"""Grammar engines for JSON-schema constrained decoding: xgrammar vs llguidance on this CPU.

Picks the library the server uses to turn ``response_format`` JSON schemas into per-step token
masks. Both run with the real SmolLM2 tokenizer (vocabulary 49,152, byte-level BPE, EOS
``<|im_end|>``) on the schemas of ``tests/json_schemas.generate_schemas(--schemas)``, with each
library's default JSON options (flexible whitespace, properties in schema order).

What is measured
----------------
* ``import_s`` / ``setup_s``: importing the library (in a fresh interpreter that has already
  imported torch), then building its tokenizer object once
  (llguidance: ``LLTokenizer(tokenizer JSON, n_vocab, eos_token)``; xgrammar:
  ``TokenizerInfo(encoded vocab, BYTE_LEVEL, vocab_size, stop_token_ids)`` from
  ``tok.backend``'s vocabulary with the special added tokens blanked, see below; the time of
  ``TokenizerInfo.from_huggingface`` on a ``PreTrainedTokenizerFast`` wrapper is printed too).
* ``compile``: per schema, cold, schema dict in, ready matcher out. llguidance:
  ``grammar_from_json_schema`` + ``LLMatcher(...)`` (it has no grammar cache); xgrammar: a
  fresh ``GrammarCompiler(info, cache_enabled=False)`` per schema + ``compile_json_schema`` +
  ``GrammarMatcher``. Engines alternate per schema. p50 / p99 / max, ms. ``first mask``: the
  first mask of the new matcher, computed alone (llguidance builds lexer states lazily, so
  ``compile + first mask`` is the fair time-to-first-token cost).
* ``step``: ``--batch`` (16) matchers for as many different schemas, each walking a valid
  instance (``sample_instance``, serialized by ``json.dumps`` with ``", "`` / ``": "``, which
  both grammars accept, checked first), tokenized with ``tok.encode(text,
  add_special_tokens=False)``, then EOS. Per step: one batched mask call for all rows
  (llguidance ``LLExecutor.unsafe_compute_mask_ptr``, the call ``fill_next_token_bitmask_par``
  makes, without importing ``llguidance.torch``: its module-level ``torch.compile`` costs
  seconds of import, printed as ``import_llguidance_torch_s``; xgrammar
  ``BatchGrammarMatcher.batch_fill_next_token_bitmask``, both with ``--threads`` threads),
  timed; then each row takes its instance's next token if the mask allows it, else the allowed
  token spelling the longest prefix of the rest of the text (re-tokenizing after it), else the
  lowest allowed id (``fallbacks`` counts these; 0 expected); then the batched accept
  (``consume_token_par`` / ``batch_accept_token``), timed separately. A row whose matcher
  stopped starts over on a new instance, so every step has the full batch; ``--steps`` (256)
  steps. Mean / p99 ms per batched step, and per row (= step / batch).
* ``apply``: applying a [batch, 49152] int32 bitmask to float32 logits with plain torch (unpack
  to bool, ``masked_fill_(~allowed, -inf)``), mean ms over 200 calls: ``torch_unpack`` shifts
  each int32 word by 0..31, ``torch_lut`` gathers the 8 bits of each byte from a [256, 8]
  table; xgrammar's CPU ``apply_token_bitmask_inplace`` for comparison. The p50 is printed
  too: torch's multi-threaded kernels swing by 5x or more when other work shares the CPUs.
* ``special tokens in strings``: how many of the special added tokens (ids 0-16) each engine
  allows inside a JSON string (must be 0: ``<|im_start|>`` is not text). xgrammar allows them
  all when ``TokenizerInfo`` gets the raw vocabulary, from ``from_huggingface`` too (it does
  not learn which added tokens are special); blanking them (``""``) makes xgrammar treat them
  as special, which is what the timed xgrammar rows use.

Figures to read, never timed assertions: the machine is shared. Compare rows of one run.

How to run
----------
    python -m benchmarks.grammar_engines                      # 50 schemas, batch 16, ~1 minute
    python -m benchmarks.grammar_engines --schemas 20 --batch 8 --steps 64
    python -m benchmarks.grammar_engines --json out.json

Prints progress on stderr, then a table, the special-token check, the mask-application times
and a one-line recommendation on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from controlplane.common import percentile
from tests.json_schemas import generate_schemas, sample_instance

VOCAB = 49152
WORDS = (VOCAB + 31) // 32
MAX_TOKENS_PER_INSTANCE = 400


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def import_seconds(modules: str) -> float:
    """Seconds to import `modules` in a fresh interpreter that has already imported torch."""
    code = (
        f"import time, torch; t = time.perf_counter(); import {modules}; "
        "print(time.perf_counter() - t)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def max_length(schema: Any) -> int:
    """The largest maxLength anywhere in a schema (0 if none)."""
    if isinstance(schema, dict):
        own = schema.get("maxLength", 0) if isinstance(schema.get("maxLength"), int) else 0
        return max([own] + [max_length(v) for v in schema.values()])
    if isinstance(schema, list):
        return max([0] + [max_length(v) for v in schema])
    return 0


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(tok: Any) -> list[bytes | None]:
    """The bytes each token id spells (None for the special added tokens)."""
    table = byte_level_table()
    special = {t.content for t in tok.backend.get_added_tokens_decoder().values() if t.special}
    out: list[bytes | None] = []
    for i in range(VOCAB):
        piece = tok.backend.id_to_token(i)
        out.append(None if piece is None or piece in special else bytes(table[c] for c in piece))
    return out


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


# Engines: the same five operations on both libraries.


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Any, eos: list[int], threads: int) -> None:
        # llguidance.torch is not imported: its module-level torch.compile decorator pulls in
        # inductor (seconds of import); fill() makes the same executor call it would.
        self.import_s = import_seconds("llguidance")
        self.ll = importlib.import_module("llguidance")
        t0 = time.perf_counter()
        self.tokenizer = self.ll.LLTokenizer(tok.backend.to_str(), n_vocab=VOCAB, eos_token=eos)
        self.setup_s = time.perf_counter() - t0
        self.executor = self.ll.LLExecutor(num_threads=threads)
        self.extra: dict[str, float] = {
            "import_llguidance_torch_s": import_seconds("llguidance.torch")
        }

    def compile(self, schema: dict) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {matcher.get_error()}")
        return matcher

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        # = llguidance.torch.fill_next_token_bitmask_par(executor, pairs, bitmask)
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(),
            bitmask.shape[1] * 4,
            bitmask.shape[0],
        )

    def accept(self, matchers: list[Any], tokens: list[int]) -> None:
        self.executor.consume_token_par(list(zip(matchers, tokens, strict=True)))
        for m in matchers:
            if m.is_error():
                raise RuntimeError(f"llguidance rejected a token it allowed: {m.get_error()}")

    def accept_text(self, matcher: Any, ids: list[int]) -> bool:
        return matcher.consume_tokens(ids) and not matcher.is_error()

    def done(self, matcher: Any) -> bool:
        return matcher.is_stopped()

    def reset(self, matcher: Any) -> None:
        matcher.reset()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Any, eos: list[int], threads: int) -> None:
        self.import_s = import_seconds("xgrammar")
        self.xg = importlib.import_module("xgrammar")
        self.threads = threads
        t0 = time.perf_counter()
        self.info = self.raw_info(tok, eos, blank_special=True)
        self.setup_s = time.perf_counter() - t0
        self.batch = self.xg.BatchGrammarMatcher(max_threads=threads)
        self.extra = {}
        try:
            t0 = time.perf_counter()
            transformers = importlib.import_module("transformers")
            wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
            self.hf_info = self.xg.TokenizerInfo.from_huggingface(
                wrapped, vocab_size=VOCAB, stop_token_ids=eos
            )
            self.extra["from_huggingface_s"] = time.perf_counter() - t0
        except Exception as exc:
            log(f"xgrammar: TokenizerInfo.from_huggingface failed: {exc!r}")
            self.hf_info = None

    def raw_info(self, tok: Any, eos: list[int], blank_special: bool) -> Any:
        """TokenizerInfo from the vocabulary; special added tokens blanked if asked."""
        special = set()
        if blank_special:
            decoder = tok.backend.get_added_tokens_decoder()
            special = {i for i, t in decoder.items() if t.special and i not in eos}
        vocab = ["" if i in special else tok.backend.id_to_token(i) for i in range(VOCAB)]
        return self.xg.TokenizerInfo(
            vocab,
            self.xg.VocabType.BYTE_LEVEL,
            vocab_size=VOCAB,
            stop_token_ids=eos,
            add_prefix_space=False,
        )

    def compile(self, schema: dict, info: Any = None) -> Any:
        compiler = self.xg.GrammarCompiler(
            info or self.info, max_threads=self.threads, cache_enabled=False
        )
        return self.xg.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list[Any], tokens: list[int]) -> None:
        ok = self.xg.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        if not all(ok):
            raise RuntimeError("xgrammar rejected a token it allowed")

    def accept_text(self, matcher: Any, ids: list[int]) -> bool:
        return all(matcher.accept_token(t) for t in ids)

    def done(self, matcher: Any) -> bool:
        return matcher.is_terminated()

    def reset(self, matcher: Any) -> None:
        matcher.reset()


# Measurements


def measure_compile(engines: list[Any], schemas: list[dict]) -> dict[str, dict[str, list]]:
    """Cold compile + first-mask times per schema, engines alternating order per schema."""
    out = {e.name: {"compile": [], "first_mask": []} for e in engines}
    bitmask = torch.zeros(1, WORDS, dtype=torch.int32)
    for e in engines:  # one-off lazy initialisation, not part of any schema's figure
        e.fill([e.compile({"type": "object"})], bitmask)
    for i, schema in enumerate(schemas):
        order = engines if i % 2 == 0 else engines[::-1]
        for e in order:
            t0 = time.perf_counter()
            matcher = e.compile(schema)
            t1 = time.perf_counter()
            e.fill([matcher], bitmask)
            t2 = time.perf_counter()
            out[e.name]["compile"].append((t1 - t0) * 1e3)
            out[e.name]["first_mask"].append((t2 - t1) * 1e3)
        if (i + 1) % 10 == 0 or i + 1 == len(schemas):
            log(f"compile: {i + 1}/{len(schemas)} schemas")
    return out


def check_serialization(engines: list[Any], tok: Any, schemas: list[dict], eos: int) -> str:
    """Which json.dumps separators every engine accepts for sample instances."""
    results = {}
    for label, seps in (("spaced", (", ", ": ")), ("compact", (",", ":"))):
        ok = True
        for i, schema in enumerate(schemas[:10]):
            text = json.dumps(sample_instance(schema, random.Random(i)), separators=seps)
            ids = [*tok.encode(text, add_special_tokens=False), eos]
            for e in engines:
                m = e.compile(schema)
                if not (e.accept_text(m, ids) and e.done(m)):
                    ok = False
                    log(f"{e.name} rejects {label} serialization of schema {i}: {text}")
        results[label] = ok
    log(f"serializations accepted by both: {results}")
    if not results["spaced"]:
        raise SystemExit("the grammars reject json.dumps output with ', ' / ': ' separators")
    return ", ".join(k for k, v in results.items() if v)


class Row:
    """One sequence of the batch: a schema, its matcher, and the text still to emit."""

    def __init__(self, engine: Any, schema: dict, seed: int, tok: Any) -> None:
        self.engine, self.schema, self.seed, self.tok = engine, schema, seed, tok
        self.matcher = engine.compile(schema)
        self.instances = 0
        self.new_instance()

    def new_instance(self) -> None:
        rng = random.Random(self.seed * 10_007 + self.instances)
        self.instances += 1
        self.rest = json.dumps(sample_instance(self.schema, rng)).encode()
        self.targets = self.tok.encode(self.rest.decode(), add_special_tokens=False)
        self.emitted = 0


def choose(
    row: Row,
    bitmask: torch.Tensor,
    index: int,
    vocab_bytes: list[bytes | None],
    by_bytes: dict[bytes, int],
    eos: int,
) -> tuple[int, bool]:
    """The row's next token under the mask, and whether it was a fallback."""
    if not row.rest:
        if allowed(bitmask, index, eos):
            return eos, False
    elif allowed(bitmask, index, row.targets[0]):
        token = row.targets.pop(0)
        row.rest = row.rest[len(vocab_bytes[token]) :]
        return token, False
    else:  # re-derive: the longest allowed token spelling a prefix of the rest of the text
        for n in range(min(len(row.rest), 64), 0, -1):
            token = by_bytes.get(row.rest[:n])
            if token is not None and allowed(bitmask, index, token):
                row.rest = row.rest[n:]
                row.targets = row.tok.encode(row.rest.decode(), add_special_tokens=False)
                return token, False
    bits = bitmask[index]
    for w in range(WORDS):
        word = int(bits[w])
        if word:
            low = (word & -word).bit_length() - 1
            row.rest, row.targets = b"", []  # off the instance: let the grammar lead
            return w * 32 + low, True
    raise RuntimeError(f"{row.engine.name}: empty mask")


def measure_steps(
    engine: Any,
    tok: Any,
    schemas: list[dict],
    batch: int,
    steps: int,
    vocab_bytes: list[bytes | None],
    by_bytes: dict[bytes, int],
    eos: int,
) -> dict[str, Any]:
    rows = [Row(engine, schemas[i % len(schemas)], i, tok) for i in range(batch)]
    matchers = [r.matcher for r in rows]
    bitmask = torch.zeros(batch, WORDS, dtype=torch.int32)
    fill_ms, accept_ms = [], []
    fallbacks = instances = tokens = 0
    for step in range(steps):
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        fill_ms.append((time.perf_counter() - t0) * 1e3)
        chosen = []
        for i, row in enumerate(rows):
            token, fell_back = choose(row, bitmask, i, vocab_bytes, by_bytes, eos)
            fallbacks += fell_back
            chosen.append(token)
        t0 = time.perf_counter()
        engine.accept(matchers, chosen)
        accept_ms.append((time.perf_counter() - t0) * 1e3)
        tokens += batch
        for row, token in zip(rows, chosen, strict=True):
            row.emitted += 1
            # Finished on EOS (llguidance reports "stopped" already after the closing brace,
            # xgrammar only after EOS: waiting for EOS keeps both on the same token path).
            if token == eos or row.emitted >= MAX_TOKENS_PER_INSTANCE:
                instances += 1
                engine.reset(row.matcher)
                row.new_instance()
        if (step + 1) % 64 == 0:
            log(f"{engine.name}: step {step + 1}/{steps}")
    return {
        "step_mean_ms": statistics.fmean(fill_ms),
        "step_p50_ms": percentile(fill_ms, 50),
        "step_p99_ms": percentile(fill_ms, 99),
        "row_mean_ms": statistics.fmean(fill_ms) / batch,
        "row_p99_ms": percentile(fill_ms, 99) / batch,
        "accept_mean_ms": statistics.fmean(accept_ms),
        "fallbacks": fallbacks,
        "instances_completed": instances,
        "tokens": tokens,
        "bitmask": bitmask,
    }


def measure_apply(bitmask: torch.Tensor, reps: int = 200) -> dict[str, float]:
    """Mean (and p50, steadier on a loaded machine) ms to mask [batch, VOCAB] logits."""
    batch = bitmask.shape[0]
    logits = torch.randn(batch, VOCAB, dtype=torch.float32)
    shifts = torch.arange(32, dtype=torch.int32)

    def apply_torch(x: torch.Tensor) -> None:
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1
        ok = bits.to(torch.bool).view(batch, WORDS * 32)[:, :VOCAB]
        x.masked_fill_(~ok, float("-inf"))

    # Little-endian byte -> its 8 bits: one gather instead of 32 shifts per word.
    lut = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).to(torch.bool)

    def apply_lut(x: torch.Tensor) -> None:
        ok = lut[bitmask.view(torch.uint8).long()].view(batch, WORDS * 32)[:, :VOCAB]
        x.masked_fill_(~ok, float("-inf"))

    out = {}
    contenders = [("torch_unpack_masked_fill", apply_torch), ("torch_lut_masked_fill", apply_lut)]
    try:
        xg = importlib.import_module("xgrammar")
        contenders.append(
            ("xgrammar_apply_cpu", lambda x: xg.apply_token_bitmask_inplace(x, bitmask))
        )
    except ImportError:
        pass
    reference = logits.clone()
    apply_torch(reference)
    for name, fn in contenders:
        x = logits.clone()
        try:
            fn(x)
        except Exception as exc:
            log(f"apply: {name} failed: {exc!r}")
            continue
        if not torch.equal(torch.isinf(x), torch.isinf(reference)):
            log(f"apply: {name} disagrees with the plain torch mask")
        times = []
        for _ in range(reps):
            x = logits.clone()
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.fmean(times)
        out[name + "_p50"] = percentile(times, 50)
    return out


def special_in_strings(engines: list[Any], tok: Any, eos: list[int]) -> dict[str, int]:
    """How many special added tokens each engine allows inside a JSON string."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    ids = tok.encode('{"name": "', add_special_tokens=False)
    special = [
        i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special and i not in eos
    ]
    bitmask = torch.zeros(1, WORDS, dtype=torch.int32)
    out = {}
    variants: list[tuple[str, Any, Any]] = [(e.name, e, None) for e in engines]
    for e in engines:
        if isinstance(e, XGrammar):
            variants.append(("xgrammar (raw vocab)", e, e.raw_info(tok, eos, blank_special=False)))
            if e.hf_info is not None:
                variants.append(("xgrammar (from_huggingface)", e, e.hf_info))
    for label, e, info in variants:
        m = e.compile(schema, info) if info is not None else e.compile(schema)
        assert e.accept_text(m, ids), label
        e.fill([m], bitmask)
        out[label] = sum(allowed(bitmask, 0, i) for i in special)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schemas", type=int, default=50, help="schemas to compile (default 50)")
    ap.add_argument("--batch", type=int, default=16, help="rows per mask step (default 16)")
    ap.add_argument("--steps", type=int, default=256, help="batched steps (default 256)")
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="mask threads for both engines (default: all CPUs)",
    )
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    from controlplane.engine.gguf.known import resolve_model_path
    from controlplane.engine.loader import load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(resolve_model_path("smollm2"))
    log(f"our tokenizer: {time.perf_counter() - t0:.2f}s (not counted below)")
    assert tok.backend.get_vocab_size() == VOCAB
    eos = sorted(tok.eos_token_ids)
    vocab_bytes = token_bytes(tok)
    by_bytes: dict[bytes, int] = {}
    for i, b in enumerate(vocab_bytes):
        if b is not None:
            by_bytes.setdefault(b, i)
    schemas = generate_schemas(args.schemas)

    engines = []
    for cls in (LLGuidance, XGrammar):
        e = cls(tok, eos, args.threads)
        log(f"{e.name}: import {e.import_s:.2f}s, tokenizer setup {e.setup_s:.3f}s {e.extra}")
        engines.append(e)

    seps = check_serialization(engines, tok, schemas, eos[0])
    compiled = measure_compile(engines, schemas)
    steps = {}
    for e in engines:
        steps[e.name] = measure_steps(
            e, tok, schemas, args.batch, args.steps, vocab_bytes, by_bytes, eos[0]
        )
    apply = measure_apply(steps[engines[0].name]["bitmask"])
    special = special_in_strings(engines, tok, eos)

    summary: dict[str, Any] = {
        "schemas": args.schemas,
        "batch": args.batch,
        "steps": args.steps,
        "threads": args.threads,
        "separators_accepted": seps,
        "engines": {},
        "apply_ms": apply,
        "special_tokens_in_strings": special,
    }
    print(
        f"\n{args.schemas} schemas, batch {args.batch}, {args.steps} steps, "
        f"{args.threads} mask threads, torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads); serializations accepted: {seps}"
    )
    head = (
        f"{'engine':<11} {'import_s':>8} {'setup_s':>7} | {'compile ms p50':>14} "
        f"{'p99':>6} {'max':>6} | {'1st mask p50':>12} {'max':>6} | "
        f"{'step ms mean':>12} {'p99':>6} | {'row ms mean':>11} {'p99':>6} | "
        f"{'accept ms':>9} {'fallbk':>6}"
    )
    print(head)
    print("-" * len(head))
    for e in engines:
        c, f, s = compiled[e.name]["compile"], compiled[e.name]["first_mask"], steps[e.name]
        fig = {
            "import_s": e.import_s,
            "setup_s": e.setup_s,
            **e.extra,
            "compile_p50_ms": percentile(c, 50),
            "compile_p99_ms": percentile(c, 99),
            "compile_max_ms": max(c),
            "first_mask_p50_ms": percentile(f, 50),
            "first_mask_max_ms": max(f),
            "compile_plus_first_mask_p50_ms": percentile(
                [a + b for a, b in zip(c, f, strict=True)], 50
            ),
            **{k: v for k, v in s.items() if k != "bitmask"},
        }
        summary["engines"][e.name] = fig
        print(
            f"{e.name:<11} {e.import_s:>8.2f} {e.setup_s:>7.3f} | {fig['compile_p50_ms']:>14.2f} "
            f"{fig['compile_p99_ms']:>6.1f} {fig['compile_max_ms']:>6.1f} | "
            f"{fig['first_mask_p50_ms']:>12.3f} {fig['first_mask_max_ms']:>6.2f} | "
            f"{s['step_mean_ms']:>12.3f} {s['step_p99_ms']:>6.2f} | "
            f"{s['row_mean_ms']:>11.4f} {s['row_p99_ms']:>6.3f} | "
            f"{s['accept_mean_ms']:>9.3f} {s['fallbacks']:>6}"
        )
    ll_torch = summary["engines"].get("llguidance", {}).get("import_llguidance_torch_s")
    if ll_torch is not None:
        print(f"import llguidance.torch (not needed; torch.compile at import): {ll_torch:.2f}s")
    if "from_huggingface_s" in summary["engines"].get("xgrammar", {}):
        print(
            f"xgrammar TokenizerInfo.from_huggingface (PreTrainedTokenizerFast wrapper): "
            f"{summary['engines']['xgrammar']['from_huggingface_s']:.3f}s"
        )
    for e in engines:
        c = compiled[e.name]["compile"]
        slow = sorted(range(len(c)), key=lambda i: -c[i])[:3]
        print(
            f"slowest {e.name} compiles: "
            + ", ".join(
                f"schema {i} {c[i]:.1f} ms (maxLength {max_length(schemas[i]) or '-'})"
                for i in slow
            )
        )
    print(
        "tokens per engine: "
        + ", ".join(
            f"{n} {steps[n]['tokens']} ({steps[n]['instances_completed']} instances completed)"
            for n in steps
        )
    )
    print(
        f"apply [{args.batch}, {VOCAB}] bitmask to float32 logits, mean ms: "
        + ", ".join(
            f"{k} {v:.3f} (p50 {apply[k + '_p50']:.3f})"
            for k, v in apply.items()
            if not k.endswith("_p50")
        )
    )
    print(
        "special tokens (ids 0-16 but EOS) allowed inside a JSON string: "
        + ", ".join(f"{k} {v}" for k, v in special.items())
    )

    # Grammar work for one request: compile + first mask, then ~100 tokens at the batch's
    # per-row mask cost plus its share of the accept.
    cost = {
        n: f["compile_plus_first_mask_p50_ms"]
        + 100 * (f["row_mean_ms"] + f["accept_mean_ms"] / args.batch)
        for n, f in summary["engines"].items()
    }
    best = min(cost, key=cost.get)
    other = max(cost, key=cost.get)
    summary["per_100_token_request_ms"] = cost
    print(
        f"recommendation: {best} (grammar CPU work per 100-token request at batch "
        f"{args.batch}: {cost[best]:.1f} ms vs {other} {cost[other]:.1f} ms; compile p99 "
        f"{summary['engines'][best]['compile_p99_ms']:.1f} vs "
        f"{summary['engines'][other]['compile_p99_ms']:.1f} ms)"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
