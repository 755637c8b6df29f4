"""One module of the package as it was at a commit, for benchmarks that time the code a change
replaced against the working tree's in one process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def module_at(commit: str, path: str) -> ModuleType:
    """`path` (relative to the repository) as it was at `commit`, imported as a module of its
    own (named after the file, with `_at_` and the commit)."""
    shown = subprocess.run(
        ["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True
    )
    if shown.returncode:
        raise SystemExit(f"--baseline {commit}: {shown.stderr.strip()}")
    source = shown.stdout
    name = f"{Path(path).stem}_at_{commit.replace('~', '_').replace('^', '_')}"
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it is built
    spec.loader.exec_module(module)
    return module
