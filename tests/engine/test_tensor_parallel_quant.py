"""Tensor parallelism with quantized weights (engine/parallel, engine/gguf/slices.py): a GGUF
file's int4 blocks over two ranks give one rank's logits, each rank dequantizing only its part
of every tensor; int8 linears over two ranks; int4 groups that would straddle two ranks are
refused naming the setting; a sliced GGUF read is the whole read, sliced.

The split itself is test_tensor_parallel.py's (`_logits`, `_split`), each rank handed the
QuantConfig."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.loader import load_model, load_model_config
from controlplane.engine.model.quant import Int4Linear, Int8Embedding, Int8Linear, QuantConfig
from controlplane.engine.parallel.tensor_parallel import TensorParallel, plan_shards, take_shard
from controlplane.engine.settings import EngineSettings
from tests.engine.test_tensor_parallel import _logits, _split


def _quant(quantization: str, model: Path, **settings: object) -> QuantConfig:
    """What the engine loads `model` with for `quantization` (parts.quant_config)."""
    from controlplane.engine.parts import quant_config

    s = EngineSettings(model=str(model), cpu_weight_packing=False, **settings)
    return quant_config(quantization, s, load_model_config(model))


def _int4_gguf(path: Path, tokenizer: bool = False) -> Path:
    """The tiny Llama GGUF (test_gguf.py: hidden 64, 4 heads, 2 KV heads, MLP 256, vocabulary
    256, tied) with every linear in Q4_0 / Q4_1 blocks of 32 and the embedding in Q8_0. The
    row-parallel layers' shares of K over two ranks (32 and 128) are whole blocks."""
    import gguf

    from tests.engine.test_gguf import write_tiny_gguf

    T = gguf.GGMLQuantizationType
    g = np.random.default_rng(11)
    shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64)}
    shapes |= {"ffn_gate": (256, 64), "ffn_up": (256, 64), "ffn_down": (64, 256)}
    tensors = {}
    for i, (name, shape) in enumerate(shapes.items()):
        qtype = (T.Q4_0, T.Q4_1)[i % 2]
        w = g.standard_normal(shape).astype(np.float32) * 0.1
        tensors[f"blk.0.{name}.weight"] = (gguf.quantize(w, qtype), qtype)
    embed = g.standard_normal((256, 64)).astype(np.float32)
    tensors["token_embd.weight"] = (gguf.quantize(embed, T.Q8_0), T.Q8_0)
    return write_tiny_gguf(path, tensors=tensors, tokenizer=tokenizer)


def _weights(model: Path, quant: QuantConfig, tp: TensorParallel | None) -> dict[str, Tensor]:
    """Every quantized layer's weight as served, loaded unfused: read back through the layer
    itself (an identity's rows, each output one weight times one; the CPU kernels' layouts are
    opaque), so it holds whatever rounding the kernel's storage applies."""
    cfg = load_model_config(model)
    cpu = torch.device("cpu")
    net = load_model(model, cfg, torch.float32, cpu, 64, False, quant, False, False, tp)
    served: dict[str, Tensor] = {}
    with torch.inference_mode():
        for name, m in net.named_modules():
            if isinstance(m, Int4Linear | Int8Linear):
                served[name] = m(torch.eye(m.in_features)).t().float()
            elif isinstance(m, Int8Embedding):  # a rank's: the table inside its embedding
                served[name.removesuffix(".table")] = m(torch.arange(m.num_embeddings)).float()
    return served


