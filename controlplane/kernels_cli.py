"""`controlplane kernels build` and `controlplane kernels status`: the C++ CPU kernels built on
purpose, and what loaded on this machine and why not.

Both find the caches as `controlplane serve` does (the same --config, --data-dir and
environment: server.compile_cache_dir, else <data_dir>/cache, unless TORCH_EXTENSIONS_DIR is
set), so what `build` leaves there is what the daemon loads. torch is imported in the
commands, never while the arguments are parsed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from controlplane.engine.kernels.caches import Caches, cache_root, use_caches

# How long `status` waits for another process's build in progress before it says so.
STATUS_LOCK_WAIT_S = 5.0


def add_kernels_parser(sub: Any) -> None:
    kernels = sub.add_parser(
        "kernels", help="build the C++ CPU kernels for this machine, or say which loaded"
    )
    actions = kernels.add_subparsers(dest="kernels_command", required=True)
    for name, func, text in (
        (
            "build",
            _cmd_build,
            "build (or load the cached build of) the kernels for this CPU, with the compiler's "
            "output; exit 1 naming the error when the build fails",
        ),
        (
            "status",
            _cmd_status,
            "which kernels load here and why not (never builds); exit 1 when they do not load",
        ),
    ):
        p = actions.add_parser(name, help=text)
        p.add_argument("--config", help="TOML config file (server.compile_cache_dir, data_dir)")
        p.add_argument("--data-dir", help="data_dir (the caches are under <data_dir>/cache)")
        if name == "status":
            p.add_argument("--json", action="store_true", help="print one JSON object")
        else:
            p.add_argument(
                "--ship",
                metavar="DIR",
                help="also copy the built library and its manifest into DIR (an image's "
                "CONTROLPLANE_KERNELS_DIR: loaded there without a build)",
            )
        p.set_defaults(func=func)


def _caches(args: argparse.Namespace) -> Caches:
    import os

    from controlplane.config import build_config, read_toml

    file_raw = read_toml(args.config) if args.config else {}
    overrides = {"data_dir": args.data_dir} if args.data_dir is not None else {}
    cfg = build_config(file_raw, os.environ, overrides=overrides)
    return use_caches(cache_root(cfg.data_path, cfg.server.compile_cache_dir))


def _cmd_build(args: argparse.Namespace) -> int:
    import logging
    import time

    caches = _caches(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(f"kernels: {caches.describe()}", flush=True)
    from controlplane.engine.kernels import cpu_ops

    missing = cpu_ops.toolchain_missing()
    if not missing:
        name, flags = cpu_ops.build_spec()
        print(f"kernels: building {name} ({' '.join(flags)})", flush=True)
    cpu_ops.configure(verbose=True)
    started = time.perf_counter()
    if not cpu_ops.available():
        print(f"controlplane: kernels: build failed: {cpu_ops.build_error()}", file=sys.stderr)
        return 1
    info = cpu_ops.describe()
    print(
        f"kernels: ok in {time.perf_counter() - started:.1f} s: {info['library']} in "
        f"{info['build_dir']} ({info['loaded']})"
    )
    if args.ship:
        print(f"kernels: shipped to {ship(Path(str(info['build_dir'])), Path(args.ship))}")
    return 0


def ship(build_dir: Path, to: Path) -> Path:
    """Copy a build's library and manifest (not its objects or ninja files) into
    `to/<build name>/`: what an image ships and CONTROLPLANE_KERNELS_DIR loads."""
    import shutil

    from controlplane.engine.kernels import manifest

    dest = to / build_dir.name
    dest.mkdir(parents=True, exist_ok=True)
    for name in (f"{build_dir.name}.so", manifest.NAME):
        shutil.copy2(build_dir / name, dest / name)
    return dest


def _cmd_status(args: argparse.Namespace) -> int:
    caches = _caches(args)
    from controlplane.engine.kernels import cpu_ops

    try:
        library, why = cpu_ops.find_build()
    except Exception as exc:  # no compiler for inductor's ISA probe, say
        library, why = None, f"{type(exc).__name__}: {exc}"
    # Load only what is built: status never starts a minute-long build, and waits only
    # briefly for a build in progress (a daemon's) that holds the lock.
    cpu_ops.configure(lock_wait_s=STATUS_LOCK_WAIT_S)
    ok = library is not None and cpu_ops.available()
    info: dict[str, Any] = cpu_ops.describe()
    if library is None:
        info["state"], info["reason"] = "not_built", why
    info["kernels"] = "ok" if ok else f"fallback: {info['reason'] or why}"
    info["inductor_cache_dir"] = caches.inductor
    info["from_env"] = list(caches.from_env)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0 if ok else 1
    rows = [
        ("kernels", info["kernels"]),
        ("state", info["state"]),
        ("isa", info["isa"] or "-"),
        ("cpu capability", info["cpu_capability"]),
        ("bf16 dot", "yes" if info["bf16_dot"] else "no"),
        ("loaded", info["loaded"] or "-"),
        ("build dir", info["build_dir"] or "-"),
        ("shipped builds dir", info["shipped_dir"] or "- (CONTROLPLANE_KERNELS_DIR unset)"),
        ("extensions dir", info["extensions_dir"]),
        ("inductor cache dir", caches.inductor),
        (
            "toolchain",
            "c++ and ninja found"
            if not info["toolchain_missing"]
            else "missing " + ", ".join(info["toolchain_missing"]),
        ),
    ]
    if caches.from_env:
        rows.append(("from the environment", ", ".join(caches.from_env)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0 if ok else 1
