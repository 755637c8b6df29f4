"""`controlplane loadgen`: its flags, their parsing into a LoadConfig, Ctrl-C, and the report."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

from controlplane.client.loadgen.config import (
    DEFAULT_TOKEN_ID_RANGE,
    Interrupted,
    LoadConfig,
    LoadError,
    LoadSummary,
)
from controlplane.client.loadgen.run import run_load

# --------------------------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------------------------- #


def parse_range(text: str, flag: str, minimum: int = 1) -> tuple[int, int]:
    """'A-B' (or 'A') -> (A, B), with minimum <= A <= B; ValueError naming `flag` otherwise."""
    expected = f"{flag}: expected A-B with {minimum} <= A <= B, got {text!r}"
    parts = text.strip().split("-")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise ValueError(expected)
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(expected) from None
    if not minimum <= a <= b:
        raise ValueError(expected)
    return a, b


def parse_rate(text: str) -> float:
    """'inf' or '0' -> inf; a number > 0 -> itself; ValueError naming --rate otherwise."""
    expected = f"--rate: expected requests/s > 0, or inf or 0 (all at once), got {text!r}"
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(expected) from None
    if math.isnan(rate) or rate < 0:
        raise ValueError(expected)
    return math.inf if rate == 0 else rate


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """Build and validate the LoadConfig; ValueError naming the flag on bad input."""
    if args.duration is not None and args.requests is not None:
        raise ValueError("--duration / --requests: give one, not both")
    num_requests = args.requests
    if args.duration is None and num_requests is None:
        num_requests = 100
    url = args.url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    id_lo, id_hi = parse_range(args.token_id_range, "--token-id-range", minimum=0)
    if id_lo == id_hi:
        raise ValueError(
            f"--token-id-range: expected LO-HI with LO < HI, got {args.token_id_range!r}"
        )
    return LoadConfig(
        url=url,
        rate=parse_rate(args.rate),
        num_requests=num_requests,
        duration_s=args.duration,
        prompt_len=parse_range(args.prompt_len, "--prompt-len"),
        output_len=parse_range(args.output_len, "--output-len"),
        stream=args.stream,
        api_key=args.api_key,
        model=args.model,
        seed=args.seed,
        concurrency_limit=args.concurrency_limit,
        token_id_range=(id_lo, id_hi),
        timeout_s=args.timeout,
        stream_fraction=args.stream_fraction,
        disconnect_fraction=args.disconnect_fraction,
        disconnect_within_s=args.disconnect_within,
    ).validate()


async def _run_with_ctrl_c(config: LoadConfig) -> LoadSummary:
    """First Ctrl-C: stop sending, cancel what is in flight, return the partial summary. A second
    Ctrl-C cancels everything at once (KeyboardInterrupt-like exit, no summary)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def on_sigint() -> None:
        if stop.is_set() and main is not None:
            main.cancel()
        stop.set()

    installed = False
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    try:
        return await run_load(config, stop=stop, progress=True)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


def _cmd_loadgen(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"controlplane loadgen: error: {exc}", file=sys.stderr)
        return 2
    total = (
        f"{config.num_requests} requests"
        if config.num_requests is not None
        else f"{config.duration_s:g} s"
    )
    rate = "inf" if math.isinf(config.rate) else f"{config.rate:g}"
    print(
        f"loadgen: {total} at {rate} req/s to {config.url}, prompt {config.prompt_len[0]}-"
        f"{config.prompt_len[1]}, output {config.output_len[0]}-{config.output_len[1]} tokens"
        + (", streaming" if config.stream else ""),
        file=sys.stderr,
    )
    try:
        summary = asyncio.run(_run_with_ctrl_c(config))
    except (Interrupted, KeyboardInterrupt, asyncio.CancelledError):
        print("controlplane loadgen: interrupted", file=sys.stderr)
        return 130
    except LoadError as exc:
        print(f"controlplane loadgen: error: {exc}", file=sys.stderr)
        return 1
    print(summary.format())
    if args.json:
        Path(args.json).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return 0


def add_loadgen_parser(subparsers: Any) -> None:
    """Register the `loadgen` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "loadgen",
        help="drive a daemon's /v1/completions at a Poisson rate and report latency/throughput",
        description="Drive a daemon's /v1/completions with the openai client at a Poisson "
        "arrival rate and report throughput and TTFT / ITL / e2e latency percentiles. Ctrl-C "
        "stops and prints the partial summary.",
    )
    p.add_argument("--url", required=True, help="daemon base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--rate",
        default="inf",
        help="mean arrival rate in requests/s (Poisson); inf or 0 = all at once (default: inf)",
    )
    amount = p.add_mutually_exclusive_group()
    amount.add_argument(
        "--duration", type=float, metavar="S", help="send the arrivals of the first S seconds"
    )
    amount.add_argument("--requests", type=int, metavar="N", help="send N requests (default: 100)")
    p.add_argument(
        "--prompt-len", default="32-256", metavar="A-B", help="prompt tokens (default: 32-256)"
    )
    p.add_argument(
        "--output-len",
        default="16-128",
        metavar="C-D",
        help="max_tokens, EOS ignored (default: 16-128)",
    )
    p.add_argument("--stream", action="store_true", help="stream, and measure TTFT and ITL")
    p.add_argument("--api-key", metavar="K", help="bearer key (default: none)")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrivals seed (default: 0)")
    p.add_argument(
        "--concurrency-limit", type=int, metavar="M", help="at most M requests in flight"
    )
    p.add_argument(
        "--token-id-range",
        default=f"{DEFAULT_TOKEN_ID_RANGE[0]}-{DEFAULT_TOKEN_ID_RANGE[1]}",
        metavar="LO-HI",
        help="prompt token ids are drawn from [LO, HI) (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="per-request timeout in seconds (default: 600)",
    )
    p.add_argument(
        "--stream-fraction",
        type=float,
        metavar="F",
        help="stream a random share F of the requests (overrides --stream)",
    )
    p.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="a random share F of the clients hang up before the end (default: 0)",
    )
    p.add_argument(
        "--disconnect-within",
        type=float,
        default=2.0,
        metavar="S",
        help="a hanging-up client waits uniform [0, S] seconds first (default: 2)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    p.set_defaults(func=_cmd_loadgen)
