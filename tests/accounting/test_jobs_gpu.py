"""GPU telemetry: the real pynvml without an NVML library (this machine has no GPU), and a
stand-in module for the per-device paths that need a GPU."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

from controlplane.accounting.gpu import GpuReading, GpuTelemetry

LOGGER = "controlplane.accounting.gpu"


def _off_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.getMessage().startswith("GPU telemetry off:")
    ]


# -- a stand-in pynvml (only because no GPU exists here) ----------------------------------------
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_UNKNOWN = 999


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {NVML_ERROR_NOT_SUPPORTED: "Not Supported"}.get(self.value, "Unknown Error")


class FakeNVML:
    """Two GPUs: 0 supports everything; 1 lacks power and energy, and its sensor fails."""

    NVMLError = NVMLError
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, count: int = 2, init_error: Exception | None = None) -> None:
        self.count = count
        self.init_error = init_error
        self.init_calls = 0
        self.shutdown_calls = 0

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        if index >= self.count:
            raise NVMLError(NVML_ERROR_UNKNOWN)
        return f"h{index}"

    def nvmlDeviceGetName(self, handle: str) -> bytes | str:
        return b"NVIDIA H100 80GB HBM3" if handle == "h0" else "NVIDIA L4"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=87 if handle == "h0" else 5, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        if handle == "h0":
            return SimpleNamespace(total=80 * 2**30, used=60 * 2**30, free=20 * 2**30)
        return SimpleNamespace(total=24 * 2**30, used=2**30, free=23 * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        if handle == "h1":
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return 312_500  # mW

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        if handle == "h1":
            raise RuntimeError("sensor read failed")
        return 64

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        if handle == "h1":
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return 123_456_789  # mJ


# -- (a) the real pynvml, no NVML library ---------------------------------------------------------
def test_real_pynvml_without_library_is_off_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # a machine with a GPU: this test is about the machine without one
        pynvml.nvmlShutdown()
        pytest.skip("NVML is present here")

    caplog.set_level(logging.INFO, logger=LOGGER)
    t = GpuTelemetry()
    assert t.available is False
    assert t.num_gpus == 0
    for _ in range(3):
        assert t.read() == []
    t.close()
    assert t.read() == []
    lines = _off_lines(caplog)
    assert len(lines) == 1, lines
    assert "NVML" in lines[0]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_missing_module_is_off(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    caplog.set_level(logging.INFO, logger=LOGGER)
    t = GpuTelemetry()
    assert t.read() == [] and t.read() == []
    assert not t.available
    lines = _off_lines(caplog)
    assert len(lines) == 1 and "pynvml not importable" in lines[0], lines


# -- (b) per-device reads --------------------------------------------------------------------------
def test_readings_convert_units_and_none_only_unsupported_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    nvml = FakeNVML()
    t = GpuTelemetry(nvml=nvml)
    assert nvml.init_calls == 0  # lazy
    assert t.available
    assert t.num_gpus == 2
    first = t.read()
    assert first == [
        GpuReading(
            gpu_index=0,
            name="NVIDIA H100 80GB HBM3",
            utilization_pct=87.0,
            memory_used_bytes=60 * 2**30,
            memory_total_bytes=80 * 2**30,
            power_w=312.5,
            temperature_c=64.0,
            energy_j=123_456.789,
        ),
        GpuReading(
            gpu_index=1,
            name="NVIDIA L4",
            utilization_pct=5.0,
            memory_used_bytes=2**30,
            memory_total_bytes=24 * 2**30,
            power_w=None,
            temperature_c=None,
            energy_j=None,
        ),
    ]
    assert isinstance(first[0].name, str)
    assert isinstance(first[0].power_w, float) and isinstance(first[0].energy_j, float)
    assert t.read() == first
    assert nvml.init_calls == 1
    assert _off_lines(caplog) == []
    # failures are logged once per (GPU, field), at debug only
    failures = [r for r in caplog.records if r.getMessage().startswith("GPU 1: no ")]
    assert sorted(r.getMessage().split(" (")[0] for r in failures) == [
        "GPU 1: no energy",
        "GPU 1: no power",
        "GPU 1: no temperature",
    ]
    assert all(r.levelno == logging.DEBUG for r in failures)


def test_handle_failure_gives_index_only() -> None:
    nvml = FakeNVML()

    def no_handle(index: int) -> str:
        if index == 1:
            raise NVMLError(NVML_ERROR_UNKNOWN)
        return f"h{index}"

    nvml.nvmlDeviceGetHandleByIndex = no_handle  # type: ignore[method-assign]
    readings = GpuTelemetry(nvml=nvml).read()
    assert readings[0].power_w == 312.5
    assert readings[1] == GpuReading(gpu_index=1)


# -- (c) nvmlInit failing, or no devices -----------------------------------------------------------
@pytest.mark.parametrize(
    "nvml",
    [
        FakeNVML(init_error=NVMLError(12)),  # NVML_ERROR_LIBRARY_NOT_FOUND
        FakeNVML(init_error=OSError("libnvidia-ml.so.1: cannot open shared object file")),
        FakeNVML(count=0),
    ],
    ids=["nvml-error", "os-error", "no-gpus"],
)
def test_init_failure_is_off_with_one_line(
    nvml: FakeNVML, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    t = GpuTelemetry(nvml=nvml)
    for _ in range(3):
        assert t.read() == []
    assert not t.available and t.num_gpus == 0
    assert nvml.init_calls == 1  # never retried
    assert len(_off_lines(caplog)) == 1
    # NVML is shut down again when it initialised but found nothing
    assert nvml.shutdown_calls == (1 if nvml.init_error is None else 0)
    t.close()
    assert nvml.shutdown_calls == (1 if nvml.init_error is None else 0)


# -- (d) close ---------------------------------------------------------------------------------------
def test_close_shuts_down_once() -> None:
    nvml = FakeNVML()
    t = GpuTelemetry(nvml=nvml)
    assert len(t.read()) == 2
    t.close()
    t.close()
    assert nvml.shutdown_calls == 1
    assert t.read() == [] and not t.available
    assert nvml.init_calls == 1


def test_close_before_use_does_not_touch_nvml() -> None:
    nvml = FakeNVML()
    t = GpuTelemetry(nvml=nvml)
    t.close()
    assert nvml.init_calls == 0 and nvml.shutdown_calls == 0


def test_stand_in_matches_real_pynvml_names() -> None:
    pynvml = pytest.importorskip("pynvml")
    for name in dir(FakeNVML):
        if name.startswith("nvml") or name.startswith("NVML_"):
            assert hasattr(pynvml, name), name
    assert pynvml.NVML_ERROR_NOT_SUPPORTED == NVML_ERROR_NOT_SUPPORTED
    assert issubclass(pynvml.NVMLError, Exception)
