"""Periodic background jobs: GPU telemetry and engine utilization sampling.

Light imports only (no torch, no pynvml at import time): the store imports the dataclasses
from here.
"""

from __future__ import annotations

from controlplane.jobs.gpu import GpuReading, GpuTelemetry
from controlplane.jobs.utilization import UtilizationSample, make_sample

__all__ = ["GpuReading", "GpuTelemetry", "UtilizationSample", "make_sample"]
