"""engine/model/quant/kernels.py: each format's kernels in order, each saying why it cannot
serve a layer, the first that can building it, and the start-up log saying so: one line per kind
of layer, naming what served and why the kernels ahead of it were passed over."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch import nn

from controlplane.engine import Engine
from controlplane.engine.kernels import cpu_ops
from controlplane.engine.model import quant
from controlplane.engine.model.quant.kernels import (
    Choice,
    KernelChoices,
    LinearSpec,
    choose,
    int8_activations_available,
)

CPU = torch.device("cpu")
META = torch.device("meta")


def names(kind: str) -> list[str]:
    return [k.name for k in quant.POSSIBLE_KERNELS[kind]]


def test_each_format_lists_its_kernels_in_order_of_preference():
    assert names("int8") == ["w8a8_cpu", "int8_cpu", "int8_triton", "int8pack_mm", "dequant"]
    assert names("int4") == [
        "w4a8_cpu",
        "int4pack_mm_cpu",
        "int4_triton",
        "int4pack_mm_cuda",
        "dequant",
    ]


def test_on_a_device_no_kernel_runs_on_only_the_fallback_serves_and_each_says_why():
    spec = LinearSpec(64, 64, META, torch.float32, group_size=32, int8_activations=True)
    int8 = choose(quant.INT8_KERNELS, spec)
    assert int8.kernel.name == "dequant"
    assert int8.passed_over == (
        ("w8a8_cpu", "the device is meta, not a CPU"),
        ("int8_cpu", "the device is meta, not a CPU"),
        ("int8_triton", "the device is meta, not CUDA"),
        ("int8pack_mm", "torch's kernel runs on a CPU or CUDA, not meta"),
    )
    int4 = choose(quant.INT4_KERNELS, spec)
    assert int4.kernel.name == "dequant"
    assert int4.passed_over == (
        ("w4a8_cpu", "the device is meta, not a CPU"),
        ("int4pack_mm_cpu", "the device is meta, not a CPU"),
        ("int4_triton", "the device is meta, not CUDA"),
        ("int4pack_mm_cuda", "the device is meta"),
    )


def test_a_shape_a_kernel_cannot_take_passes_to_the_next():
    # 40 input features: not groups of 32 for int8 activations, not 16-aligned for torch's
    # CPU int8 kernel (which would crash the process on it).
    spec = LinearSpec(64, 40, CPU, torch.float32, int8_activations=True)
    choice = choose(quant.INT8_KERNELS, spec)
    w8a8_why = "in_features 40 is not a multiple of 32"
    if int8_activations_available():
        assert choice.passed_over[0] == ("w8a8_cpu", w8a8_why)
    if cpu_ops.available():
        assert choice.kernel.name == "int8_cpu"
    else:
        assert choice.kernel.name == "dequant"
        assert ("int8pack_mm", "in_features 40 is not a multiple of 16 (torch's CPU kernel)") in (
            choice.passed_over
        )
    # int4 with int8 activations asked for but a group of 48: not whole 32-feature groups.
    spec = LinearSpec(64, 96, CPU, torch.float32, group_size=48, int8_activations=True)
    choice = choose(quant.INT4_KERNELS, spec)
    assert choice.kernel.name == "int4pack_mm_cpu"
    if int8_activations_available():
        assert choice.passed_over == (("w4a8_cpu", "group size 48 is not a multiple of 32"),)


def test_the_chosen_kernel_builds_the_layer():
    lin = nn.Linear(96, 64)
    mod = quant.quantize_linear(lin, "int4", 32)
    assert isinstance(mod, quant.Int4Linear) and mod.kernel == "int4pack_mm_cpu"
    spec = LinearSpec.of(lin, group_size=32)
    assert choose(quant.INT4_KERNELS, spec).kernel.name == mod.kernel
    fallback = quant.INT8_KERNELS[-1].build(lin, LinearSpec.of(lin))
    assert isinstance(fallback, quant.Int8Linear) and fallback.kernel == "dequant"
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        quant.quantize_linear(lin, "int3", 32)


def test_the_log_line_counts_layers_and_reasons():
    first = quant.INT8_KERNELS[1]
    second = next(k for k in quant.INT8_KERNELS if k.name == "int8pack_mm")
    choices = KernelChoices()
    for _ in range(3):
        choices.add("int8 linears", Choice(first, (("w8a8_cpu", "not asked"),)), nn.Identity())
    choices.add(
        "int8 linears",
        Choice(second, (("w8a8_cpu", "not asked"), ("int8_cpu", "odd"))),
        nn.Identity(),
    )
    choices.add("int8 lm_head", Choice(quant.INT8_KERNELS[0], ()), nn.Identity())
    assert choices.lines() == [
        "int8 linears (4): int8_cpu for 3 of 4, int8pack_mm for 1 of 4; passed over "
        "w8a8_cpu: not asked; int8_cpu: odd for 1 of 4",
        "int8 lm_head (1): w8a8_cpu; the first choice",
    ]


def _kernel_lines(text: str) -> dict[str, str]:
    """The start-up log's kernel lines, by kind of layer."""
    found = re.findall(r"kernels: ((int\d) (linears|lm_head) \(\d+\): .*)", text)
    return {f"{fmt} {what}": line for line, fmt, what in found}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_log_says_what_each_kind_of_layer_runs_and_why(tiny_model_dir, caplog, quantization):
    with caplog.at_level("INFO", logger=quant.log.name):
        eng = Engine(
            model=str(tiny_model_dir),
            quantization=quantization,
            quantize_lm_head=True,
            kv_cache_memory_bytes=8 << 20,
        )
    lines = _kernel_lines(caplog.text)
    assert sorted(lines) == sorted([f"{quantization} linears", "int8 lm_head"])
    kinds = {"int8": quant.Int8Linear, "int4": quant.Int4Linear}
    body = [
        m
        for name, m in eng.model.named_modules()
        if isinstance(m, kinds[quantization]) and name != "lm_head"
    ]
    served = Counter(m.kernel for m in body)
    line = lines[f"{quantization} linears"]
    assert line.startswith(f"{quantization} linears ({len(body)}): ")
    for kernel, count in served.items():
        assert kernel in line and (count == len(body) or f"for {count} of" in line)
    # Every kernel ahead of the one that served is in the line with its own reason.
    for kernel in quant.POSSIBLE_KERNELS[quantization]:
        if kernel.name in served:
            break
        m = body[0]
        spec = LinearSpec(m.out_features, m.in_features, CPU, eng.dtype, group_size=32)
        assert f"{kernel.name}: {kernel.can_serve(spec)}" in line
    head = eng.model.lm_head
    assert lines["int8 lm_head"].startswith(f"int8 lm_head (1): {head.kernel}")


def test_without_our_kernels_the_log_says_why_ours_were_passed_over(tiny_model_dir, tmp_path):
    # A real failed build: no C++ compiler (CXX=false) and an empty extensions directory.
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from controlplane.engine import Engine\n"
        f"e = Engine(model={str(tiny_model_dir)!r}, quantization='int8', "
        "attention_backend='torch', kv_cache_memory_bytes=1 << 20)\n"
        "print('served:', e.model.model.layers[0].mlp.down_proj.kernel)\n"
    )
    env = dict(os.environ, CXX="false", TORCH_EXTENSIONS_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    line = _kernel_lines(result.stdout)["int8 linears"]
    served = result.stdout.split("served: ")[-1].strip()
    assert served == "int8pack_mm"  # torch's, the next in line (the tiny model is 16-aligned)
    assert line.startswith("int8 linears (") and f"): {served}; passed over" in line
    assert "w8a8_cpu: int8 activations not asked for (engine.quantize_activations)" in line
    assert "int8_cpu: our CPU kernels did not build" in line
