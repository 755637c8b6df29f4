"""The configuration file: TOML, one [engine] table mapped onto EngineSettings.

Torch-free on purpose: the CLI parses config without importing the engine.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

DEFAULT_DATA_DIR = "data"


def data_dir() -> Path:
    return Path(os.environ.get("CONTROLPLANE_DATA_DIR", DEFAULT_DATA_DIR))


def read_config(path: str | Path | None) -> dict[str, Any]:
    """Parsed TOML, or {} when no path is given. Errors name the file."""
    if path is None:
        return {}
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{p}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{p}: invalid TOML: {exc}") from None


def engine_settings(config: dict[str, Any], **overrides: Any):
    """EngineSettings from the [engine] table plus overrides, validated (naming the key)."""
    import dataclasses

    from controlplane.engine.errors import InvalidSettingError
    from controlplane.engine.settings import EngineSettings, check

    table = {**config.get("engine", {}), **{k: v for k, v in overrides.items() if v is not None}}
    known = EngineSettings.field_names()
    for key in table:
        if key not in known:
            raise InvalidSettingError(
                f"engine.{key}", f"unknown key; known keys: {', '.join(known)}"
            )
    return check(dataclasses.replace(EngineSettings(), **table))


def demo_model_path() -> Path:
    return data_dir() / "models" / "demo-small"
