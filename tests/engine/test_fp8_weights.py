"""FP8 e4m3 weights with one scale per output channel (engine.quantization = "fp8").

On a CPU: the quantizer's rounding bound, the `dequant` kernel against `F.linear` of the
dequantized weight, the registry's choice and its log, torch's `_scaled_mm` math (scales,
layout, rowwise against one scale per step) run through torch's CPU implementation where it
has one, a float checkpoint and a GGUF file loaded with fp8 linears, an engine's logits against
the float engine's, and the setting's choices. On an NVIDIA GPU of compute capability 8.9 or
more (`-m gpu`): the `scaled_mm` kernel against an exact emulation and the dequant kernel, and
an engine on CUDA.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from controlplane.engine import Engine
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.model import quant
from controlplane.engine.model.quant import triton_linear
from controlplane.engine.model.quant.fp8 import (
    FP8_KERNELS,
    Fp8Linear,
    rowwise_unavailable,
    scaled_mm_unavailable,
)
from controlplane.engine.model.quant.kernels import KernelChoices, LinearSpec, choose
from controlplane.engine.settings import QUANTIZATIONS, EngineSettings, check
from tests.engine import test_quant
from tests.engine.test_quant import (
    _perplexity,
    _prefill_logits,
    activations,
    linear,
    rel_err,
)

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# e4m3's smallest normal magnitude (2^-6) and its subnormals' spacing (2^-9), in scaled units.
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_STEP = 2.0**-9


def _cuda_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


# -- the quantizer -----------------------------------------------------------------------------


def test_fp8_round_trip_is_within_half_an_e4m3_step_per_weight():
    """e4m3 keeps 3 mantissa bits: between 2^e and 2^(e+1) its values are 2^(e-3) apart, a
    relative step of 2^-3 of the binade's floor. Rounding to nearest moves a normal value by
    at most half a step, 2^(e-4) <= 2^-4 |w|; a subnormal one (below 2^-6 in scaled units) by
    at most half the subnormal spacing, 2^-10 in scaled units. So every weight is within
    max(2^-4 |w|, 2^-10 * scale) of its dequantized value, and each channel's relative error
    (as a norm) within 2^-4: inside the 2^-3 step, with room only for correct rounding (a
    truncating conversion would reach 2^-3)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 200, generator=gen) * 0.02
    w[5] *= 300  # a loud row keeps its own scale: the others' grids are not coarsened
    w[9] = 0.0  # an all-zero row stays finite and exact
    w[11, :100] *= 3e-5  # small weights of a row with large ones fall to subnormals
    q = quant.quantize_fp8(w)
    assert q.qweight.dtype == torch.float8_e4m3fn and q.qweight.shape == w.shape
    assert q.scales.dtype == torch.float32 and q.scales.shape == (64,)
    back = q.dequantize()
    assert torch.isfinite(back).all()
    # Each row's largest weight lands on e4m3's largest value (scale = amax / 448).
    live = w.abs().amax(dim=1) > 0
    codes = q.qweight.float()
    assert torch.equal(codes.abs().amax(dim=1)[live], torch.full((63,), E4M3_MAX))
    assert torch.allclose(q.scales[live], w.abs().amax(dim=1)[live] / E4M3_MAX, rtol=1e-6)
    assert torch.equal(back[9], torch.zeros(200))
    err = (back - w).abs()
    bound = torch.maximum(w.abs() * 2.0**-4, q.scales[:, None] * E4M3_SUBNORMAL_STEP / 2)
    assert bool((err <= bound * (1 + 1e-5)).all())
    per_channel = (back - w)[live].norm(dim=1) / w[live].norm(dim=1)
    assert float(per_channel.max()) <= 2.0**-4
    # The rounding is to nearest, not toward zero: on Gaussian weights the errors average
    # out to a few tenths of the bound, and they take both signs.
    assert float(per_channel.mean()) < 2.0**-5
    assert bool((back - w)[live].gt(0).any()) and bool((back - w)[live].lt(0).any())
    # Subnormals are used (not flushed to zero) in the row with tiny weights.
    scaled = (w[11, :100] / q.scales[11]).abs()
    assert float(scaled.max()) < E4M3_MIN_NORMAL
    assert int((codes[11, :100] != 0).sum()) > 50


