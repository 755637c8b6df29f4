"""controlplane: serve, load-test and inspect an LLM inference engine you can retune live."""

# Keep torch out of module scope: argument parsing and torch-free commands must be instant.

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from controlplane.engine.demo_model import write_demo_model

    path = write_demo_model(args.dir, size=args.size)
    print(f"wrote {args.size} demo model to {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import dataclasses
    import logging
    import time

    from controlplane.config import load_config, serving_settings

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = load_config(args.config)
    settings = cfg.engine
    if args.model:
        settings = dataclasses.replace(settings, model=args.model)
    if args.dtype:
        settings = dataclasses.replace(settings, dtype=args.dtype)
    settings = serving_settings(cfg, settings)
    from controlplane.engine import LLM, SamplingParams

    llm = LLM(settings.model, settings)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    t0 = time.perf_counter()
    outs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    wall = time.perf_counter() - t0
    for out in outs:
        print(f"--- {out.request_id} ({out.finish_reason}, {len(out.token_ids)} tokens)")
        print(out.text)
    tokens = sum(len(o.token_ids) for o in outs)
    print(
        f"--- {len(outs)} requests, {tokens} tokens in {wall:.2f}s ({tokens / wall:.1f} tokens/s)"
    )
    return 0


def _check_data_dir(path: Path) -> None:
    """The daemon writes its instance id, admin token, journal (and SQLite file) here: one line
    naming the directory and the user when it cannot, not a traceback from the first write.
    ValueError: exit 2, as for a bad config (restarting cannot fix it; chown or data_dir can)."""
    import os
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        uid = os.geteuid()
        try:
            import pwd

            user = f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
        except (ImportError, KeyError):
            user = f"uid {uid}"
        reason = exc.strerror or str(exc)
        if isinstance(exc, FileExistsError | NotADirectoryError):
            reason = "a file is in the way (not a directory)"
        raise ValueError(
            f"data directory {path} is not writable by user {user}: {reason}; make it writable "
            "by that user (the image's user is uid 10001: chown the volume to it) or set data_dir "
            "(--data-dir, CONTROLPLANE_DATA_DIR)"
        ) from None


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    from controlplane.config import build_config, read_toml
    from controlplane.runtime.logs import setup_logging

    file_raw = read_toml(args.config) if args.config else {}
    # Flags win over the file and the environment, and are validated like them.
    flags: dict[str, Any] = {}
    for name, section, key in (
        ("host", "server", "host"),
        ("port", "server", "port"),
        ("log_level", "server", "log_level"),
        ("model", "engine", "model"),
    ):
        if getattr(args, name) is not None:
            flags.setdefault(section, {})[key] = getattr(args, name)
    if args.data_dir is not None:
        flags["data_dir"] = args.data_dir
    cfg = build_config(file_raw, os.environ, overrides=flags)
    setup_logging(cfg.server.log_format, cfg.server.log_level)
    _check_data_dir(cfg.data_path)
    from controlplane.engine.kernels.caches import cache_root, use_caches

    # Before torch builds or compiles anything: both caches are read when first used.
    caches = use_caches(cache_root(cfg.data_path, cfg.server.compile_cache_dir))
    logging.getLogger("controlplane.daemon").info("caches: %s", caches.describe())

    async def run() -> int:
        from controlplane.daemon import Daemon

        return await Daemon(cfg, config_path=args.config, file_raw=file_raw).serve()

    return asyncio.run(run())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="controlplane", description=__doc__)
    try:
        installed = version("controlplane")
    except PackageNotFoundError:  # run from a checkout that was never installed
        installed = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"controlplane {installed}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="run the daemon: OpenAI-compatible API, request records in SQL"
    )
    serve.add_argument("--config", help="TOML config file (default: embedded defaults)")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 8000; 0 picks a free one)")
    serve.add_argument(
        "--model",
        help="model directory, .gguf file or smollm2 (engine.model; default: SmolLM2 "
        "if installed, else the demo model)",
    )
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error", "critical"],
        help="server.log_level (default info)",
    )
    serve.add_argument("--data-dir", help="data_dir: SQLite file, journal, admin token, demo model")
    serve.set_defaults(func=_cmd_serve)

    from controlplane.client.loadgen import add_loadgen_parser

    add_loadgen_parser(sub)

    from controlplane.planning.commands import (
        add_calibrate_parser,
        add_plan_parser,
        add_replay_parser,
    )

    add_replay_parser(sub)
    add_calibrate_parser(sub)
    add_plan_parser(sub)

    from controlplane.store.cli import add_db_parser

    add_db_parser(sub)

    from controlplane.accounting.cli import add_report_parser

    add_report_parser(sub)

    from controlplane.fleet.cli import add_fleet_parser

    add_fleet_parser(sub)

    from controlplane.client.config_cli import add_config_parser

    add_config_parser(sub)

    from controlplane.client.keys_cli import add_keys_parser

    add_keys_parser(sub)

    from controlplane.tui import add_tui_parser

    add_tui_parser(sub)

    from controlplane.kernels_cli import add_kernels_parser

    add_kernels_parser(sub)

    demo = sub.add_parser("demo-model", help="write a deterministic random-weight Llama checkpoint")
    demo.add_argument("dir", help="output directory (created if missing)")
    demo.add_argument("--size", choices=["tiny", "small"], default="small")
    demo.set_defaults(func=_cmd_demo_model)

    gen = sub.add_parser(
        "generate", help="run prompts through the engine offline and print the text"
    )
    gen.add_argument("prompts", nargs="+", help="prompt strings")
    gen.add_argument("--config", help="TOML config file (its [engine] table is used)")
    gen.add_argument(
        "--model",
        help="model directory, .gguf file or smollm2 (default: SmolLM2 if installed, else the demo model)",
    )
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported lazily like everything else here, but cheap: no torch, no SQLAlchemy engine.
    from controlplane.store.db import StoreUnavailableError

    try:
        return args.func(args)
    except ValueError as exc:  # bad config or input: one clear line, not a traceback
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailableError as exc:  # no driver, database unreachable: the same
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
