"""Tensor parallelism (Megatron-style) on torch.distributed: which slice of every weight a rank
holds, and the two collectives a layer needs.

A model of `size` ranks splits, per layer:
- q/k/v and gate/up column-parallel (each rank computes its heads and its slice of the MLP's
  intermediate rows), o and down row-parallel (each rank multiplies its slice of the inputs)
  followed by one all-reduce each: two all-reduces a layer;
- the KV heads across ranks when the ranks divide them; with fewer KV heads than ranks (and
  the ranks a multiple of them), each KV head is replicated on the ranks whose query heads
  read it;
- the vocabulary, padded to a multiple of the ranks, for the embedding (each rank looks up the
  ids in its range, zeros elsewhere, then an all-reduce) and the lm_head (each rank computes
  its vocabulary slice's logits, gathered on every rank: the sampler needs the whole row, and
  a gather of [rows, vocab / size] per step is small beside the weights each rank reads).
Norms, rotary tables and biases of row-parallel layers (none in these architectures) are
replicated.

Quantized weights: the loader quantizes after loading, so each rank quantizes its own part.
- Column-parallel layers (and the vocabulary's rows) are split by output rows, and every format
  quantizes rows independently (int8 and FP8: one scale a row; int4: groups along a row): a
  rank's part quantizes exactly as the same rows of the whole tensor do.
- Row-parallel layers (o, down) are split along their input features K. int4 groups run along
  K, so a rank's share of K must be a multiple of the group size, or a group would straddle
  two ranks: `check_int4_groups` refuses that split at start-up rather than pad each rank's
  share into groups the whole model does not have. int8 and FP8 keep one scale per output row
  of each rank's share (a group of K / size features): the scale of the whole row would need
  every rank's weights, and each rank reads only its own; finer scales round no worse, but the
  logits differ from one rank's by the rounding of the weights, not only of the sums.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.model.config import ModelConfig
from controlplane.engine.parallel.shm import ShmGroup
from controlplane.engine.settings import INT4_GROUP_SIZES

VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What rank `rank` of `size` holds, as ranges of the full model's rows or columns."""

    rank: int
    size: int
    heads: range  # query heads
    kv_heads: range
    intermediate: range  # MLP intermediate rows
    vocab: range  # rows of the padded vocabulary (may run past vocab_size on the last rank)
    vocab_size: int  # the model's own (unpadded)