def test_fp8_values_already_on_the_grid_round_trip_exactly():
    """Weights that are e4m3 values times a row scale (the row's max at 448) come back bit for
    bit: a scale or conversion mix-up cannot hide behind rounding error."""
    gen = torch.Generator().manual_seed(1)
    grid = torch.randn(16, 64, generator=gen).clamp(-E4M3_MAX, E4M3_MAX) * 60
    grid = grid.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    grid[:, 0] = E4M3_MAX  # every row reaches the top of the range
    row_scale = torch.rand(16, generator=gen) + 0.5
    w = grid * row_scale[:, None]
    q = quant.quantize_fp8(w)
    assert torch.equal(q.qweight.float(), grid)
    assert torch.allclose(q.scales, row_scale, rtol=1e-6)


# -- the dequant kernel (the CPU's) ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("k,n,bias", [(64, 48, False), (96, 200, True), (100, 20, True)])
def test_dequant_kernel_is_f_linear_of_the_dequantized_weight(k, n, bias, rows, dtype):
    lin = linear(k, n, seed=k + n, bias=bias)
    q = quant.quantize_fp8(lin.weight)
    mod = Fp8Linear(q, lin.bias, dtype)
    assert mod.kernel == "dequant"  # on a CPU
    x = activations(rows, k, seed=rows).to(dtype)
    y = mod(x)
    assert y.dtype == dtype and y.shape == (rows, n)
    want = F.linear(x, q.dequantize().to(dtype), None if lin.bias is None else lin.bias.to(dtype))
    assert torch.equal(y, want)
    # And close to the float linear: e4m3 weights, rounding each by at most 2^-4 relative.
    assert rel_err(y, lin(x.float())) < (0.05 if dtype == torch.float32 else 0.06)
    # Leading dimensions are kept.
    assert torch.equal(mod(x.view(1, rows, k)), y.view(1, rows, n))


def test_quantize_linear_builds_an_fp8_linear_and_counts_its_bytes():
    lin = linear(256, 512)
    mod = quant.quantize_linear(lin, "fp8", 0)
    assert isinstance(mod, Fp8Linear) and mod.kernel == "dequant"
    assert mod.qweight.dtype == torch.float8_e4m3fn
    # One byte a weight and a float32 scale per output channel (a quarter of float32's).
    assert quant.weight_bytes(mod) == 256 * 512 + 512 * 4
    assert quant.weight_bytes(lin) == 256 * 512 * 4


# -- the registry ------------------------------------------------------------------------------


def test_registry_chooses_dequant_on_a_cpu_and_says_why_not_scaled_mm(caplog):
    spec = LinearSpec(48, 64, torch.device("cpu"), torch.float32)
    choice = choose(FP8_KERNELS, spec)
    assert choice.kernel.name == "dequant"
    assert choice.passed_over == (("scaled_mm", "the device is cpu, not CUDA"),)
    # The start-up log line for a model: dequant served, scaled_mm passed over with its reason.
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64))
    choices = KernelChoices()
    assert quant.quantize_linears(model, "fp8", 0, choices=choices) == 2
    assert all(isinstance(m, Fp8Linear) for m in model)
    assert choices.lines() == [
        "fp8 linears (2): dequant; passed over scaled_mm: the device is cpu, not CUDA"
    ]


