"""Building an engine's parts from its settings: the model (dtype, quantization, weights), the
tokenizer, the KV cache plan (one memory budget, split with the draft model's cache when there
is one), the block pools and the speculative draft model. Engine.__init__ takes the result."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from controlplane.engine.attention.backend import AttentionBackend
from controlplane.engine.attention.registry import auto_backend, backend_class
from controlplane.engine.block_pool import BlockPool
from controlplane.engine.draft import DraftModel
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.gguf.known import resolve_model_path
from controlplane.engine.kv_cache import STORAGE_DTYPES, KVCache, KVCacheSpec, plan_num_blocks
from controlplane.engine.loader import load_model, load_model_config, load_tokenizer
from controlplane.engine.model.config import ModelConfig
from controlplane.engine.model.linear import auto_dtype
from controlplane.engine.model.llama import CausalLM
from controlplane.engine.model.quant import QuantConfig, memory_use
from controlplane.engine.parallel.shm import shm_supported
from controlplane.engine.parallel.tensor_parallel import (
    TensorParallel,
    check_int4_groups,
    plan_shards,
)
from controlplane.engine.parallel.workers import WorkerSpec, free_init_method
from controlplane.engine.settings import EngineSettings
from controlplane.engine.tokenizer import Tokenizer
from controlplane.engine.types import MemoryUse

log = logging.getLogger("controlplane.engine.engine")  # the engine's load lines, as before

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidSettingError("device", "cuda requested but torch sees no CUDA device")
    return torch.device(name)


@dataclass(slots=True)
class EngineParts:
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    tokenizer: Tokenizer
    model: CausalLM
    kv_cache: KVCache
    memory: MemoryUse
    block_pool: BlockPool
    swap_pool: BlockPool
    draft: DraftModel | None
    workers: WorkerSpec | None = None  # tensor parallel: what ranks 1.. are built from


def make_backend(
    name: str, kv_cache: KVCache, device: torch.device, bf16_dot: bool = True
) -> AttentionBackend:
    """The `engine.attention_backend` setting's backend over `kv_cache` (auto: the registry's
    choice for `device`); InvalidSettingError says why a named one cannot run here.
    `bf16_dot`: engine.bf16_dot, for the C++ kernel."""
    if name == "auto":
        name = auto_backend(device)
    cls = backend_class(name)
    why = cls.unavailable(device)
    if why is not None:
        raise InvalidSettingError("attention_backend", f"{name} is not available here: {why}")
    return cls.create(kv_cache, bf16_dot)


def quant_config(quantization: str, s: EngineSettings, cfg: ModelConfig) -> QuantConfig:
    """What `quantization` (auto, none, int8, int4) means for a checkpoint stored as `cfg` says.

    auto keeps what the checkpoint stores quantized quantized as served: the linears in their
    nearest layout, a block-quantized lm_head and embedding table (a GGUF's Q8_0 token_embd)
    in int8, one shared table when tied. Otherwise `quantize_lm_head` decides the lm_head (with
    the linears quantized) and the embedding stays float.
    """
    dense = s.int4_dense_copy and s.cpu_weight_packing
    if quantization == "auto":
        return QuantConfig(
            cfg.stored_quantization,
            s.quantization_group_size,
            lm_head=cfg.stored_quantized_lm_head
            or (s.quantize_lm_head and cfg.stored_quantization != "none"),
            embedding=cfg.stored_quantized_embedding,
            dense=dense,
            int8_activations=s.quantize_activations,
            bf16_dot=s.bf16_dot,
            amx=s.amx,
        )
    return QuantConfig(
        quantization,
        s.quantization_group_size,
        s.quantize_lm_head and quantization != "none",
        dense=dense,
        int8_activations=s.quantize_activations,
        bf16_dot=s.bf16_dot,
        amx=s.amx,
    )


# Whether parallel/rank.py hands its ranks' load_model the QuantConfig rank 0 loads with.
def tensor_parallel_rank0(
    s: EngineSettings, cfg: ModelConfig, quant: QuantConfig, device: torch.device
) -> TensorParallel:
    """Rank 0's place in a tensor-parallel engine, once the split is known to be possible
    (InvalidSettingError naming tensor_parallel_size, or what it cannot run with yet)."""
    plan_shards(cfg, 0, s.tensor_parallel_size)  # raises naming the dimension it cannot split
    if quant.kind == "int4":  # groups must not straddle two ranks (parallel/tensor_parallel.py)
        check_int4_groups(cfg, s.tensor_parallel_size, quant.group_size)
    if s.tensor_parallel_comm == "shm" and (device.type == "cuda" or not shm_supported()):
        raise InvalidSettingError(
            "tensor_parallel_comm",
            "shm runs between CPU ranks of an x86 host (it relies on x86's store ordering); "
            "CUDA ranks use NCCL, other CPUs gloo (auto chooses)",
        )
    if device.type == "cuda" and torch.cuda.device_count() < s.tensor_parallel_size:
        raise InvalidSettingError(
            "tensor_parallel_size",
            f"{s.tensor_parallel_size} ranks need as many GPUs; "
            f"{torch.cuda.device_count()} visible",
        )
    return TensorParallel(0, s.tensor_parallel_size)


def build(s: EngineSettings) -> EngineParts:
    """The parts of an engine for checked settings `s` (ModelLoadError, InvalidSettingError)."""
    if not s.model:
        raise InvalidSettingError("model", "a model directory is required")
    model_dir = resolve_model_path(s.model)  # a directory, a .gguf file, or an alias
    cfg = load_model_config(model_dir)
    device = resolve_device(s.device)
    if s.attention_backend == "triton" and device.type == "cpu":
        from controlplane.engine.attention.triton import ensure_interpreter_on_cpu

        ensure_interpreter_on_cpu(device)  # before loading: torch itself imports triton
    quant = quant_config(s.quantization, s, cfg)
    # Explicit values were validated against DTYPES; "auto" is what this device runs fast.
    if s.dtype == "auto":
        dtype, why = auto_dtype(cfg.torch_dtype, device, quantized=quant.kind != "none")
        log.info("dtype auto: %s (%s)", str(dtype).removeprefix("torch."), why)
    else:
        dtype = _DTYPES[s.dtype]
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None and cfg.sliding_window < limit:
        # Full attention equals sliding-window attention while sequences fit the window.
        log.info("capping max_model_len at the model's sliding window (%d)", cfg.sliding_window)
        limit = cfg.sliding_window
    max_model_len = min(s.max_model_len or limit, limit)

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(model_dir)
    kind = quant.kind
    if s.quantization == "auto":
        log.info("quantization auto: %s (how the checkpoint stores its linear weights)", kind)
    tp = None
    if s.tensor_parallel_size > 1:
        tp = tensor_parallel_rank0(s, cfg, quant, device)
    model = load_model(
        model_dir,
        cfg,
        dtype,
        device,
        max_model_len,
        s.cpu_weight_packing,
        quant,
        huge_pages=s.huge_pages,
        tp=tp,
    )
    log.info(
        "loaded %s (%s, %.1fM params, %s on %s) in %.2fs",
        model_dir,
        cfg.architecture,
        cfg.num_params / 1e6,
        dtype,
        device,
        time.perf_counter() - t0,
    )
    kv_dtype = STORAGE_DTYPES.get(s.kv_cache_dtype, dtype)  # auto: the model's dtype
    # Tensor parallel: each rank's KV cache holds its own KV heads (rank 0's plan sizes all).
    spec = KVCacheSpec.for_model(model.config, s.block_size, kv_dtype)
    draft_cfg = draft_spec = None
    share = 1.0  # of the KV budget, for the target's cache
    if s.speculative_draft_model:
        draft_dir = resolve_model_path(s.speculative_draft_model)
        draft_cfg = load_model_config(draft_dir)
        if draft_cfg.vocab_size != cfg.vocab_size:
            raise InvalidSettingError(
                "speculative_draft_model",
                f"vocabulary of {draft_cfg.vocab_size} tokens; the target's has "
                f"{cfg.vocab_size} (the draft must share the target's tokenizer)",
            )
        draft_spec = KVCacheSpec.for_model(draft_cfg, s.block_size, kv_dtype)
        # One budget, split so that both caches hold the same number of tokens.
        share = spec.bytes_per_block / (spec.bytes_per_block + draft_spec.bytes_per_block)
    num_blocks, why = plan_num_blocks(
        spec,
        device,
        cpu_bytes=int(s.kv_cache_memory_bytes * share),
        gpu_fraction=s.gpu_memory_utilization * share,
        explicit=s.num_kv_blocks,
    )
    if num_blocks < 1:
        raise InvalidSettingError("kv_cache_memory_bytes", f"budget holds no KV block ({why})")
    num_swap = s.swap_space_bytes // spec.bytes_per_block
    log.info("KV cache: %s; swap space: %d blocks", why, num_swap)
    kv_cache = KVCache(spec, num_blocks, num_swap, device)
    workers = None
    if tp is not None:  # the engine starts them (parallel/rank.py)
        workers = WorkerSpec(
            s, str(model_dir), free_init_method(), dtype, quant, max_model_len, num_blocks, num_swap
        )
    memory = memory_use(model, spec, num_blocks, kind, dtype)
    log.info("memory: %s", memory.describe())
    block_pool = BlockPool(num_blocks)
    block_pool.enable_caching = s.enable_prefix_caching
    swap_pool = BlockPool(num_swap)
    draft: DraftModel | None = None
    if draft_cfg is not None and draft_spec is not None:
        t0 = time.perf_counter()
        draft_quant = quant_config(s.speculative_draft_quantization, s, draft_cfg)
        draft_model = load_model(
            draft_dir,
            draft_cfg,
            dtype,
            device,
            max_model_len,
            s.cpu_weight_packing,
            draft_quant,
            huge_pages=s.huge_pages,
        )
        draft = DraftModel(draft_model, KVCache(draft_spec, num_blocks, 0, device), device)
        log.info(
            "draft model %s (%s linears, %.1fM params) in %.2fs; its KV cache: %d blocks",
            draft_dir,
            draft_quant.kind,
            draft_cfg.num_params / 1e6,
            time.perf_counter() - t0,
            num_blocks,
        )
    return EngineParts(
        cfg,
        device,
        dtype,
        max_model_len,
        tokenizer,
        model,
        kv_cache,
        memory,
        block_pool,
        swap_pool,
        draft,
        workers,
    )
