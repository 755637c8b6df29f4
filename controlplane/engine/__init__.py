"""The inference engine: paged KV cache, continuous batching, chunked prefill, preemption."""

from controlplane.engine.async_engine import AsyncEngine
from controlplane.engine.engine import Engine, RequestOutput, StepStats
from controlplane.engine.errors import InvalidSettingError, ModelLoadError
from controlplane.engine.llm import LLM
from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.settings import EngineSettings, RestartRequiredError

__all__ = [
    "LLM",
    "AsyncEngine",
    "Engine",
    "EngineSettings",
    "InvalidSettingError",
    "ModelLoadError",
    "RequestOutput",
    "RestartRequiredError",
    "SamplingParams",
    "StepStats",
]
