"""Our bf16 linear kernel (csrc/bf16_linear.cpp): PackedLinear's choice on a CPU with
AVX512-BF16 and no AMX tiles, under `engine.bf16_dot`."""

from __future__ import annotations

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.kernels import cpu_ops
from controlplane.engine.model.linear import PackedLinear, bf16_linear_available
from tests.conftest import run_to_end

needs_kernel = pytest.mark.skipif(
    not bf16_linear_available(), reason="needs our kernels on a CPU with AVX512-BF16, no AMX"
)


def test_the_kernel_serves_where_the_cpu_has_bf16_dot_products_and_no_tiles():
    if not cpu_ops.available():
        assert not bf16_linear_available()
        return
    ops = torch.ops.controlplane_cpu
    assert bf16_linear_available() == (
        ops.bf16_dot_supported() and not torch.cpu._is_amx_tile_supported()
    )
    if not ops.bf16_dot_supported():
        packed = ops.bf16_pack_weight(torch.ones(64, 64, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            ops.bf16_linear(torch.ones(1, 64, dtype=torch.bfloat16), packed, None, 64)


@needs_kernel
@pytest.mark.parametrize(
    "in_features,out_features,bias",
    [
        (64, 64, False),  # one block, one K chunk
        (130, 100, True),  # a partial block of outputs
        (2500, 200, False),  # K in three chunks once a step has more than 6 rows
        (2048, 576, True),  # two chunks
    ],
)
def test_bf16_linear_is_batch_invariant_and_as_close_as_onednn(in_features, out_features, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    ours = PackedLinear(lin, bf16_dot=True)
    onednn = PackedLinear(lin, bf16_dot=False)
    assert (ours.kernel, onednn.kernel) == ("bf16_dot", "onednn")
    x = torch.randn(40, in_features, dtype=torch.bfloat16)
    batch = ours(x)
    assert batch.shape == (40, out_features) and batch.dtype == torch.bfloat16
    # Each row alone (1 to 20 rows: the one-pass path up to 6, K chunks beyond) is its row of
    # the 40-row batch, bit for bit.
    for rows in (1, 2, 5, 6, 7, 13, 20):
        assert torch.equal(ours(x[:rows]), batch[:rows]), rows
        assert torch.equal(ours(x[40 - rows :]), batch[40 - rows :]), rows
    # As close to the float64 product as oneDNN's bf16 GEMM: both differ from it by the
    # final rounding to bf16 (and sums in float32).
    want = torch.nn.functional.linear(
        x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double()
    )
    err_ours = (batch.double() - want).abs()
    err_onednn = (onednn(x).double() - want).abs()
    assert err_ours.max() <= 2**-8 * want.abs().max()
    assert err_ours.mean() <= 1.1 * err_onednn.mean()
    assert ours(x[:0]).shape == (0, out_features)


@needs_kernel
def test_bf16_linear_names_its_limits():
    ops = torch.ops.controlplane_cpu
    packed = ops.bf16_pack_weight(torch.randn(1024, 2048, dtype=torch.bfloat16))
    assert packed.shape == (16, 1024, 64)
    x = torch.randn(2, 2046, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x has 2046 features, the weight 2048"):
        ops.bf16_linear(x, packed, None, 1024)
    with pytest.raises(RuntimeError, match="out_features=1025 exceeds"):
        ops.bf16_linear(torch.randn(2, 2048, dtype=torch.bfloat16), packed, None, 1025)
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        ops.bf16_linear(torch.randn(2, 2048), packed, None, 1024)
    # It reads pairs of inputs: an odd in_features stays with oneDNN.
    with pytest.raises(RuntimeError, match="in_features=129 is odd"):
        ops.bf16_pack_weight(torch.randn(64, 129, dtype=torch.bfloat16))
    odd = torch.nn.Linear(129, 64).to(torch.bfloat16)
    assert PackedLinear(odd, bf16_dot=True).kernel == "onednn"


@needs_kernel
def test_bf16_linears_follow_bf16_dot(tiny_model_dir):
    # engine.bf16_dot (default on) packs a bf16 model's linears for our kernel; off, oneDNN's.
    # With ours a request gets the same tokens alone as among others (the tiny model's tokens
    # are not compared across the two kernels, whose bf16 roundings differ).
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(1, 30))
    crowd = [list(range(i, 2 * i + 20)) for i in range(1, 6)]
    kernels = {}
    for bf16_dot in (True, False):
        eng = Engine(model=str(tiny_model_dir), dtype="bfloat16", bf16_dot=bf16_dot)
        layer = eng.model.model.layers[0]
        kernels[bf16_dot] = {layer.self_attn.qkv_proj.kernel, layer.mlp.down_proj.kernel}
        if bf16_dot:
            alone = run_to_end(eng, [prompt], [params])[0]
            among = run_to_end(eng, [*crowd, prompt], [params] * 6)[-1]
            assert alone == among
    assert kernels == {True: {"bf16_dot"}, False: {"onednn"}}
