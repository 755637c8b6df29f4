"""Load a checkpoint into `CausalLM`: a Hugging Face directory or a GGUF file.

The model is built on the meta device, then each parameter is assigned its tensor: from a
directory, the tensor safetensors maps from the file (zero-copy on CPU when the dtype already
matches); from a `.gguf` file, the tensor dequantized from its blocks (see engine/gguf); from
a directory that holds `random_weights.json` instead of weights, a random tensor generated on
the device (benchmarks of shapes no checkpoint on disk is worth: `random_state`).

A tensor-parallel rank reads only its part of each tensor from safetensors (`get_slice`) and
GGUF files (gguf/slices.py: its rows, or its block-aligned columns, dequantized alone); random
weights are drawn whole, so that every rank draws the same model, then sliced. Quantization
comes after loading, so each rank quantizes its own part (parallel/tensor_parallel.py says
why that equals quantizing the whole model, or where it cannot and is refused).
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from controlplane.engine.errors import ModelLoadError
from controlplane.engine.gguf.known import is_gguf
from controlplane.engine.model.arena import place_weights
from controlplane.engine.model.config import ModelConfig, config_from_hf_dir
from controlplane.engine.model.linear import PackedLinear, cpu_packing_supported, pack_linears
from controlplane.engine.model.llama import CausalLM, RotaryEmbedding, fuse_projections
from controlplane.engine.model.quant import QuantConfig, quantize_model
from controlplane.engine.parallel.tensor_parallel import (
    ShardPlan,
    TensorParallel,
    check_int4_groups,
    local_config,
    take_shard,
)
from controlplane.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def load_model_config(model: str | Path) -> ModelConfig:
    """Hyper-parameters from a model directory's config.json, or from a `.gguf` file's metadata."""
    if is_gguf(model):
        from controlplane.engine.gguf.config import config_from_gguf

        return config_from_gguf(model)
    return config_from_hf_dir(model)


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise ModelLoadError(f"{path}: shard listed in {index.name} is missing")
        return files
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    cpu_weight_packing: bool = True,
    quant: QuantConfig | None = None,
    fuse: bool = True,
    huge_pages: bool = True,
    tp: TensorParallel | None = None,
) -> CausalLM:
    """`tp`: load this rank's shard of a tensor-parallel model (engine/parallel)."""
    model_dir = Path(model_dir)
    shards = None if tp is None else tp.plan(cfg)
    with torch.device("meta"):
        model = CausalLM(cfg, max_len)
        if shards is not None:
            local = CausalLM(local_config(cfg, shards), max_len, tp, shards)
    if shards is not None and quant is not None and quant.kind == "int4":
        check_int4_groups(cfg, shards.size, quant.group_size)  # a direct caller's too
    read_by_slice = False  # whether only this rank's part of each tensor was read
    if is_gguf(model_dir):
        state = _gguf_state(model_dir, model, cfg, dtype, device, shards)
        read_by_slice = True
    elif (model_dir / RANDOM_WEIGHTS_FILE).is_file():
        state = random_state(model_dir, model, cfg, dtype, device)
    else:
        state = _safetensors_state(model_dir, model, cfg, dtype, device, shards)
        read_by_slice = True
    if shards is not None:
        if not read_by_slice:
            # Whole tensors (random weights are drawn whole, so every rank draws the same
            # model): this rank's part of each.
            state = {name: take_shard(name, t, shards, cfg) for name, t in state.items()}
        model = local
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if fuse:
        fuse_projections(model)
    # Buffers computed, not loaded: build them for real now.
    model.rotary = RotaryEmbedding(cfg, max_len).to(device)
    if quant is not None and (quant.kind != "none" or quant.lm_head or quant.embedding):
        del state  # each layer's float weight is freed as soon as its quantized one replaces it
        quantize_model(model, quant)
    if device.type == "cpu" and cpu_weight_packing and cpu_packing_supported(dtype):
        # A tied lm_head stays unpacked: packing it would duplicate the embedding table.
        skip = ("lm_head",) if cfg.tie_word_embeddings else ()
        bf16_dot = quant is None or quant.bf16_dot
        count = pack_linears(model, skip, bf16_dot)
        kernels = sorted({m.kernel for m in model.modules() if isinstance(m, PackedLinear)})
        log.info("packed %d linear layers (%s)", count, ", ".join(kernels) or "none")
    if device.type == "cpu" and huge_pages:
        moved = place_weights(model)
        if moved:
            log.info("%.1f MiB of weights placed in step order on 2 MB pages", moved / 2**20)
    model.eval()
    return model