def test_two_ranks_of_an_int4_gguf_compute_one_ranks_logits(tmp_path: Path) -> None:
    """quantization auto on Q4 blocks: int4 linears (group 32, each block one group), the tied
    Q8_0 embedding and lm_head one int8 table. Each rank dequantizes only its rows or its
    block-aligned columns and quantizes them into the same groups and rows as the whole model:
    every rank's quantized weights are exactly the whole model's, sliced.

    The logits are not one rank's within float32's 1e-5: this CPU's int4 kernel
    (_weight_int4pack_mm_for_cpu) takes and returns bfloat16, so each rank rounds its partial
    sum of o and down to 8 bits before the float32 all-reduce, where one rank rounds the whole
    sum once. They differ by those bfloat16 roundings (2^-9 relative each): measured 0.079 on
    logits up to 30.4 (2.6e-3 of the largest; int4 against the float blocks: 2.06), held to
    1e-2 of the largest. (A near-tie's argmax may flip: one prompt row's did.)"""
    from controlplane.engine.gguf.file import clear_cache

    model = _int4_gguf(tmp_path / "q4.gguf")
    clear_cache()
    quant = _quant("auto", model)
    assert (quant.kind, quant.group_size, quant.lm_head, quant.embedding) == (
        "int4",
        32,
        True,
        True,
    )
    whole = _weights(model, quant, None)
    cfg = load_model_config(model)
    for rank in range(2):
        plan = plan_shards(cfg, rank, 2)
        for name, w in _weights(model, quant, TensorParallel(rank, 2)).items():
            expected = take_shard(f"{name}.weight", whole[name], plan, cfg)
            assert torch.equal(w, expected), name
    one = _logits(model, None, quant)
    for logits in _split(model, 2, tmp_path, "gloo", quant):
        assert float((logits - one).abs().max()) <= 1e-2 * float(one.abs().max())


def test_two_ranks_of_int8_linears_compute_close_to_one_ranks_logits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """quantization int8 with an int8 lm_head, safetensors read by slice. Column-parallel
    layers and the lm_head quantize exactly as the whole model's rows; the row-parallel o and
    down keep one scale per output row of each rank's half of K (the whole row's would need the
    other rank's weights), so their weights round differently from one rank's: the logits
    differ by the int8 rounding, no more than one rank's int8 logits differ from float ones,
    and the greedy tokens are the same."""
    int8 = _quant("int8", tiny_model_dir, quantize_lm_head=True)
    assert (int8.kind, int8.lm_head) == ("int8", True)
    whole = _logits(tiny_model_dir, None, int8)
    floats = _logits(tiny_model_dir, None, QuantConfig())
    rounding = float((whole - floats).abs().max())
    for logits in _split(tiny_model_dir, 2, tmp_path, "gloo", int8):
        assert float((logits - whole).abs().max()) <= rounding
        assert torch.equal(logits.argmax(-1), whole.argmax(-1))


def test_int4_groups_that_would_straddle_two_ranks_are_refused(tiny_model_dir: Path) -> None:
    """The tiny model's o_proj has 64 input features: 32 a rank over two ranks, half a group of
    64. Refused at start-up, naming the setting, the layer, K, the group size and the ranks,
    and what would serve; groups of 32 fit."""
    from controlplane.engine.parts import tensor_parallel_rank0

    cfg = load_model_config(tiny_model_dir)
    s = EngineSettings(model=str(tiny_model_dir), tensor_parallel_size=2)
    cpu = torch.device("cpu")
    int4 = QuantConfig("int4", 64)
    match = (
        r"tensor_parallel_size: int4 groups of 64 input features \(quantization_group_size\) "
        r"would straddle the ranks in o_proj: its 64 input features over 2 ranks are 32 a rank"
        r".*quantization_group_size = 32 would serve"
    )
    with pytest.raises(InvalidSettingError, match=match):
        tensor_parallel_rank0(s, cfg, int4, cpu)
    with pytest.raises(InvalidSettingError, match=match):  # a direct load is checked too
        load_model(tiny_model_dir, cfg, torch.float32, cpu, 64, quant=int4, tp=TensorParallel(0, 2))
    # An MLP of 32 over 4 ranks: 8 features a rank, fewer than any int4 group size.
    wide = dataclasses.replace(cfg, num_heads=8, head_dim=32, intermediate_size=32)
    with pytest.raises(InvalidSettingError, match=r"down_proj: its 32 input features over 4"):
        tensor_parallel_rank0(
            dataclasses.replace(s, tensor_parallel_size=4), wide, QuantConfig("int4", 32), cpu
        )


