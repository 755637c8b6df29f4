"""Where the built kernels and the compiled decode step's graphs are kept between runs.

torch keeps its C++ extension builds under `TORCH_EXTENSIONS_DIR` (default
`~/.cache/torch_extensions`) and inductor its compiled graphs under `TORCHINDUCTOR_CACHE_DIR`
(default `/tmp/torchinductor_<user>`): in a container both are lost with it, and /tmp may be
cleaned, so every restart rebuilt the kernels and served eagerly while the decode step
recompiled. The daemon points both under one directory of its own (`server.compile_cache_dir`,
default `<data_dir>/cache`) before torch compiles anything, so a restarted daemon or
container on the same volume starts warm. A variable the operator set wins (the Docker image
sets `TORCH_EXTENSIONS_DIR` to the kernels it ships).

Torch-free: the CLI calls it before the daemon imports torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

EXTENSIONS_VAR = "TORCH_EXTENSIONS_DIR"
INDUCTOR_VAR = "TORCHINDUCTOR_CACHE_DIR"
# Under the cache directory: one folder per variable.
SUBDIRS = {EXTENSIONS_VAR: "torch_extensions", INDUCTOR_VAR: "inductor"}


@dataclass(frozen=True, slots=True)
class Caches:
    """The directories in force, and which of them the environment gave (not ours)."""

    extensions: str
    inductor: str
    from_env: tuple[str, ...]

    def describe(self) -> str:
        given = f" ({', '.join(self.from_env)} from the environment)" if self.from_env else ""
        return f"kernel builds in {self.extensions}, compiled graphs in {self.inductor}{given}"


def cache_root(data_dir: str | Path, compile_cache_dir: str = "") -> Path:
    """server.compile_cache_dir, else `<data_dir>/cache`."""
    return Path(compile_cache_dir) if compile_cache_dir else Path(data_dir) / "cache"


def use_caches(root: Path, environ: MutableMapping[str, str] | None = None) -> Caches:
    """Point TORCH_EXTENSIONS_DIR and TORCHINDUCTOR_CACHE_DIR under `root` (absolute, created)
    unless `environ` (default: this process's) sets them already. Call it before torch builds
    or compiles anything: both are read when first used."""
    env = os.environ if environ is None else environ
    from_env = []
    for var, sub in SUBDIRS.items():
        if env.get(var):
            from_env.append(var)
            continue
        path = (root / sub).resolve()
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    return Caches(env[EXTENSIONS_VAR], env[INDUCTOR_VAR], tuple(from_env))
