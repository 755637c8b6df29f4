"""Engine settings given on a benchmark's command line (`--engine compile=on,dtype=float32`).

Its own module: the benchmarks that take `--engine` import each other for other helpers, and
decode_latency.py sits under them all."""

from __future__ import annotations

from typing import Any


def parse_overrides(text: str) -> dict[str, Any]:
    """`compile=on,dtype=float32` -> engine settings (ints, booleans and strings)."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = (
            int(value) if value.isdigit() else {"true": True, "false": False}.get(value, value)
        )
    return out
