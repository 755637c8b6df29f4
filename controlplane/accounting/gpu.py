"""GPU telemetry through NVML (the ``pynvml`` module of the ``nvidia-ml-py`` package).

`GpuTelemetry` initialises NVML lazily, on first use. Where NVML can't be had (module missing,
no driver / shared library, no GPU) telemetry is off: one info line says why, and it is never
retried. Per-device queries that fail (typically ``NVML_ERROR_NOT_SUPPORTED`` for power or
energy on consumer boards, MIG instances or vGPUs) leave that one field None.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from controlplane.accounting.samples import GpuReading  # the store owns the record shapes

__all__ = ["GpuReading", "GpuTelemetry"]

log = logging.getLogger(__name__)

T = TypeVar("T")

NVML_TEMPERATURE_GPU = 0  # pynvml.NVML_TEMPERATURE_GPU; used if the module lacks the constant


class GpuTelemetry:
    """Reads every visible GPU through NVML; a no-op where NVML or GPUs are missing.

    ``nvml`` is the module to use; by default ``pynvml`` is imported on first use. Tests pass a
    stand-in. Thread-safe. After `close` the instance reads nothing (``available`` is False).
    """

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()
        self._state: bool | None = None  # None: not tried yet; True: on; False: off for good
        self._count = 0
        self._initialised = False  # nvmlInit succeeded and nvmlShutdown not called yet
        self._logged_failures: set[tuple[int, str]] = set()

    # -- lifecycle ------------------------------------------------------------------------
    def _ensure(self) -> bool:
        if self._state is not None:
            return self._state
        with self._lock:
            if self._state is None:
                self._state = self._start()
            return self._state

    def _start(self) -> bool:
        nvml = self._nvml
        if nvml is None:
            try:
                nvml = self._nvml = importlib.import_module("pynvml")
            except Exception as exc:  # ImportError: nvidia-ml-py not installed
                self._off(f"pynvml not importable ({_describe(exc)})")
                return False
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError (library not found, no driver), OSError, ...
            self._off(f"NVML unavailable ({_describe(exc)})")
            return False
        self._initialised = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:
            self._off(f"cannot count GPUs ({_describe(exc)})")
            self._shutdown()
            return False
        if count <= 0:
            self._off("no GPUs found")
            self._shutdown()
            return False
        self._count = count
        log.info("GPU telemetry on: %d GPU(s) via NVML", count)
        return True

    @staticmethod
    def _off(reason: str) -> None:
        log.info("GPU telemetry off: %s", reason)

    def _shutdown(self) -> None:
        if not self._initialised:
            return
        self._initialised = False
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown failed: %s", _describe(exc))

    def close(self) -> None:
        """Shut NVML down if this instance initialised it; idempotent."""
        with self._lock:
            self._state = False
            self._count = 0
            self._shutdown()

    # -- reading --------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._ensure()

    @property
    def num_gpus(self) -> int:
        return self._count if self._ensure() else 0

    def read(self) -> list[GpuReading]:
        """One reading per GPU; ``[]`` when telemetry is off. Never raises."""
        if not self._ensure():
            return []
        return [self._read_one(i) for i in range(self._count)]

    def _read_one(self, index: int) -> GpuReading:
        nvml = self._nvml
        handle = self._call(index, "handle", lambda: nvml.nvmlDeviceGetHandleByIndex(index))
        if handle is None:
            return GpuReading(gpu_index=index)

        def name() -> str:
            raw = nvml.nvmlDeviceGetName(handle)
            return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)

        memory = self._call(index, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        temp_sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", NVML_TEMPERATURE_GPU)
        return GpuReading(
            gpu_index=index,
            name=self._call(index, "name", name),
            utilization_pct=self._call(
                index, "utilization", lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            ),
            memory_used_bytes=None if memory is None else _int_or_none(memory, "used"),
            memory_total_bytes=None if memory is None else _int_or_none(memory, "total"),
            power_w=self._call(
                index, "power", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
            ),
            temperature_c=self._call(
                index,
                "temperature",
                lambda: float(nvml.nvmlDeviceGetTemperature(handle, temp_sensor)),
            ),
            energy_j=self._call(
                index, "energy", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0
            ),
        )

    def _call(self, index: int, field: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None if it raises; each (GPU, field) failure is logged once, at debug."""
        try:
            return fn()
        except Exception as exc:
            key = (index, field)
            if key not in self._logged_failures:
                self._logged_failures.add(key)
                log.debug("GPU %d: no %s (%s)", index, field, _describe(exc))
            return None


def _int_or_none(obj: Any, attr: str) -> int | None:
    try:
        return int(getattr(obj, attr))
    except Exception:
        return None


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # pynvml's __str__ itself calls into NVML
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
