"""engine/attention/registry.py: the backends by name, and why a named one is refused."""

from __future__ import annotations

import pytest
import torch

from controlplane.engine.attention.cpu import CpuPagedAttention
from controlplane.engine.attention.registry import BACKENDS, auto_backend, backend_class
from controlplane.engine.attention.torch_paged import TorchPagedAttention
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.kernels import cpu_ops
from controlplane.engine.kv_cache import KVCache, KVCacheSpec
from controlplane.engine.parts import make_backend

CPU = torch.device("cpu")


def test_each_name_gives_its_class():
    assert list(BACKENDS) == ["torch", "cpu", "triton"]
    assert backend_class("torch") is TorchPagedAttention
    assert backend_class("cpu") is CpuPagedAttention


def test_an_unknown_name_lists_the_choices():
    with pytest.raises(InvalidSettingError, match="attention_backend") as info:
        backend_class("flash")
    assert "'flash'" in str(info.value)
    assert "choices: auto, torch, cpu, triton" in str(info.value)


def test_the_cpu_backend_says_why_it_cannot_serve_a_gpu_cache():
    assert CpuPagedAttention.unavailable(torch.device("cuda")) == "the device is cuda"
    assert TorchPagedAttention.unavailable(torch.device("cuda")) is None
    kv = KVCache(KVCacheSpec(1, 1, 16, 16, torch.float32), 2, 0, CPU)
    with pytest.raises(InvalidSettingError, match="cpu is not available here: the device is"):
        make_backend("cpu", kv, torch.device("cuda"))


def test_auto_on_a_cpu_is_our_kernel_where_it_builds():
    assert auto_backend(CPU) == ("cpu" if cpu_ops.available() else "torch")
    assert auto_backend(torch.device("meta")) == "torch"
    kv = KVCache(KVCacheSpec(1, 1, 16, 16, torch.float32), 2, 0, CPU)
    backend = make_backend("auto", kv, CPU, bf16_dot=False)
    if cpu_ops.available():
        assert type(backend) is CpuPagedAttention and backend.bf16_dot is False
    else:
        assert type(backend) is TorchPagedAttention
