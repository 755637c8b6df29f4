"""A worker rank of a tensor-parallel engine (started by parallel/workers.py's Workers): its
shard, its KV cache, then one forward per step rank 0 sends, until rank 0 sends None. Each
step it takes is written to the channel before it runs (how rank 0 tells a hung rank), and an
error is reported there before the worker exits with it. Under shared memory (parallel/shm.py)
it maps rank 0's segment before loading (rank 0 removes the name once every worker has), and
sleeps on its semaphore between steps."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import torch
import torch.distributed as dist

from controlplane.engine.kv_cache import STORAGE_DTYPES, KVCache, KVCacheSpec
from controlplane.engine.loader import load_model, load_model_config
from controlplane.engine.model.quant import weight_bytes
from controlplane.engine.model_runner import ModelRunner
from controlplane.engine.parallel.shm import ShmGroup
from controlplane.engine.parallel.tensor_parallel import TensorParallel
from controlplane.engine.parallel.workers import WorkerChannel, WorkerSpec, join_group
from controlplane.engine.parts import make_backend, resolve_device, resolve_model_path


def worker_main(rank: int, spec: WorkerSpec, channel: WorkerChannel) -> None:
    """A worker: its shard, its KV cache, then one forward per step rank 0 sends, until None."""
    try:
        _serve(rank, spec, channel)
    except BaseException as exc:
        channel.report(rank, exc)
        raise


def _serve(rank: int, spec: WorkerSpec, channel: WorkerChannel) -> None:
    s = spec.settings
    size = s.tensor_parallel_size
    device = resolve_device(s.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
    meta_group = join_group(rank, size, spec.init_method, device, s.tensor_parallel_timeout_s)
    shm = None
    if channel.shm is not None:
        shm = ShmGroup(channel.shm, rank, watch=_rank0_alive)
    try:
        model_dir = resolve_model_path(s.model)
        cfg = load_model_config(model_dir)
        model = load_model(
            model_dir,
            cfg,
            spec.dtype,
            device,
            spec.max_model_len,
            s.cpu_weight_packing,
            spec.quant,
            huge_pages=s.huge_pages,
            tp=TensorParallel(rank, size, shm=shm),
        )
        kv_dtype = STORAGE_DTYPES.get(s.kv_cache_dtype, spec.dtype)
        kv_spec = KVCacheSpec.for_model(model.config, s.block_size, kv_dtype)
        kv = KVCache(kv_spec, spec.num_blocks, spec.num_swap_blocks, device)
        runner = ModelRunner(model, kv, make_backend(s.attention_backend, kv, device), device)
        board, clock = channel.board, model.tp.clock
        board.post_memory(rank, weight_bytes(model), spec.num_blocks * kv_spec.bytes_per_block)
        channel.taken[rank] = 0  # loaded
        while True:
            box: list[Any] = [None]
            if shm is not None:
                box = shm.receive_object(idle=_rank0_alive)
            else:
                dist.broadcast_object_list(box, src=0, group=meta_group)
            if box[0] is None:
                break
            step, inputs, fed = box[0]
            channel.taken[rank] = step
            t0, in_collectives = time.perf_counter(), clock.seconds
            runner.run(inputs, None if fed is None else fed.to(device))
            board.post_step(rank, time.perf_counter() - t0, clock.seconds - in_collectives)
    finally:
        if shm is not None:
            shm.close()
        dist.destroy_process_group()


def _rank0_alive() -> None:
    """Raises when rank 0 (this worker's parent) is gone: a worker waiting on it in shared
    memory would otherwise wait for the timeout, or forever between steps."""
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():
        raise RuntimeError("rank 0 is gone")
