"""Load a Hugging Face-format checkpoint into `CausalLM` without a second copy in RAM.

The model is built on the meta device, then each parameter is assigned the tensor that
safetensors maps from the file (zero-copy on CPU when the dtype already matches).
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from controlplane.engine.errors import ModelLoadError
from controlplane.engine.model.config import ModelConfig
from controlplane.engine.model.linear import cpu_packing_supported, pack_linears
from controlplane.engine.model.llama import CausalLM, RotaryEmbedding

log = logging.getLogger(__name__)


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
) -> CausalLM:
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg, max_len)
    state: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = {
            p: stack.enter_context(safe_open(p, framework="pt")) for p in set(files.values())
        }
        for name, param in model.named_parameters():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            path = files.get(name)
            if path is None:
                raise ModelLoadError(f"{model_dir}: tensor {name!r} is missing from the checkpoint")
            shape = handles[path].get_slice(name).get_shape()
            if tuple(shape) != tuple(param.shape):
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has shape {tuple(shape)}, expected {tuple(param.shape)}"
                )
            # Same dtype on CPU: the mmap'd tensor itself, no copy.
            state[name] = handles[path].get_tensor(name).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    # Buffers computed, not loaded: build them for real now.
    model.rotary = RotaryEmbedding(cfg, max_len).to(device)
    if device.type == "cpu" and cpu_weight_packing and cpu_packing_supported(dtype):
        # A tied lm_head stays unpacked: packing it would duplicate the embedding table.
        skip = ("lm_head",) if cfg.tie_word_embeddings else ()
        log.info("packed %d linear layers for oneDNN", pack_linears(model, skip))
    model.eval()
    return model
