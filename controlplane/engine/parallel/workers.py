"""The processes of a tensor-parallel engine: rank 0 is the engine's own process (scheduler,
sampler, rank 0's shard); ranks 1..size-1 are workers started here, each holding its shard and
its own KV cache (the same number of blocks as rank 0's, of its own KV heads).

Each step rank 0 sends the step's inputs (StepInputs without the host's sequence objects) to
every worker in one object broadcast, then all ranks run the forward together (the layers'
all-reduces and the logits' gather join them); only rank 0 samples. On a CPU of x86 (the
default engine.tensor_parallel_comm, auto) the broadcast and the collectives go through one
shared-memory segment (parallel/shm.py) that rank 0 creates before starting the workers and
removes from /dev/shm once they have mapped it; otherwise the broadcast goes over a gloo group
(objects travel through the host), the forward's collectives over the default group (gloo on
a CPU, NCCL on CUDA).

Supervision: a group that lost a rank cannot step again (its collectives are out of step), so
any failure of a step is fatal to the engine: `failure` turns it into a TensorParallelError
naming the rank and the cause (exited with a code or a signal, an error it reported, or hung:
it did not take the step within tensor_parallel_timeout_s, the collectives' timeout), the
engine's step loop stops on it, and the daemon reports `dead` and exits non-zero. Each worker
writes the last step it took into shared memory (`WorkerChannel.taken`), which is how a hung rank is told
from the ranks that wait on it in a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from controlplane.engine.parallel.shm import ShmGroup, ShmSegment, ShmSpec, comm_for
from controlplane.engine.parallel.tensor_parallel import TensorParallel
from controlplane.engine.types import RankStats

if TYPE_CHECKING:
    from controlplane.engine.model.quant import QuantConfig
    from controlplane.engine.model_runner import StepInputs
    from controlplane.engine.settings import EngineSettings

log = logging.getLogger(__name__)

LOADING = -1  # a worker's `taken` entry until its shard and KV cache are built


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group is lost (rank None: the group failed as a whole,
    no one rank to blame); the engine cannot step again."""

    def __init__(self, rank: int | None, cause: str) -> None:
        who = "tensor-parallel group" if rank is None else f"tensor-parallel rank {rank}"
        super().__init__(f"{who}: {cause}")
        self.rank, self.cause = rank, cause


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to build its part of the engine (picklable)."""

    settings: EngineSettings
    model_dir: str
    init_method: str
    dtype: torch.dtype
    quant: QuantConfig  # rank 0's: every rank quantizes its shard alike
    max_model_len: int
    num_blocks: int
    num_swap_blocks: int


class RankBoard:
    """Each rank's memory and recent step times in shared memory: ranks write their own row
    after each step, rank 0 reads every row when asked (/admin/stats, a scrape). No message
    travels for it, and a reader never waits on a step."""

    FIELDS = 5  # weights bytes, KV bytes, steps, step seconds, collective seconds
    ALPHA = 0.2  # weight of the latest step in the averages (about the last 5-10 steps)

    def __init__(self, ctx: Any, size: int) -> None:
        self.size = size
        self._rows = ctx.Array("d", size * self.FIELDS)

    def post_memory(self, rank: int, weights_bytes: int, kv_cache_bytes: int) -> None:
        at = rank * self.FIELDS
        with self._rows.get_lock():
            self._rows[at], self._rows[at + 1] = weights_bytes, kv_cache_bytes

    def post_step(self, rank: int, step_s: float, all_reduce_s: float) -> None:
        at, a = rank * self.FIELDS, self.ALPHA
        with self._rows.get_lock():
            rows = self._rows
            first = rows[at + 2] == 0
            rows[at + 2] += 1
            rows[at + 3] = step_s if first else (1 - a) * rows[at + 3] + a * step_s
            rows[at + 4] = all_reduce_s if first else (1 - a) * rows[at + 4] + a * all_reduce_s

    def read(self) -> list[RankStats]:
        with self._rows.get_lock():
            flat = list(self._rows)
        out = []
        for rank in range(self.size):
            w, kv, steps, step_s, comm_s = flat[rank * self.FIELDS : (rank + 1) * self.FIELDS]
            out.append(RankStats(rank, int(w), int(kv), int(steps), step_s, comm_s))
        return out


@dataclass(slots=True)
class WorkerChannel:
    """What a worker shares with rank 0 besides the group (picklable to a spawned process):
    the last step each rank took (LOADING while it loads), the errors workers report before
    they exit (rank, cause), every rank's figures (RankBoard), and the shared-memory segment
    the collectives and the steps' inputs travel through (None: torch.distributed's)."""

    taken: Any  # multiprocessing.Array("q", size)
    errors: Any  # multiprocessing.Queue
    board: RankBoard
    shm: ShmSpec | None = None

    def report(self, rank: int, exc: BaseException) -> None:
        """A worker's last word: why it is about to exit."""
        with contextlib.suppress(Exception):  # best effort: the exit code still tells rank 0
            self.errors.put_nowait((rank, f"{type(exc).__name__}: {exc}"))