def test_a_sliced_gguf_read_is_the_whole_read_sliced(tmp_path: Path, caplog) -> None:
    """Each rank's part of every tensor (q/k rows unpermuted as read, the vocabulary padded,
    o/down columns) equals the whole tensor dequantized, then sliced; a column slice that cuts
    through Q4_K's 256-value blocks falls back to whole rows and says so."""
    import gguf

    from controlplane.engine.gguf import weights
    from controlplane.engine.gguf.file import clear_cache, open_gguf
    from controlplane.engine.gguf.slices import TensorPart, read
    from controlplane.engine.parallel.tensor_parallel import ShardPlan
    from tests.engine.test_gguf import write_tiny_gguf

    model = _int4_gguf(tmp_path / "q4.gguf")
    clear_cache()
    cfg = load_model_config(model)
    mapped = weights.engine_tensors(open_gguf(model), cfg)
    # Two ranks: o's and down's columns are whole blocks of 32 (read alone). A made-up third
    # plan: columns that cut through blocks (o: 16 a head, down: 80 a rank; whole rows read,
    # then sliced) and the vocabulary of 256 padded to 258.
    plans = [plan_shards(cfg, rank, 2) for rank in range(2)]
    plans += [
        ShardPlan(
            r,
            3,
            range(r, r + 1),
            range(r % 2, r % 2 + 1),
            range(80 * r, 80 * r + 80),
            range(86 * r, 86 * r + 86),
            256,
        )
        for r in range(3)
    ]
    for plan in plans:
        for name, t in mapped.items():
            got = take_shard(name, TensorPart(t), plan, cfg)
            assert torch.equal(got, take_shard(name, weights.dequantize(t), plan, cfg)), name

    # Q4_K: 144 bytes a block of 256 values (d and dmin in float16 first, kept finite here).
    raw = np.random.default_rng(4).integers(0, 256, (64, 144), dtype=np.uint8)
    raw[:, 0:4] = np.frombuffer(np.array([0.01, 0.002], np.float16).tobytes(), np.uint8)
    T = gguf.GGMLQuantizationType
    path = write_tiny_gguf(tmp_path / "q4k.gguf", tensors={"blk.0.ffn_down.weight": (raw, T.Q4_K)})
    clear_cache()
    down = open_gguf(path).tensors["blk.0.ffn_down.weight"]
    whole = weights.dequantize(down)
    with caplog.at_level(logging.INFO, logger="controlplane.engine.gguf.slices"):
        assert torch.equal(read(down, cols=slice(128, 256)), whole[:, 128:])
    assert "columns 128:256 cut through Q4_K blocks of 256 values" in caplog.text
    assert torch.equal(read(down, slice(10, 20)), whole[10:20])


def test_an_engine_over_two_ranks_serves_an_int4_gguf_as_one_rank_does(tmp_path: Path) -> None:
    """The engine's workers quantize their shards as rank 0 does (WorkerSpec.quant): the
    ranks' weights are int4-sized, and greedy tokens follow one rank's up to a near-tie (the
    bfloat16 roundings of the test above; the rule of tests/engine/test_structured.py)."""
    from controlplane.engine import Engine, SamplingParams
    from controlplane.engine.gguf.file import clear_cache
    from tests.engine.test_structured import assert_same_up_to_ties

    model = _int4_gguf(tmp_path / "q4.gguf", tokenizer=True)
    clear_cache()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44], [200, 3, 9]]

    def greedy(engine: Engine) -> list[tuple[list[int], list]]:
        ids = [engine.add_request(p, params) for p in prompts]
        got: dict[str, tuple[list[int], list]] = {i: ([], []) for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert not out.error, out.error
                got[out.request_id][0].extend(out.new_token_ids)
                got[out.request_id][1].extend(out.logprobs)
        return [got[i] for i in ids]

    one = Engine(model=str(model), dtype="float32")
    expected = greedy(one)
    two = Engine(model=str(model), dtype="float32", tensor_parallel_size=2)
    try:
        ranks = two.rank_stats()
        actual = greedy(two)
    finally:
        two.close()
    # Int4 linears (half a byte a weight) on both ranks: each holds about half of one rank's.
    assert ranks is not None and ranks[0].weights_bytes == ranks[1].weights_bytes
    assert ranks[0].weights_bytes < 0.75 * one.memory.weights_bytes
    for a, b in zip(expected, actual, strict=True):
        assert_same_up_to_ties(a, b)
