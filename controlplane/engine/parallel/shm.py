"""Shared-memory collectives for tensor-parallel ranks on one CPU host.

Gloo on loopback pays a socket round trip and a context switch per collective, which on a CPU
is most of a decode step (docs/benchmarks.md#tensor-parallel-cpu); vLLM's CPU backend and
DeepSpeed use shared memory between the ranks of one host for the same reason. Here rank 0
creates one segment before it starts the workers (`ShmSegment`), each worker maps it by name
(`ShmSpec`, carried to the workers in their WorkerChannel), and rank 0 removes the name as soon
as every worker has mapped it (`ShmSegment.unlink`), so not even a killed engine leaves a file
in /dev/shm; the memory goes with the last mapping.

Layout: per rank, two counters (`arrived`, `done`: the last operation it wrote, and the last it
finished reading), each on its own cache line (a rank writes only its own, so no line bounces
between writers), then per rank two data slots. Every operation, on every rank, takes the next
sequence number s (the ranks run the same collectives in the same order) and the slot s % 2:
double-buffered, so a rank may write operation s + 1 while slower ranks still read operation s,
and waits before writing slot s % 2 only until every rank is done with operation s - 2. An
operation larger than a slot is cut into slot-sized chunks, each one operation.

- all_reduce: each rank copies its tensor into its slot, raises `arrived`, waits for every
  rank's, then sums the slots in rank order into its tensor: every rank computes the same sums
  in the same order, so the ranks' results are bitwise identical (they must never diverge).
- all_gather: the same, each rank copying every slot out.
- broadcast_object (rank 0, the step's inputs): the pickle's length and bytes through rank 0's
  slots; each worker is woken by its own semaphore, so an idle worker sleeps in the kernel
  instead of spinning between steps.

Waiting spins on the counters briefly (a collective's partner is usually microseconds away),
then yields the core (os.sched_yield: three ranks on two cores must not livelock, a spinning
rank would take the core the rank it waits for needs), then sleeps in short naps once a wait has
lasted long enough that waking a little late costs little. A wait longer than the timeout
(engine.tensor_parallel_timeout_s) raises ShmTimeoutError naming the rank that did not arrive;
the supervision (parallel/workers.py) turns it into the TensorParallelError naming the hung rank.

Memory ordering: x86 is TSO: stores become visible to other cores in program order, and loads
are not reordered with older loads, so a reader that sees a counter sees the data written before
it. (Torch may copy a large slot on several threads; their stores are ordered before the
counter's by the barrier that ends the parallel region, and TSO is causal.) Other architectures
would need fences between the data and the counter, so there the ranks use gloo (`comm_for`).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import platform
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch

# A data slot's bytes. Decode's all-reduces ([batch, hidden]: 256 x 4096 in bfloat16 is 2 MiB)
# fit one slot; a prefill chunk's (2048 tokens x 4096 hidden x bfloat16: 16 MiB) takes 8 chunks,
# whose few microseconds of synchronization each are small beside copying 2 MiB. The segment
# is 2 slots a rank (16 MiB at 4 ranks, 32 MiB at 8): it fits a container's default /dev/shm
# (64 MiB) with room to spare.
SLOT_BYTES = 2 << 20
LINE = 64  # bytes of a cache line: each counter has its own
HEADER_BYTES = 4096  # the counters' page (2 lines a rank: 32 ranks)
# Polls of a counter before yielding the core (about a hundred microseconds), where each rank
# has a core; with more ranks than cores a rank yields at once (the one it waits for may need
# this core).
SPIN = 2000
YIELD_S = 0.002  # then yield the core this long before napping
NAP_S = 0.0001  # a nap's length once a wait has lasted YIELD_S
# How long a worker that finished a step polls for the next before it sleeps on its semaphore:
# at decode the next step comes a scheduling and a sampling later, and a worker that is still
# on its core takes it at once, where waking a sleeping one costs a wake-up, and may run it on
# rank 0's core, preempting rank 0 until the scheduler moves one of them.
IDLE_POLL_S = 0.005
WATCH_S = 0.05  # how often a long wait asks whether a peer is gone
LENGTH = 8  # bytes of a broadcast's length, ahead of its first chunk
PREFIX = "cp-tp-"  # segment names in /dev/shm


class ShmTimeoutError(RuntimeError):
    """A rank did not reach a collective within the timeout (hung, or stopped)."""

    def __init__(self, rank: int, what: str, seq: int, timeout_s: float) -> None:
        super().__init__(
            f"rank {rank} did not reach {what} (operation {seq}) within {timeout_s:g} s"
        )
        self.rank = rank


def shm_supported() -> bool:
    """Whether this machine orders stores as the collectives assume (x86's TSO)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def comm_for(setting: str, device: torch.device) -> str:
    """The collectives' transport for engine.tensor_parallel_comm on `device`: nccl on CUDA
    whatever the setting; on a CPU shm where `setting` is auto or shm and the machine is x86,
    gloo otherwise (parts.py refuses an explicit shm where it cannot run)."""
    if device.type == "cuda":
        return "nccl"
    if setting in ("auto", "shm") and shm_supported():
        return "shm"
    return "gloo"


@dataclass(frozen=True, slots=True)
class ShmSpec:
    """What a rank needs to map the group's segment (picklable to a spawned process; the
    semaphores only while spawning, as multiprocessing's are)."""

    name: str
    size: int  # ranks
    slot_bytes: int
    timeout_s: float
    wake: tuple[Any, ...]  # a multiprocessing.Semaphore per worker (rank r's at r - 1)

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.size * 2 * self.slot_bytes


class ShmSegment:
    """Rank 0's ownership of the segment: creates it, removes its name (`unlink`, once every
    rank has mapped it, or at close) and unmaps it (`close`)."""

    def __init__(
        self, size: int, timeout_s: float, ctx: Any = None, slot_bytes: int = SLOT_BYTES
    ) -> None:
        if 2 * LINE * size > HEADER_BYTES:
            raise ValueError(f"at most {HEADER_BYTES // (2 * LINE)} ranks share a segment")
        if slot_bytes % LINE or slot_bytes <= LENGTH:
            raise ValueError(f"slot_bytes must be a multiple of {LINE}")
        ctx = ctx or multiprocessing.get_context("spawn")
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        wake = tuple(ctx.Semaphore(0) for _ in range(size - 1))
        self.spec = ShmSpec(name, size, slot_bytes, timeout_s, wake)
        # Zeroed by the kernel: every counter starts at 0, before the first operation (1).
        self.memory = shared_memory.SharedMemory(name, create=True, size=self.spec.nbytes)
        self.linked = True

    def unlink(self) -> None:
        """Remove the name; the memory stays mapped wherever it is mapped."""
        if self.linked:
            self.linked = False
            self.memory.unlink()

    def close(self) -> None:
        """Unlink (if not yet) and unmap: rank 0's group over it must be closed first."""
        self.unlink()
        self.memory.close()


class ShmGroup:
    """A rank's view of the segment and its collectives. `watch`, called every WATCH_S of a
    long wait, raises when a peer is gone (rank 0: a dead worker; a worker: rank 0 gone), so a
    lost rank is told at once rather than after the timeout."""

    def __init__(
        self,
        spec: ShmSpec,
        rank: int,
        memory: shared_memory.SharedMemory | None = None,
        watch: Callable[[], None] | None = None,
    ) -> None:
        self.spec, self.rank, self.size = spec, rank, spec.size
        self.timeout_s = spec.timeout_s
        self.watch = watch
        self._own = memory is None  # mapped here (a worker), else rank 0's segment's mapping
        self._memory = memory or shared_memory.SharedMemory(spec.name)
        buf = self._memory.buf
        self._counters = buf[:HEADER_BYTES].cast("q")
        step = LINE // 8
        self._arrived = [2 * r * step for r in range(self.size)]  # indices into _counters
        self._done = [(2 * r + 1) * step for r in range(self.size)]
        data = torch.frombuffer(buf, dtype=torch.uint8)[HEADER_BYTES : spec.nbytes]
        self._slots = data.view(self.size, 2, spec.slot_bytes)  # [rank, buffer, bytes]
        self.seq = 0  # the last operation's sequence number
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self._spin = SPIN if self.size <= (cores or 1) else 0
        self._cache: dict[tuple[torch.dtype, tuple[int, ...]], list[Any]] = {}

    # -- waiting ------------------------------------------------------------------------------
    def _wait(self, index: int, seq: int, rank: int, what: str) -> None:
        """Until counter `index` (of rank `rank`) reaches `seq`."""
        counters = self._counters
        for _ in range(self._spin + 1):
            if counters[index] >= seq:
                return
        t0 = last_watch = time.monotonic()
        while counters[index] < seq:
            now = time.monotonic()
            if now - t0 < YIELD_S:
                os.sched_yield()
                continue
            if now - last_watch >= WATCH_S:
                last_watch = now
                if self.watch is not None:
                    self.watch()
            if now - t0 > self.timeout_s:
                raise ShmTimeoutError(rank, what, seq, self.timeout_s)
            time.sleep(NAP_S)

    def _poll(self, index: int, seq: int) -> bool:
        """Whether counter `index` reaches `seq` within IDLE_POLL_S (spinning, then yielding
        the core); never where the ranks outnumber the cores (the poll would take a core
        another rank needs)."""
        if not self._spin:
            return False
        counters = self._counters
        deadline = time.monotonic() + IDLE_POLL_S
        while counters[index] < seq:
            if time.monotonic() > deadline:
                return False
            os.sched_yield()
        return True

    def _wait_all(self, indices: list[int], seq: int, what: str) -> None:
        for rank, index in enumerate(indices):
            if rank != self.rank:
                self._wait(index, seq, rank, what)

    def _begin(self, what: str) -> tuple[int, int]:
        """The next operation's sequence number and slot, once every rank is done reading
        that slot's previous operation (s - 2)."""
        self.seq += 1
        seq = self.seq
        if seq > 2:
            self._wait_all(self._done, seq - 2, what)
        return seq, seq & 1

    def _views(self, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Any]:
        """Views of both buffers' slots shaped `shape` (the slot's first elements): [b][rank]
        for b in 0, 1, then at 2 + b every rank's slot b stacked, [size, *shape]. Cached: a
        decode step repeats its shapes, and making views costs more than the copies of a small
        all-reduce."""
        key = (dtype, shape)
        views = self._cache.get(key)
        if views is None:
            if len(self._cache) >= 64:  # prefill shapes vary: keep the cache small
                self._cache.clear()
            k = 1
            for n in shape:
                k *= n
            # Made outside inference mode: a view made in it could not be written outside it.
            with torch.inference_mode(False):
                typed = self._slots.view(dtype)[:, :, :k]  # [rank, buffer, k]
                views = [[typed[r, b].view(shape) for r in range(self.size)] for b in (0, 1)]
                views += [typed[:, b].view(self.size, *shape) for b in (0, 1)]
            self._cache[key] = views
        return views

    def _pieces(self, x: torch.Tensor) -> list[torch.Tensor]:
        """`x` itself where it fits a slot, else slot-sized chunks of (a contiguous copy of) it."""
        if x.numel() * x.element_size() <= self.spec.slot_bytes and x.is_contiguous():
            return [x]
        per = self.spec.slot_bytes // x.element_size()
        flat = x.contiguous().view(-1)
        return [flat[lo : lo + per] for lo in range(0, flat.numel(), per)]

    # -- collectives --------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `x`, in place; bitwise the same on every rank."""
        pieces = self._pieces(x)
        counters, me = self._counters, self.rank
        for part in pieces:
            views = self._views(part.dtype, tuple(part.shape))
            seq, b = self._begin("an all-reduce")
            slots = views[b]
            slots[me].copy_(part)
            counters[self._arrived[me]] = seq  # after the data (TSO: seen after it)
            self._wait_all(self._arrived, seq, "an all-reduce")
            torch.add(slots[0], slots[1], out=part)  # in rank order, on every rank alike
            for other in slots[2:]:
                part.add_(other)
            counters[self._done[me]] = seq
        if not x.is_contiguous():  # the pieces were a copy's
            x.copy_(torch.cat(pieces).view_as(x))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (the same shape on each), stacked: [size, *x.shape]."""
        pieces = self._pieces(x)
        out = torch.empty((self.size, x.numel()), dtype=x.dtype, device=x.device)
        counters, me = self._counters, self.rank
        lo = 0
        for part in pieces:
            k = part.numel()
            views = self._views(part.dtype, (k,))
            seq, b = self._begin("a gather")
            views[b][me].copy_(part.view(-1))
            counters[self._arrived[me]] = seq
            self._wait_all(self._arrived, seq, "a gather")
            out[:, lo : lo + k].copy_(views[2 + b])
            counters[self._done[me]] = seq
            lo += k
        return out.view(self.size, *x.shape)

    def _slot_at(self, rank: int, b: int) -> int:
        """The byte offset of rank `rank`'s slot `b` in the segment."""
        return HEADER_BYTES + (2 * rank + b) * self.spec.slot_bytes

    def broadcast_object(self, obj: Any) -> None:
        """Rank 0: `obj` to every worker (`receive_object`), which wakes."""
        assert self.rank == 0
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        counters, buf, slot = self._counters, self._memory.buf, self.spec.slot_bytes
        at = 0
        while True:
            seq, b = self._begin("a broadcast")
            start = self._slot_at(0, b)
            if at == 0:  # the first chunk leads with the whole pickle's length
                buf[start : start + LENGTH] = len(data).to_bytes(LENGTH, "little")
                start += LENGTH
            piece = data[at : at + slot - (start - self._slot_at(0, b))]
            buf[start : start + len(piece)] = piece
            counters[self._arrived[0]] = seq  # after the data (TSO: seen after it)
            if at == 0:
                for wake in self.spec.wake:  # the workers sleep on these between steps
                    wake.release()
            counters[self._done[0]] = seq  # rank 0 reads nothing back
            at += len(piece)
            if at >= len(data):
                return

    def receive_object(self, idle: Callable[[], None] | None = None) -> Any:
        """A worker: the next object rank 0 broadcasts. Sleeps on its semaphore until rank 0
        wakes it, without a timeout (an engine may be idle for hours), calling `idle` each
        second (raises when rank 0 is gone)."""
        wake = self.spec.wake[self.rank - 1]
        if self._poll(self._arrived[0], self.seq + 1):
            wake.acquire()  # released right after the counter: at once
        else:
            while not wake.acquire(timeout=1.0):
                if idle is not None:
                    idle()
        counters, buf, slot, me = self._counters, self._memory.buf, self.spec.slot_bytes, self.rank
        parts: list[bytes] = []
        total, got = -1, 0
        while total < 0 or got < total:
            self.seq += 1
            seq, b = self.seq, self.seq & 1
            self._wait(self._arrived[0], seq, 0, "a broadcast")
            start = self._slot_at(0, b)
            end = start + slot
            if total < 0:
                total = int.from_bytes(buf[start : start + LENGTH], "little")
                start += LENGTH
            piece = bytes(buf[start : min(end, start + total - got)])
            parts.append(piece)
            got += len(piece)
            counters[self._done[me]] = seq
        return pickle.loads(b"".join(parts))

    def close(self) -> None:
        """Drop every view of the segment, then unmap it where this rank mapped it."""
        self._cache.clear()
        self._slots = None  # type: ignore[assignment]
        self._counters.release()
        if self._own:
            self._memory.close()
