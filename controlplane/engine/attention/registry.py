"""The backends by name, for `engine.attention_backend`: one table instead of a chain of ifs,
and what `auto` means on a device.

Each entry imports its class only when asked for: the Triton backend's module must not load
on a CPU engine that does not ask for it (it decides whether triton runs interpreted), and
triton itself is an optional extra.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from controlplane.engine.attention.backend import AttentionBackend
from controlplane.engine.errors import InvalidSettingError

log = logging.getLogger(__name__)


def _torch() -> type[AttentionBackend]:
    from controlplane.engine.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention


def _cpu() -> type[AttentionBackend]:
    from controlplane.engine.attention.cpu import CpuPagedAttention

    return CpuPagedAttention


def _triton() -> type[AttentionBackend]:
    from controlplane.engine.attention.triton import TritonPagedAttention

    return TritonPagedAttention


BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "torch": _torch,  # pure PyTorch: runs anywhere
    "cpu": _cpu,  # our C++ decode kernel (engine/kernels), CPUs where it builds
    "triton": _triton,  # GPUs (on a CPU only under Triton's interpreter: tests)
}


def backend_class(name: str) -> type[AttentionBackend]:
    """The class `name` stands for (InvalidSettingError, listing the choices, if none)."""
    load = BACKENDS.get(name)
    if load is None:
        choices = ", ".join(["auto", *BACKENDS])
        raise InvalidSettingError(
            "attention_backend", f"unknown backend {name!r}; choices: {choices}"
        )
    return load()


def auto_backend(device: torch.device) -> str:
    """What `auto` is on `device`: Triton on CUDA (when the triton package is installed: it
    is an optional extra), our C++ kernel on a CPU where it builds, torch elsewhere."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            log.warning("attention_backend auto: triton is not installed, using torch")
            return "torch"
        return "triton"
    if device.type == "cpu" and backend_class("cpu").unavailable(device) is None:
        return "cpu"
    return "torch"