def plan_shards(cfg: ModelConfig, rank: int, size: int) -> ShardPlan:
    """The slices of rank `rank`; InvalidSettingError naming tensor_parallel_size and the
    dimension it does not divide."""
    if size < 1 or not 0 <= rank < size:
        raise InvalidSettingError("tensor_parallel_size", f"rank {rank} of {size}")

    def even(what: str, n: int) -> range:
        if n % size:
            raise InvalidSettingError(
                "tensor_parallel_size",
                f"must divide the model's {what} ({n}); {size} does not",
            )
        k = n // size
        return range(rank * k, (rank + 1) * k)

    heads = even("attention heads", cfg.num_heads)
    kv = cfg.num_kv_heads
    if kv % size == 0:
        kv_heads = even("KV heads", kv)
    elif size % kv == 0:  # fewer KV heads than ranks: each rank holds the one its heads read
        per_kv = size // kv
        kv_heads = range(rank // per_kv, rank // per_kv + 1)
    else:
        raise InvalidSettingError(
            "tensor_parallel_size",
            f"must divide the model's KV heads ({kv}) or be a multiple of them; {size} is neither",
        )
    per_vocab = -(-cfg.vocab_size // size)
    return ShardPlan(
        rank=rank,
        size=size,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=even("MLP intermediate size", cfg.intermediate_size),
        vocab=range(rank * per_vocab, (rank + 1) * per_vocab),
        vocab_size=cfg.vocab_size,
    )


def row_parallel_inputs(cfg: ModelConfig) -> dict[str, int]:
    """The input features (K) of each row-parallel layer: what the ranks split."""
    return {"o_proj": cfg.num_heads * cfg.head_dim, "down_proj": cfg.intermediate_size}


def check_int4_groups(cfg: ModelConfig, size: int, group_size: int) -> None:
    """InvalidSettingError naming tensor_parallel_size when int4 groups of `group_size` input
    features would straddle two ranks' shares of a row-parallel layer's K, with what would
    serve instead."""
    for layer, k in row_parallel_inputs(cfg).items():
        share = k // size
        if share % group_size == 0:
            continue
        first = share // group_size * group_size  # the group rank 1's share starts inside
        fits = [g for g in INT4_GROUP_SIZES if share % g == 0]
        instead = (
            f"quantization_group_size = {' or '.join(map(str, fits))}"
            if fits
            else f"a tensor_parallel_size whose share of {k} is a multiple of {group_size}"
        )
        raise InvalidSettingError(
            "tensor_parallel_size",
            f"int4 groups of {group_size} input features (quantization_group_size) would "
            f"straddle the ranks in {layer}: its {k} input features over {size} ranks are "
            f"{share} a rank, so rank 1's share starts at feature {share}, inside the group "
            f"of features {first}-{first + group_size - 1} (each rank quantizes only its "
            f"own share); {instead} would serve, or quantization = int8",
        )


def local_config(cfg: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The hyper-parameters of one rank's modules (the KV cache is sized from them too)."""
    return dataclasses.replace(
        cfg,
        num_heads=len(plan.heads),
        num_kv_heads=len(plan.kv_heads),
        intermediate_size=len(plan.intermediate),
        vocab_size=len(plan.vocab),
    )


def _rows(heads: range, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def shard_index(name: str, plan: ShardPlan, cfg: ModelConfig) -> tuple[int, slice] | None:
    """(dimension, slice) of the full tensor `name` this rank holds; None: the whole tensor.
    The vocabulary's slice may run past the tensor (the padding: see `take_shard`)."""
    d = cfg.head_dim
    if name.endswith(VOCAB_TENSORS):
        return 0, slice(plan.vocab.start, plan.vocab.stop)
    if ".q_proj." in name:
        return 0, _rows(plan.heads, d)
    if ".k_proj." in name or ".v_proj." in name:
        return 0, _rows(plan.kv_heads, d)
    if name.endswith("o_proj.weight"):
        return 1, _rows(plan.heads, d)
    if ".gate_proj." in name or ".up_proj." in name:
        return 0, slice(plan.intermediate.start, plan.intermediate.stop)
    if name.endswith("down_proj.weight"):
        return 1, slice(plan.intermediate.start, plan.intermediate.stop)
    return None


def take_shard(name: str, source: Any, plan: ShardPlan, cfg: ModelConfig) -> torch.Tensor:
    """This rank's part of tensor `name` from `source`: a tensor, a safetensors slice or a GGUF
    tensor (gguf/slices.py's TensorPart): of those two only the shard's bytes are read. Rows of
    the padded vocabulary past vocab_size are zeros (int8 quantizes a zero row to zeros with a
    tiny scale: quant/weights.py's TINY)."""
    where = shard_index(name, plan, cfg)
    if where is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    dim, part = where
    if dim == 1:
        return source[:, part]
    if not name.endswith(VOCAB_TENSORS) or part.stop <= plan.vocab_size:
        return source[part]
    stop = max(part.start, plan.vocab_size)  # the vocabulary's last slice: padded
    got = source[part.start : stop]
    pad = part.stop - stop
    return torch.cat([got, got.new_zeros((pad, *got.shape[1:]))])


@dataclass(slots=True)
class TensorParallel:
    """A rank's place in the tensor-parallel group and its collectives: over shared memory
    (`shm`, parallel/shm.py: CPU ranks of one x86 host, engine.tensor_parallel_comm), else
    torch.distributed (gloo on a CPU, NCCL on CUDA; `group` None: the default process group).
    `shm` is set once the group's segment exists (rank 0: by Workers, after its model is
    built). `clock` sums the host's wall time inside the collectives (the all-reduce share of
    a step, RankStats)."""

    rank: int
    size: int
    group: Any = None
    clock: CollectiveClock = field(default_factory=lambda: CollectiveClock())
    shm: ShmGroup | None = None

    def plan(self, cfg: ModelConfig) -> ShardPlan:
        return plan_shards(cfg, self.rank, self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        if self.shm is not None:
            self.shm.all_reduce(x)
        else:
            dist.all_reduce(x, group=self.group)
        self.clock.seconds += time.perf_counter() - t0
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[rows, vocab / size] on every rank -> [rows, vocab_size] on every rank."""
        t0 = time.perf_counter()
        if self.shm is not None:
            parts = list(self.shm.all_gather(logits).unbind(0))
        else:
            parts = [torch.empty_like(logits) for _ in range(self.size)]
            dist.all_gather(parts, logits.contiguous(), group=self.group)
        self.clock.seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=-1)[:, :vocab_size]


class CollectiveClock:
    """Seconds spent in a rank's collectives since it started (read as differences)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0