def _exit_cause(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_init_method() -> str:
    """A TCP rendezvous on a free loopback port (rank 0 listens on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def join_group(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float
) -> Any:
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
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD


class Workers:
    """Ranks 1..size-1 of a tensor-parallel engine, seen from rank 0."""

    def __init__(
        self,
        spec: WorkerSpec,
        device: torch.device,
        target: Callable[[int, WorkerSpec, WorkerChannel], None],
        tp: TensorParallel,
    ) -> None:
        """Start ranks 1..size-1 as processes running `target(rank, spec, channel)`
        (parallel/rank.py's `worker_main`), join the group as rank 0, then wait until every
        worker has built its shard (TensorParallelError naming a worker that failed to).
        `tp`: rank 0's place in the group (its model's): its clock times the collectives, and
        under shared memory its collectives are given the segment here."""
        self.tp, self.clock = tp, tp.clock
        self._started = (0.0, 0.0)  # perf_counter and clock at the step's send
        size = spec.settings.tensor_parallel_size
        self.timeout_s = spec.settings.tensor_parallel_timeout_s
        ctx = multiprocessing.get_context("spawn")
        self.comm = comm_for(spec.settings.tensor_parallel_comm, device)
        # Created before the workers start: they map it by name (the channel carries it).
        self.segment = ShmSegment(size, self.timeout_s, ctx) if self.comm == "shm" else None
        self.shm: ShmGroup | None = None
        self.channel = WorkerChannel(
            ctx.Array("q", [LOADING] * size),
            ctx.Queue(),
            RankBoard(ctx, size),
            None if self.segment is None else self.segment.spec,
        )
        # daemon: a worker never outlives the engine's process.
        self.procs = [
            ctx.Process(
                target=target, args=(rank, spec, self.channel), name=f"tp-rank-{rank}", daemon=True
            )
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
        self._threads = torch.get_num_threads()  # this process's, given back at close
        self.sent = 0  # steps sent
        self.lost: TensorParallelError | None = None
        self.closed = False
        try:
            self.meta_group = join_group(0, size, spec.init_method, device, self.timeout_s)
        except Exception as exc:
            self._kill()
            self._free_shm()
            raise self.failure(exc) from exc
        if self.segment is not None:
            # A long wait inside a collective asks whether a worker is gone (`check`): a
            # killed worker is named at once, not after the timeout.
            self.shm = ShmGroup(self.segment.spec, 0, self.segment.memory, watch=self.check)
            tp.shm = self.shm
        self._wait_loaded()
        if self.segment is not None:  # every worker has mapped it: no name left to leak
            self.segment.unlink()

    def _wait_loaded(self) -> None:
        """Until every worker has its shard and KV cache (they load after joining the group,
        for as long as their shard takes: no timeout here, a dead worker ends the wait)."""
        taken = self.channel.taken
        while any(taken[r] == LOADING for r in range(1, len(self.procs) + 1)):
            try:
                self.check()
            except TensorParallelError:
                self.close()
                raise
            time.sleep(0.02)
        log.info("tensor parallel: %d workers loaded", len(self.procs))

    def _reported(self) -> dict[int, str]:
        """The causes workers reported before exiting, by rank."""
        causes: dict[int, str] = {}
        while True:
            try:
                rank, cause = self.channel.errors.get(timeout=0.05)
            except (queue.Empty, OSError, EOFError, ValueError):
                return causes
            causes.setdefault(rank, cause)

    def _dead(self) -> TensorParallelError | None:
        """The first worker that is gone, with its cause."""
        gone = [(rank, p) for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
        if not gone:
            return None
        reported = self._reported()
        rank, p = gone[0]
        cause = _exit_cause(p.exitcode)
        if rank in reported:
            cause = f"{reported[rank]} ({cause})"
        return TensorParallelError(rank, cause)

    def check(self) -> None:
        """TensorParallelError naming the first worker that is gone: a step without it would
        wait on its collectives until the timeout. Cheap (a waitpid per worker): the step loop
        calls it between steps, so a worker lost while the engine is idle is seen too."""
        if self.lost is None:
            self.lost = self._dead()
        if self.lost is not None:
            raise self.lost

    def failure(self, exc: BaseException) -> TensorParallelError:
        """What a failed step means for the group, blaming the rank that caused it: a worker
        that is gone, else a worker that had not taken the latest step (hung: the others wait
        on it in a collective until the timeout), else the group (rank 0's own error)."""
        if self.lost is None:
            self.lost = self._dead()
        if self.lost is None:
            taken = self.channel.taken
            behind = [r for r in range(1, len(self.procs) + 1) if taken[r] < self.sent]
            if behind and not isinstance(exc, TensorParallelError):
                self.lost = TensorParallelError(
                    behind[0],
                    f"hung: did not take step {self.sent} within {self.timeout_s:g} s "
                    f"(its last was {taken[behind[0]]}); {exc!r}",
                )
            elif isinstance(exc, TensorParallelError):
                self.lost = exc
            else:
                self.lost = TensorParallelError(None, f"a step failed on rank 0: {exc!r}")
        return self.lost

    def send(self, inputs: StepInputs, fed: torch.Tensor | None) -> None:
        """The step's inputs to every worker (the host's sequence objects left out)."""
        self.check()
        slim = dataclasses.replace(
            inputs,
            samplers=[],
            prompt_spans=[(None, lo, k) for _, lo, k in inputs.prompt_spans],
            traced=[],
        )
        self.sent += 1
        self._started = (time.perf_counter(), self.clock.seconds)
        box = [(self.sent, slim, None if fed is None else fed.cpu())]
        if self.shm is not None:
            self.shm.broadcast_object(box)
        else:
            dist.broadcast_object_list(box, src=0, group=self.meta_group)

    def ran(self) -> None:
        """Rank 0 ran the step `send` began: its times go on the board."""
        t0, before = self._started
        self.channel.board.post_step(0, time.perf_counter() - t0, self.clock.seconds - before)

    def ranks(self) -> list[RankStats]:
        """Every rank's memory and recent steps (RankBoard)."""
        return self.channel.board.read()

    def _free_shm(self) -> None:
        """Rank 0's mapping of the segment and its name, if still there (the workers' mappings
        went with them)."""
        if self.shm is not None:
            self.tp.shm = None
            self.shm.close()
            self.shm = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()

    def close(self, timeout: float = 30) -> None:
        """Stop every worker and leave the group. A healthy group is told to stop (a worker
        leaves its loop at None); after a loss, the workers left are killed (a hung one would
        never take the message). Every worker is joined: no zombie is left."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.lost is None and all(p.is_alive() for p in self.procs):
                if self.shm is not None:
                    self.shm.broadcast_object([None])
                else:
                    dist.broadcast_object_list([None], src=0, group=self.meta_group)
                for p in self.procs:
                    p.join(timeout)
        finally:
            self._kill()
            self._free_shm()
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(self._threads)
            self.channel.errors.close()
            self.channel.errors.join_thread()