def test_scaled_mm_refuses_old_gpus_and_odd_shapes(monkeypatch):
    """Without a GPU here: the capability and shape checks, on a CUDA spec with the device's
    capability stubbed (nothing runs on it)."""
    cuda = torch.device("cuda", 0)
    capability = [(8, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    spec = LinearSpec(64, 64, cuda, torch.bfloat16)
    assert scaled_mm_unavailable(spec) == (
        "compute capability 8.0 is below 8.9 (no FP8 tensor cores)"
    )
    assert choose(FP8_KERNELS, spec).kernel.name == "dequant"
    for ok in ((8, 9), (9, 0), (10, 0)):
        capability[0] = ok
        assert scaled_mm_unavailable(spec) is None, ok
    assert "needs multiples of 16" in str(
        scaled_mm_unavailable(LinearSpec(64, 40, cuda, torch.bfloat16))
    )
    assert "needs multiples of 16" in str(
        scaled_mm_unavailable(LinearSpec(20, 64, cuda, torch.bfloat16))
    )


# -- _scaled_mm's math, through torch's CPU implementation -------------------------------------


def emulated_scaled_mm(x: torch.Tensor, q: quant.Fp8Weight, rowwise: bool) -> torch.Tensor:
    """What the scaled_mm kernel computes, in float32 from its definition: the activations
    rounded to e4m3 on a scale per row (or one for the tensor) of max |x| / 448, times the
    dequantized weight."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True) if rowwise else x.abs().amax()
    scale = amax.clamp(min=1e-12) / E4M3_MAX
    xq = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return xq @ q.dequantize().t()


def _cpu_scaled_mm_available() -> bool:
    return rowwise_unavailable(torch.device("cpu")) is None


needs_cpu_scaled_mm = pytest.mark.skipif(
    not _cpu_scaled_mm_available(), reason="this torch has no rowwise _scaled_mm on a CPU"
)


@needs_cpu_scaled_mm
@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_scaled_mm_path_is_the_emulated_fp8_product(rows, rowwise):
    """The scaled_mm path's scales and layouts (the kernel serves only on CUDA; torch runs the
    same op on a CPU): against its float32 emulation within bf16 output rounding, and against
    the dequant kernel within e4m3's activation rounding (2^-4 at most per value)."""
    lin = linear(96, 64, seed=rows, bias=True)
    q = quant.quantize_fp8(lin.weight)
    fast = Fp8Linear(q, lin.bias, torch.float32, kernel="scaled_mm", rowwise=rowwise)
    slow = Fp8Linear(q, lin.bias, torch.float32)
    x = activations(rows, 96, seed=rows)
    y = fast(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 64)
    assert rel_err(y, emulated_scaled_mm(x, q, rowwise) + lin.bias) < 1e-2
    assert rel_err(y, slow(x)) < 2.0**-4


@needs_cpu_scaled_mm
def test_rowwise_scales_keep_a_token_independent_of_what_shares_its_step():
    """Why the kernel takes a scale per token: under one scale for the step a token's result
    depends on the other tokens, and a loud one pushes the rest of the step down e4m3's range
    into its subnormals, then to zero; under a scale per token it does neither."""
    lin = linear(128, 64, seed=3)
    q = quant.quantize_fp8(lin.weight)
    quiet = activations(7, 128, seed=4)
    per_token = Fp8Linear(q, None, torch.float32, kernel="scaled_mm", rowwise=True)
    per_step = Fp8Linear(q, None, torch.float32, kernel="scaled_mm", rowwise=False)
    exact = F.linear(quiet, q.dequantize())
    alone_token, alone_step = per_token(quiet), per_step(quiet)
    for loudness in (10.0, 1e5):
        loud = activations(1, 128, seed=5) * loudness
        x = torch.cat([loud, quiet])
        # A scale per token: the quiet rows' results are the same with or without the loud
        # one (up to the GEMM's summation order).
        assert rel_err(per_token(x)[1:], alone_token) < 1e-5
        # One scale for the step: they change, as soon as the loud row sets the scale.
        assert rel_err(per_step(x)[1:], alone_step) > 1e-3
    # A loud enough token ruins the others' products under one scale, not under per-token ones.
    assert rel_err(per_token(x)[1:], exact) < 2.0**-4 < 0.1 < rel_err(per_step(x)[1:], exact)


@needs_cpu_scaled_mm
@pytest.mark.slow
def test_compiled_scaled_mm_path_gives_the_eager_bits():
    """The compiled decode step runs these linears under torch.compile: the same bits as eager,
    bias included. One scale per step is the case that differed (inductor dropped the bf16
    rounding between the weight scales and the bias); the bias is now added in float32 and the
    sum rounded once. (The rowwise and dequant paths gave the eager bits both ways.)"""
    lin = linear(128, 48, seed=6, bias=True)
    q = quant.quantize_fp8(lin.weight)
    mod = Fp8Linear(q, lin.bias, torch.bfloat16, kernel="scaled_mm", rowwise=False)
    compiled = torch.compile(mod, dynamic=True)
    for rows in (2, 7):
        x = activations(rows, 128, seed=rows).to(torch.bfloat16)
        assert torch.equal(compiled(x), mod(x)), rows


# -- loading -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engines(tiny_model_dir):
    kw = {
        "model": str(tiny_model_dir),
        "kv_cache_memory_bytes": 16 << 20,
        "max_num_seqs": 8,
        "dtype": "float32",
    }
    return {kind: Engine(quantization=kind, **kw) for kind in ("none", "fp8")}


# Relative-norm bound of the fp8 engine's logits against float32 on the tiny random model, in
# the style of test_quant.LOGIT_BOUNDS (int8 0.03, int4 0.2): e4m3 rounds each weight by up to
# 2^-4 of itself (measured here: 0.025-0.032 on these prompts).
FP8_LOGIT_BOUND = 0.08


def test_fp8_engine_stays_close_to_float32_and_generates(tiny_engines):
    from tests.engine.test_quant import _greedy

    ref, eng = tiny_engines["none"], tiny_engines["fp8"]
    projections = [m for name, m in eng.model.named_modules() if name.endswith("_proj")]
    assert projections and all(isinstance(m, Fp8Linear) for m in projections)
    assert all(m.kernel == "dequant" for m in projections)
    # The lm_head and the embedding are kept as they are without quantize_lm_head.
    assert type(eng.model.lm_head) is type(ref.model.lm_head)  # float (packed where it packs)
    assert not isinstance(eng.model.lm_head, Fp8Linear | quant.Int8Linear)
    assert isinstance(eng.model.model.embed_tokens, nn.Embedding)
    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(10 + 9 * i)] for i in range(6)]
    errors = [
        rel_err(got, want)
        for got, want in zip(
            _prefill_logits(eng, prompts), _prefill_logits(ref, prompts), strict=True
        )
    ]
    print(f"fp8 logits against float32: relative error {min(errors):.4f}-{max(errors):.4f}")
    assert max(errors) < FP8_LOGIT_BOUND
    assert min(errors) > 0  # the weights did change
    outs, ref_outs = _greedy(eng, prompts, 16), _greedy(ref, prompts, 16)
    assert all(len(o) == 16 for o in outs)
    assert eng.block_pool.num_used == 0 and ref.block_pool.num_used == 0
    same = sum(
        a == b for o, r in zip(outs, ref_outs, strict=True) for a, b in zip(o, r, strict=True)
    )
    # Reported, not asserted: random weights make greedy agreement a weak signal.
    print(f"fp8: greedy tokens equal to float32's at {same} of {16 * len(prompts)} positions")
    assert eng.memory.quantization == "fp8"
    assert eng.memory.weights_bytes < ref.memory.weights_bytes
    assert eng.memory.weights_bytes == quant.weight_bytes(eng.model)


