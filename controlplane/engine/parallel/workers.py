"""The processes of a tensor-parallel engine: rank 0 is the engine's own process (scheduler,
sampler, rank 0's shard); ranks 1..size-1 are workers started here, each holding its shard and
its own KV cache (the same number of blocks as rank 0's, of its own KV heads).

Each step rank 0 sends the step's inputs (StepInputs without the host's sequence objects) to
every worker in one object broadcast, then all ranks run the forward together (the layers'
all-reduces and the logits' gather join them); only rank 0 samples. The broadcast goes over a
gloo group (objects travel through the host), the forward's collectives over the default group
(gloo on a CPU, NCCL on CUDA).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from controlplane.engine.model_runner import StepInputs
    from controlplane.engine.settings import EngineSettings

log = logging.getLogger(__name__)

# How long a collective may wait for a rank before it fails (a worker that died or hangs).
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to build its part of the engine (picklable)."""

    settings: EngineSettings
    model_dir: str
    init_method: str
    dtype: torch.dtype
    max_model_len: int
    num_blocks: int
    num_swap_blocks: int


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_init_method() -> str:
    """A TCP rendezvous on a free loopback port (rank 0 listens on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def join_group(rank: int, size: int, init_method: str, device: torch.device) -> Any:
    """Join the tensor-parallel group; returns the gloo group the step inputs travel on. On a
    CPU each rank takes its share of the cores for torch's threads: ranks of the default
    (every core each) would oversubscribe them size times."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group(
        _backend(device),
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD


class Workers:
    """Ranks 1..size-1 of a tensor-parallel engine, seen from rank 0."""

    def __init__(
        self, spec: WorkerSpec, device: torch.device, target: Callable[[int, WorkerSpec], None]
    ) -> None:
        """Start ranks 1..size-1 as processes running `target(rank, spec)` (parallel/rank.py's
        `worker_main`), then join the group as rank 0."""
        size = spec.settings.tensor_parallel_size
        ctx = multiprocessing.get_context("spawn")
        # daemon: a worker never outlives the engine's process.
        self.procs = [
            ctx.Process(target=target, args=(rank, spec), name=f"tp-rank-{rank}", daemon=True)
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
        self._threads = torch.get_num_threads()  # this process's, given back at close
        self.meta_group = join_group(0, size, spec.init_method, device)
        self.closed = False

    def check(self) -> None:
        """RuntimeError naming the first worker that is gone: a step without it would wait on
        its collectives until COLLECTIVE_TIMEOUT."""
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise RuntimeError(
                    f"tensor-parallel rank {rank} exited (exit code {p.exitcode}); "
                    "the engine cannot step without it"
                )

    def send(self, inputs: StepInputs, fed: torch.Tensor | None) -> None:
        """The step's inputs to every worker (the host's sequence objects left out)."""
        self.check()
        slim = dataclasses.replace(
            inputs,
            samplers=[],
            prompt_spans=[(None, lo, k) for _, lo, k in inputs.prompt_spans],
            traced=[],
        )
        box = [(slim, None if fed is None else fed.cpu())]
        dist.broadcast_object_list(box, src=0, group=self.meta_group)

    def close(self, timeout: float = 30) -> None:
        """Stop every worker (it leaves its loop at None) and the group; kills what is left."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([None], src=0, group=self.meta_group)
        finally:
            for p in self.procs:
                p.join(timeout)
                if p.is_alive():
                    p.kill()
                    p.join()
            dist.destroy_process_group()
            torch.set_num_threads(self._threads)
