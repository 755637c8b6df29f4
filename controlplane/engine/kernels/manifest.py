"""The manifest each kernel build leaves beside its library: what it was built from (the
sources' hash, torch's version) and for (the compiler's -m flags, as the CPU features they may
use), so that a copy of the build directory, the Docker image's, loads where there is no
compiler to rebuild it, and only on a CPU that has those instructions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

NAME = "controlplane-build.json"

# -m flags whose /proc/cpuinfo name is not the flag's with dashes as underscores.
_CPUINFO_NAMES = {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16"}


def write(build_dir: Path, name: str, flags: list[str], sources: str) -> None:
    """Record the build `name` in `build_dir` (its library is `<name>.so` there)."""
    record = {
        "name": name,
        "library": f"{name}.so",
        "sources": sources,
        "torch": torch.__version__,
        "flags": flags,
        "cpu_flags": cpu_flags_needed(flags),
    }
    (build_dir / NAME).write_text(json.dumps(record, indent=1) + "\n")


def fitting(root: Path, sources: str) -> tuple[list[tuple[Path, dict[str, Any]]], list[str]]:
    """The builds under `root` that this process can load without compiling: of `sources`,
    for this torch, built for instructions this CPU has, the richest first (library path and
    manifest); and the names of every build with a manifest there."""
    have = cpu_flags()
    found: list[tuple[int, Path, dict[str, Any]]] = []
    seen = []
    for path in sorted(root.glob(f"controlplane_cpu_ops_*/{NAME}")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        seen.append(str(record.get("name", path.parent.name)))
        library = path.parent / str(record.get("library", ""))
        needed = set(record.get("cpu_flags", []))
        if (
            record.get("sources") == sources
            and record.get("torch") == torch.__version__
            and needed <= have
            and library.is_file()
        ):
            found.append((len(needed), library, record))
    found.sort(key=lambda entry: -entry[0])
    return [(library, record) for _, library, record in found], seen


def cpu_flags_needed(flags: list[str]) -> list[str]:
    """The CPU features (as /proc/cpuinfo names them) that code built with `flags` may use."""
    names = {f[2:] for f in flags if f.startswith("-m")}
    return sorted({_CPUINFO_NAMES.get(n, n.replace("-", "_")) for n in names})


def cpu_flags() -> set[str]:
    """This CPU's features from /proc/cpuinfo (Linux; elsewhere none, so only a build without
    -m flags fits)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