def _loaded_parameters(model: CausalLM, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, for every parameter read from the checkpoint."""
    return {
        name: tuple(param.shape)
        for name, param in model.named_parameters()
        if not (name == "lm_head.weight" and cfg.tie_word_embeddings)
    }


def _safetensors_state(
    model_dir: Path,
    model: CausalLM,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shards: ShardPlan | None = None,
) -> dict[str, torch.Tensor]:
    """Every parameter's tensor; with `shards`, only this rank's part of each is read."""
    files = weight_files(model_dir)
    state: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = {
            p: stack.enter_context(safe_open(p, framework="pt")) for p in set(files.values())
        }
        for name, expected in _loaded_parameters(model, cfg).items():
            path = files.get(name)
            if path is None:
                raise ModelLoadError(f"{model_dir}: tensor {name!r} is missing from the checkpoint")
            shape = handles[path].get_slice(name).get_shape()
            if tuple(shape) != expected:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has shape {tuple(shape)}, expected {expected}"
                )
            # Same dtype on CPU: the mmap'd tensor itself, no copy.
            if shards is None:
                tensor = handles[path].get_tensor(name)
            else:
                tensor = take_shard(name, handles[path].get_slice(name), shards, cfg)
            state[name] = tensor.to(device=device, dtype=dtype)
    return state


# In a model directory instead of weights: `{"seed": 0, "std": 0.02}` (both optional).
RANDOM_WEIGHTS_FILE = "random_weights.json"


def random_state(
    model_dir: Path, model: CausalLM, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Random weights for a directory with `random_weights.json` (config.json and the tokenizer
    beside it, no weight file): each tensor generated on `device` in `dtype` by a generator of
    that device seeded with `seed`, normal(0, `std`) for the linears and embeddings, ones for
    the norms. An 8B model's 16 GB take seconds on a GPU, against minutes to write and read a
    checkpoint; the same seed gives the same weights on the same device and torch."""
    path = model_dir / RANDOM_WEIGHTS_FILE
    try:
        spec = json.loads(path.read_text() or "{}")
        seed, std = int(spec.get("seed", 0)), float(spec.get("std", 0.02))
    except (ValueError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{path}: not a JSON object with a seed and a std ({exc})") from exc
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in _loaded_parameters(model, cfg).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            state[name] = t.normal_(0.0, std, generator=gen)
    return state


def _gguf_state(
    path: Path,
    model: CausalLM,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shards: ShardPlan | None = None,
) -> dict[str, torch.Tensor]:
    """Every parameter's tensor; with `shards`, only this rank's part of each is dequantized."""
    from controlplane.engine.gguf import weights
    from controlplane.engine.gguf.file import open_gguf
    from controlplane.engine.gguf.slices import TensorPart

    def take(name: str, part: TensorPart) -> torch.Tensor:
        assert shards is not None
        return take_shard(name, part, shards, cfg)

    return weights.load_state_dict(
        open_gguf(path),
        cfg,
        _loaded_parameters(model, cfg),
        dtype,
        device,
        None if shards is None else take,
    )


def load_tokenizer(model: str | Path) -> Tokenizer:
    """The tokenizer of a model directory (tokenizer.json) or of a GGUF file (its metadata)."""
    if is_gguf(model):
        from controlplane.engine.gguf.tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(model)
    return Tokenizer.from_dir(model)
