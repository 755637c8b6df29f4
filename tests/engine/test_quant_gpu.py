"""The quantized linears and a quantized engine on an NVIDIA GPU (`-m gpu`; skipped without CUDA).

On CUDA the linears run our Triton kernels (`int8_triton`, `int4_triton`: their own tests are
tests/engine/test_triton_linear.py); torch's `_weight_int8pack_mm` and tinygemm
(`_weight_int4pack_mm`, its own packing: quant.pack_int4) are next in line, asked for by name
here. The CPU suite never reaches torch's CUDA kernels, so a packing or layout mistake shows
only here: each kernel is checked against the dequantize-then-matmul fallback on the same
quantized weights (odd shapes padded), exactly on weights already on the int4 grid, and inside
whole engines (logits against the float engine on the same GPU; eager against compiled with
CUDA graphs, token for token).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from controlplane.engine import Engine
from controlplane.engine.model import quant
from tests.conftest import MIXED_ENGINE, mixed_workload, run_to_end
from tests.engine.test_quant import LOGIT_BOUNDS, _prefill_logits, activations, linear, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 100])
@pytest.mark.parametrize("k,n", [(256, 96), (100, 20), (576, 1536)])
def test_cuda_kernels_match_the_dequantize_fallback(k, n, rows, dtype):
    lin = linear(k, n, bias=True).to(CUDA)
    x = activations(rows, k).to(CUDA, dtype)
    q8 = quant.quantize_int8(lin.weight)
    fast8 = quant.Int8Linear(q8, lin.bias, dtype, kernel="int8pack_mm")
    slow8 = quant.Int8Linear(q8, lin.bias, dtype, kernel="dequant")
    assert fast8.kernel == "int8pack_mm" and slow8.kernel == "dequant"
    y8 = fast8(x)
    assert y8.dtype == dtype and y8.shape == (rows, n) and y8.device.type == "cuda"
    assert rel_err(y8, slow8(x)) < 1e-2
    fast4 = quant.Int4Linear(lin.weight, lin.bias, 32, dtype, kernel="int4pack_mm_cuda")
    slow4 = quant.Int4Linear(lin.weight, lin.bias, 32, dtype, kernel="dequant")
    assert fast4.kernel == "int4pack_mm_cuda" and slow4.kernel == "dequant"
    y4 = fast4(x)
    assert y4.dtype == dtype and y4.shape == (rows, n)
    assert rel_err(y4, slow4(x)) < 1e-2
    assert rel_err(y4, lin(x.float())) < 0.12  # and near the float linear


@pytest.mark.parametrize("kernel", ["int4_triton", "int4pack_mm_cuda"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_cuda_int4_is_exact_on_weights_already_on_its_grid(group, kernel):
    """A nibble order, tile layout or scale/zero mix-up cannot hide behind rounding error."""
    n, k = 96, 256
    w = quant.quantize_int4(linear(k, n).weight.detach(), group).dequantize()
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data.copy_(w)
    lin = lin.to(CUDA)
    x = activations(5, k).to(CUDA)
    lin = lin.to(torch.bfloat16)
    mod = quant.Int4Linear(lin.weight, None, group, torch.bfloat16, kernel=kernel)
    assert mod.kernel == kernel
    # What remains: bf16 activations, scales and zeros in the kernel.
    assert rel_err(mod(x.to(torch.bfloat16)), lin.float()(x)) < 1e-2


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_engine_on_cuda_stays_close_to_the_float_engine(kind, tiny_model_dir):
    kw = dict(
        model=str(tiny_model_dir),
        device="cuda",
        dtype="float32",  # the kernels take bf16 activations, as on the CPU
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=8,
        compile="off",
    )
    ref = Engine(quantization="none", **kw)
    eng = Engine(quantization=kind, quantize_lm_head=True, **kw)
    layer = eng.model.model.layers[0]
    want = f"{kind}_triton"
    assert layer.self_attn.qkv_proj.kernel == want and layer.mlp.down_proj.kernel == want
    assert isinstance(eng.model.lm_head, quant.Int8Linear)
    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(10 + 9 * i)] for i in range(6)]
    for got, want_logits in zip(
        _prefill_logits(eng, prompts), _prefill_logits(ref, prompts), strict=True
    ):
        assert rel_err(got, want_logits) < LOGIT_BOUNDS[kind]
    assert eng.memory.weights_bytes < ref.memory.weights_bytes
    assert eng.block_pool.num_used == 0


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_compiled_step_with_cuda_graphs_gives_the_eager_tokens(kind, hf_model_dirs):
    kw = dict(
        model=str(hf_model_dirs["llama"]),
        device="cuda",
        dtype="float32",
        quantization=kind,
        quantize_lm_head=True,
        **MIXED_ENGINE,
    )
    eager = Engine(compile="off", cuda_graphs="off", **kw)
    graphed = Engine(compile="on", cuda_graphs="auto", **kw)
    prompts, params = mixed_workload(eager.model_config.vocab_size, 5, 10)
    assert run_to_end(graphed, prompts, params) == run_to_end(eager, prompts, params)
    assert graphed.runner.graphs.replays > 0
    assert graphed.scheduler.num_preemptions > 0
