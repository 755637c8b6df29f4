"""model/arena.py: the weights a CPU decode step streams, in one region on 2 MB pages, in the
order a step reads them (engine.huge_pages)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.model import quant
from controlplane.engine.model.arena import HUGE_PAGE, _huge_region
from controlplane.engine.model.linear import PackedLinear
from tests.conftest import require_smollm2, run_to_end


def _streamed(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors the arena moves, in module order."""
    found = []
    for m in model.modules():
        if isinstance(m, quant.Int4Linear):
            found += [m.packed, m.scales_and_zeros]
        elif isinstance(m, quant.Int8Linear | quant.Int8Embedding):
            found += [m.qweight, m.scales]
        elif isinstance(m, PackedLinear) and m.kernel == "bf16_dot":
            found.append(m.packed)
    return found


def test_quantized_weights_lie_in_step_order_in_one_huge_page_region(tiny_model_dir):
    kw = dict(
        model=str(tiny_model_dir),
        quantization="int4",
        quantize_lm_head=True,
        kv_cache_memory_bytes=8 << 20,
    )
    placed, plain = Engine(**kw), Engine(**kw, huge_pages=False)
    tensors = _streamed(placed.model)
    assert len(tensors) > 10
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1  # one region
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts)  # in the order the modules run
    assert min(starts) % HUGE_PAGE == 0 and all(s % 64 == 0 for s in starts)
    # Not so without it: the loader's own allocations.
    assert len({t.untyped_storage().data_ptr() for t in _streamed(plain.model)}) > 1
    # The same bits: the same tokens and logits.
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 3
    prompts = [list(range(1, 30)), list(range(5, 12)), list(range(40, 90))]
    assert run_to_end(placed, prompts, params) == run_to_end(plain, prompts, params)


def test_a_tied_quantized_table_is_placed_once():
    # SmolLM2's GGUF: the Q8_0 token table is the embedding and the lm_head, one int8 tensor.
    eng = Engine(model=str(require_smollm2()), kv_cache_memory_bytes=16 << 20, compile="off")
    model = eng.model
    assert model.lm_head.qweight is model.model.embed_tokens.qweight
    region = model.lm_head.qweight.untyped_storage().data_ptr()
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.packed.untyped_storage().data_ptr() == region
    # The region holds each tensor once: its size is their sum, cache-line rounded.
    tensors = {t.data_ptr(): t for t in _streamed(model)}
    size = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors.values())
    assert model.lm_head.qweight.untyped_storage().nbytes() == size + HUGE_PAGE


def test_bf16_panels_are_placed_too(tiny_model_dir):
    eng = Engine(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory_bytes=8 << 20)
    panels = [m.packed for m in eng.model.modules() if isinstance(m, PackedLinear)]
    ours = [
        m for m in eng.model.modules() if isinstance(m, PackedLinear) and m.kernel == "bf16_dot"
    ]
    if not ours:  # oneDNN's opaque weights (no AVX512-BF16 here, or AMX): nothing to place
        assert all(p.is_mkldnn for p in panels)
        return
    assert len({m.packed.untyped_storage().data_ptr() for m in ours}) == 1


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, in kB."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_the_region_is_on_huge_pages_where_linux_grants_them():
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    region = _huge_region(8 * HUGE_PAGE)
    region.fill_(1)  # the pages exist once written
    assert region.data_ptr() % HUGE_PAGE == 0
    # (A shared anonymous map, Python's default, stayed on 4 KB pages: 0 kB here.)
    assert _huge_kb(region.data_ptr()) >= 4 * HUGE_PAGE // 1024
