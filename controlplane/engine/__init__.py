"""The inference engine: paged KV cache, continuous batching, chunked prefill, preemption.

Names are imported lazily (PEP 562) so that torch-free modules such as
`controlplane.engine.settings` can be imported by the CLI, the TUI and the store without
paying for `import torch`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncEngine": "controlplane.engine.async_engine",
    "RequestStream": "controlplane.engine.async_engine",
    "Engine": "controlplane.engine.engine",
    "MemoryUse": "controlplane.engine.types",
    "RequestMetrics": "controlplane.engine.types",
    "RequestOutput": "controlplane.engine.types",
    "StepStats": "controlplane.engine.types",
    "TokenLogprobs": "controlplane.engine.types",
    "InvalidSettingError": "controlplane.engine.errors",
    "ModelLoadError": "controlplane.engine.errors",
    "LLM": "controlplane.engine.llm",
    "SamplingParams": "controlplane.engine.sampling_params",
    "EngineSettings": "controlplane.engine.settings",
    "RestartRequiredError": "controlplane.engine.settings",
}

__all__ = [  # noqa: RUF022 - grouped as in _EXPORTS
    "AsyncEngine",
    "RequestStream",
    "Engine",
    "MemoryUse",
    "RequestMetrics",
    "RequestOutput",
    "StepStats",
    "TokenLogprobs",
    "InvalidSettingError",
    "ModelLoadError",
    "LLM",
    "SamplingParams",
    "EngineSettings",
    "RestartRequiredError",
]

if TYPE_CHECKING:
    from controlplane.engine.async_engine import AsyncEngine, RequestStream
    from controlplane.engine.engine import Engine
    from controlplane.engine.errors import InvalidSettingError, ModelLoadError
    from controlplane.engine.llm import LLM
    from controlplane.engine.sampling_params import SamplingParams
    from controlplane.engine.settings import EngineSettings, RestartRequiredError
    from controlplane.engine.types import (
        MemoryUse,
        RequestMetrics,
        RequestOutput,
        StepStats,
        TokenLogprobs,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'controlplane.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
