"""The parse cost of /v1 request bodies: the typed structs' pass (msgspec, then the rules the
hand parser keeps) against the hand parser alone as it was before it (commit 392cc42).

What is measured
----------------
From the raw bytes of a body to the parsed request (what the handler gets), in one process:

* ``old``: ``load_json`` (json.loads and the walk over every value for depth and lone
  surrogates), then ``parse_chat`` / ``parse_completion`` of ``controlplane/openai/protocol.py``
  at ``--baseline`` (read with ``git show``, imported from a temporary file);
* ``new``: ``protocol.parse_chat_bytes`` / ``parse_completion_bytes`` of the working tree.

Bodies: a typical chat request (system and user message, sampling fields, streaming), a typical
completion request (a 1 kB prompt), a large chat request (40 messages, about 100 kB, three tools)
and a large completion request (16 prompts of 512 token ids). Both parsers must return equal
requests for each body before it is timed. Figures: microseconds per parse (best of
``--repeats`` runs of ``--number`` parses, old and new interleaved) and old / new.

    python -m benchmarks.request_parse
    python -m benchmarks.request_parse --number 200 --repeats 3   # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from typing import Any

from benchmarks.at_commit import module_at
from controlplane.http.body import load_json
from controlplane.openai import protocol


def _words(n: int, seed: int) -> str:
    vocab = ["the", "model", "serves", "tokens", "quickly", "cache", "prefix", "batch", "of"]
    return " ".join(vocab[(i * 7 + seed) % len(vocab)] for i in range(n))


def bodies() -> dict[str, tuple[str, dict[str, Any]]]:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    }
    history = [{"role": "system", "content": _words(60, 0)}]
    for i in range(39):
        role = "user" if i % 2 == 0 else "assistant"
        history.append({"role": role, "content": _words(400, i)})
    return {
        "chat, typical": (
            "chat",
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": _words(80, 1)},
                ],
                "max_tokens": 256,
                "temperature": 0.7,
                "top_p": 0.95,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        "completion, typical": (
            "completion",
            {
                "model": "m",
                "prompt": _words(180, 2),
                "max_tokens": 128,
                "temperature": 0.8,
                "stop": ["\n\n"],
            },
        ),
        "chat, large (40 messages, 3 tools)": (
            "chat",
            {
                "model": "m",
                "messages": history,
                "tools": [
                    tool,
                    {**tool, "function": {**tool["function"], "name": "f2"}},
                    {**tool, "function": {**tool["function"], "name": "f3"}},
                ],
                "max_completion_tokens": 512,
                "temperature": 0.2,
            },
        ),
        "completion, large (16 x 512 token ids)": (
            "completion",
            {
                "model": "m",
                "prompt": [[(i * 31 + j) % 30000 + 100 for j in range(512)] for i in range(16)],
                "max_tokens": 16,
                "logprobs": 1,
            },
        ),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="392cc42", help="commit of the hand parser to compare")
    ap.add_argument("--number", type=int, default=2000, help="parses per run (large: / 20)")
    ap.add_argument("--repeats", type=int, default=7, help="runs per parser, best taken")
    args = ap.parse_args(argv)
    old = module_at(args.baseline, "controlplane/openai/protocol.py")
    print(f"python {sys.version.split()[0]}; baseline {args.baseline}; best of {args.repeats}")
    print(f"{'body':<40} {'bytes':>8} {'old us':>9} {'new us':>9} {'old/new':>8}")
    for name, (kind, body) in bodies().items():
        raw = json.dumps(body).encode()
        if kind == "chat":
            before = lambda raw=raw: old.parse_chat(load_json(raw))  # noqa: E731
            after = lambda raw=raw: protocol.parse_chat_bytes(raw)  # noqa: E731
        else:
            before = lambda raw=raw: old.parse_completion(load_json(raw))  # noqa: E731
            after = lambda raw=raw: protocol.parse_completion_bytes(raw)  # noqa: E731
        # The same request from both, field by field (their classes are two modules' own).
        assert repr(before()) == repr(after()).replace("protocol.", "protocol_old."), name
        number = args.number if len(raw) < 20_000 else max(1, args.number // 20)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.repeats):  # interleaved: a slower moment costs both alike
            times["old"].append(timeit.timeit(before, number=number) / number)
            times["new"].append(timeit.timeit(after, number=number) / number)
        o, n = min(times["old"]) * 1e6, min(times["new"]) * 1e6
        print(f"{name:<40} {len(raw):>8} {o:>9.1f} {n:>9.1f} {o / n:>7.2f}x")


if __name__ == "__main__":
    main()