def test_fp8_load_logs_the_kernel_choice(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="controlplane.engine.model.quant"):
        eng = Engine(
            model=str(tiny_model_dir),
            quantization="fp8",
            quantize_lm_head=True,
            kv_cache_memory_bytes=8 << 20,
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    fp8 = [line for line in lines if line.startswith("kernels: fp8 linears")]
    assert len(fp8) == 1, lines
    assert fp8[0].endswith(": dequant; passed over scaled_mm: the device is cpu, not CUDA")
    # quantize_lm_head: int8 per output row, as with the other formats.
    assert isinstance(eng.model.lm_head, quant.Int8Linear)
    assert any(line.startswith("kernels: int8 lm_head") for line in lines)


def test_gguf_with_fp8_is_dequantized_then_quantized_to_e4m3(tmp_path):
    """A GGUF file's blocks go through float, as for int8 and int4: each fp8 linear holds
    exactly quantize_fp8 of the linear the float load of the same file holds."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from controlplane.engine.gguf.file import clear_cache
    from controlplane.engine.loader import load_model, load_model_config
    from tests.engine.test_gguf import write_tiny_gguf

    g = np.random.default_rng(5)
    q8 = gguf.GGMLQuantizationType.Q8_0
    ffn = {n: g.standard_normal((256, 64), np.float32) for n in ("ffn_gate", "ffn_up")}
    tensors = {f"blk.0.{n}.weight": (gguf.quantize(w, q8), q8) for n, w in ffn.items()}
    path = write_tiny_gguf(tmp_path / "q8.gguf", tensors=tensors)
    clear_cache()
    cfg = load_model_config(path)
    cpu = torch.device("cpu")
    plain = load_model(path, cfg, torch.float32, cpu, 64, cpu_weight_packing=False)
    fp8 = load_model(
        path, cfg, torch.float32, cpu, 64, False, quant.QuantConfig("fp8"), huge_pages=False
    )
    pairs = [
        (name, m, plain.get_submodule(name))
        for name, m in fp8.named_modules()
        if isinstance(m, Fp8Linear)
    ]
    assert {name.rsplit(".", 1)[-1] for name, _, _ in pairs} == {
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    }
    for name, m, float_linear in pairs:
        want = quant.quantize_fp8(float_linear.weight)
        assert torch.equal(m.qweight.view(torch.uint8), want.qweight.view(torch.uint8)), name
        assert torch.equal(m.scales, want.scales), name


# SmolLM2 (Q4_1 GGUF, dequantized then e4m3) against transformers' float32 on the same file:
# measured +1.34% (int8 linears +0.75% in the same run; e4m3's 3 mantissa bits round the bulk
# of a row more coarsely than int8's 255 levels do). The bound leaves room for other CPUs' sums.
FP8_PERPLEXITY_BOUND = 0.02
smollm2_reference = test_quant.smollm2_reference  # the fixture: the text's ids, float32's figure


@pytest.mark.slow
def test_smollm2_fp8_perplexity_against_transformers_float32(smollm2_reference):
    path, ids, ref_ppl = smollm2_reference
    eng = Engine(
        model=str(path),
        dtype="float32",
        quantization="fp8",
        kv_cache_memory_bytes=32 << 20,
        max_num_seqs=1,
    )
    assert isinstance(eng.model.model.layers[0].mlp.down_proj, Fp8Linear)
    (logits,) = _prefill_logits(eng, [ids])
    ppl = _perplexity(logits, ids)
    print(f"SmolLM2 perplexity fp8: {ppl:.4f} (transformers float32 {ref_ppl:.4f})")
    assert 0 < abs(ppl / ref_ppl - 1) < FP8_PERPLEXITY_BOUND
    assert eng.block_pool.num_used == 0


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["quantization", "speculative_draft_quantization"])
def test_fp8_is_a_quantization_choice_and_unknown_ones_name_the_choices(field):
    assert "fp8" in QUANTIZATIONS
    assert getattr(check(EngineSettings(model="m", **{field: "fp8"})), field) == "fp8"
    for bad in ("fp4", "FP8", "e4m3"):
        with pytest.raises(InvalidSettingError) as exc:
            check(EngineSettings(model="m", **{field: bad}))
        assert exc.value.field == field
        message = str(exc.value)
        assert field in message and repr(bad) in message
        assert all(choice in message for choice in QUANTIZATIONS)


def test_the_config_file_takes_fp8_and_names_the_choices_for_an_unknown_one(tmp_path):
    from controlplane.config import load_config
    from harness import write_config

    ok = write_config(tmp_path / "ok.toml", tmp_path / "d1", None, engine={"quantization": "fp8"})
    assert load_config(ok, env={}).engine.quantization == "fp8"
    bad = write_config(tmp_path / "bad.toml", tmp_path / "d2", None, engine={"quantization": "fp6"})
    with pytest.raises(InvalidSettingError) as exc:
        load_config(bad, env={})
    assert exc.value.field == "engine.quantization"
    assert all(choice in str(exc.value) for choice in QUANTIZATIONS)


def test_an_unknown_format_passed_to_the_quantizer_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown quantization 'fp4'") as exc:
        quant.quantize_linear(linear(16, 16), "fp4", 0)
    assert "fp8" in str(exc.value)


# -- on a GPU with FP8 tensor cores ------------------------------------------------------------

needs_fp8_gpu = pytest.mark.skipif(
    not _cuda_fp8(), reason="needs CUDA with compute capability >= 8.9"
)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
@pytest.mark.parametrize("k,n", [(256, 96), (576, 1536), (2048, 512)])
def test_cuda_scaled_mm_matches_its_emulation_and_the_dequant_kernel(k, n, rows, dtype):
    cuda = torch.device("cuda")
    lin = linear(k, n, seed=rows, bias=True).to(cuda)
    mod = quant.quantize_linear(lin.to(dtype), "fp8", 0)
    assert isinstance(mod, Fp8Linear) and mod.kernel == "scaled_mm"
    print(f"scaled_mm rowwise={mod.rowwise} ({rowwise_unavailable(cuda)})")
    q = quant.Fp8Weight(mod.qweight, mod.scales)
    slow = Fp8Linear(q, mod.bias, dtype, kernel="dequant")
    # Where triton imports, up to 16 rows take our W8A16 kernel (16-bit activations).
    assert mod.triton_rows == (16 if triton_linear.unavailable(cuda) is None else 0)
    scaled_mm = Fp8Linear(q, mod.bias, dtype, kernel="scaled_mm", triton_rows=0)
    x = activations(rows, k, seed=rows).to(cuda, dtype)
    y = scaled_mm(x)
    assert y.dtype == dtype and y.shape == (rows, n) and y.device.type == "cuda"
    want = emulated_scaled_mm(x, q, mod.rowwise) + mod.bias.float()
    assert rel_err(y, want) < 1e-2  # bf16 output and 16-bit activations
    assert rel_err(y, slow(x)) < 2.0**-4  # e4m3 activations
    if rows <= mod.triton_rows:  # exact weights, float32 sums: within the output's rounding
        assert rel_err(mod(x), slow(x)) < 1e-2
    else:
        assert torch.equal(mod(x), y)


@pytest.mark.gpu
@needs_fp8_gpu
def test_fp8_engine_on_cuda_stays_close_to_the_float_engine(tiny_model_dir):
    kw = dict(
        model=str(tiny_model_dir),
        device="cuda",
        dtype="bfloat16",
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=8,
        compile="off",
    )
    ref = Engine(quantization="none", **kw)
    eng = Engine(quantization="fp8", **kw)
    layer = eng.model.model.layers[0]
    assert layer.self_attn.qkv_proj.kernel == "scaled_mm"
    assert layer.mlp.down_proj.kernel == "scaled_mm"
    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(10 + 9 * i)] for i in range(6)]
    for got, want in zip(_prefill_logits(eng, prompts), _prefill_logits(ref, prompts), strict=True):
        # e4m3 weights and activations, against bf16 ones: twice the CPU bound's rounding.
        assert rel_err(got, want) < 2 * FP8_LOGIT_BOUND
    assert eng.memory.weights_bytes < ref.memory.weights_bytes
    assert eng.block_pool.num_used == 0


@pytest.mark.gpu
@needs_fp8_gpu
def test_fp8_compiled_step_with_cuda_graphs_gives_the_eager_tokens(hf_model_dirs):
    from tests.conftest import MIXED_ENGINE, mixed_workload, run_to_end

    kw = dict(
        model=str(hf_model_dirs["llama"]),
        device="cuda",
        dtype="bfloat16",
        quantization="fp8",
        **MIXED_ENGINE,
    )
    eager = Engine(compile="off", cuda_graphs="off", **kw)
    graphed = Engine(compile="on", cuda_graphs="auto", **kw)
    assert graphed.model.model.layers[0].mlp.down_proj.kernel == "scaled_mm"
    prompts, params = mixed_workload(eager.model_config.vocab_size, 5, 10)
    assert run_to_end(graphed, prompts, params) == run_to_end(eager, prompts, params)
    assert graphed.runner.graphs.replays > 0
    assert graphed.scheduler.num_preemptions > 0
