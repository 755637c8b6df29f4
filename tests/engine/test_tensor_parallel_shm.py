"""Shared-memory collectives (engine/parallel/shm.py) between real processes: all-reduces and
gathers larger than a slot (chunked) and not contiguous, in float32 and bfloat16, bitwise the
same on every rank and equal to the sum in rank order; a pickled broadcast larger than a slot;
a rank that never arrives is named after the timeout, a gone peer at once; the segment's name
is gone after close; which transport each setting and device gets. (The model split through
them: tests/engine/test_tensor_parallel.py; supervision: test_tensor_parallel_supervision.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.parallel.shm import (
    SLOT_BYTES,
    ShmGroup,
    ShmSegment,
    ShmSpec,
    ShmTimeoutError,
    comm_for,
    shm_supported,
)

pytestmark = pytest.mark.skipif(not shm_supported(), reason="shared memory runs on x86 only")

# An all-reduce of 2.5 slots in float32: three chunks, the last a partial one.
BIG = SLOT_BYTES // 4 * 5 // 2 + 3


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s inputs (any rank can make any other's: the expected sums)."""
    g = torch.Generator().manual_seed(100 + rank)
    return {
        "small": torch.randn(5, 96, generator=g),
        "bf16": torch.randn(7, 96, generator=g).to(torch.bfloat16),
        "big": torch.randn(BIG, generator=g),
        "strided": torch.randn(96, 6, generator=g).t(),  # not contiguous
        "logits": torch.randn(4, BIG // 8, generator=g),  # a gather of 1.25 slots a rank
    }


def _collectives(rank: int, spec: ShmSpec, out: str) -> None:
    torch.set_num_threads(1)
    group = ShmGroup(spec, rank)
    try:
        x = _inputs(rank)
        got = {}
        for name in ("small", "bf16", "big", "strided"):
            t = x[name]
            assert group.all_reduce(t) is t  # in place
            got[name] = t
        got["gather"] = group.all_gather(x["logits"])
        for _ in range(50):  # many small ones: the double buffer's turns
            got["turns"] = group.all_reduce(torch.full((3,), float(rank + 1)))
        if rank == 0:
            group.broadcast_object({"step": 7, "blob": bytes(range(256)) * (SLOT_BYTES // 100)})
            group.broadcast_object(None)
        else:
            got["obj"] = group.receive_object()
            got["none"] = group.receive_object()
        torch.save(got, Path(out) / f"{rank}.pt")
    finally:
        group.close()


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_are_the_sums_in_rank_order_bitwise_on_every_rank(
    tmp_path: Path, size: int
) -> None:
    segment = ShmSegment(size, 60.0, mp.get_context("spawn"))
    try:
        mp.spawn(_collectives, args=(segment.spec, str(tmp_path)), nprocs=size)
    finally:
        segment.close()
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(size)]
    inputs = [_inputs(r) for r in range(size)]
    for name in ("small", "bf16", "big", "strided"):
        expected = inputs[0][name] + inputs[1][name]
        for x in inputs[2:]:
            expected = expected + x[name]
        for got in ranks:
            assert got[name].dtype == expected.dtype and got[name].shape == expected.shape
            assert torch.equal(got[name], expected), name  # bitwise, on every rank
    stacked = torch.stack([x["logits"] for x in inputs])
    assert all(torch.equal(got["gather"], stacked) for got in ranks)
    assert all(
        torch.equal(got["turns"], torch.full((3,), sum(range(1, size + 1)) * 1.0)) for got in ranks
    )
    blob = bytes(range(256)) * (SLOT_BYTES // 100)
    assert len(blob) > SLOT_BYTES  # the broadcast was chunked too
    for got in ranks[1:]:
        assert got["obj"] == {"step": 7, "blob": blob} and got["none"] is None


def test_a_rank_that_never_arrives_is_named_after_the_timeout() -> None:
    """Rank 0 alone in a group of 2: its first all-reduce waits for rank 1, which never comes."""
    segment = ShmSegment(2, 0.5)
    group = ShmGroup(segment.spec, 0, segment.memory)
    try:
        t0 = time.monotonic()
        with pytest.raises(ShmTimeoutError, match=r"rank 1 did not reach an all-reduce") as e:
            group.all_reduce(torch.ones(4))
        assert e.value.rank == 1 and 0.5 <= time.monotonic() - t0 < 5
    finally:
        group.close()
        segment.close()


def test_a_gone_peer_is_told_at_once_by_the_watch() -> None:
    """The watch (rank 0: a dead worker) ends a wait long before the timeout."""

    def watch() -> None:
        raise RuntimeError("rank 1 is gone")

    segment = ShmSegment(2, 60.0)
    group = ShmGroup(segment.spec, 0, segment.memory, watch=watch)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 is gone"):
            group.all_reduce(torch.ones(4))
        assert time.monotonic() - t0 < 5
    finally:
        group.close()
        segment.close()


def test_the_segment_is_gone_after_close() -> None:
    segment = ShmSegment(3, 1.0)
    path = Path("/dev/shm") / segment.spec.name
    assert path.exists() and path.stat().st_size == segment.spec.nbytes
    worker = ShmGroup(segment.spec, 1)  # maps it by name, as a worker does
    segment.unlink()  # once every worker has mapped it
    assert not path.exists()
    worker.close()
    segment.close()
    assert not path.exists()
    assert not [n for n in os.listdir("/dev/shm") if n == segment.spec.name]


def test_which_transport_each_setting_and_device_gets(tiny_model_dir: Path) -> None:
    from controlplane.engine.loader import load_model_config
    from controlplane.engine.model.quant import QuantConfig
    from controlplane.engine.parts import tensor_parallel_rank0
    from controlplane.engine.settings import EngineSettings

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [comm_for(c, cpu) for c in ("auto", "shm", "gloo")] == ["shm", "shm", "gloo"]
    assert {comm_for(c, cuda) for c in ("auto", "shm", "gloo")} == {"nccl"}
    s = EngineSettings(tensor_parallel_size=2, tensor_parallel_comm="shm")
    cfg = load_model_config(tiny_model_dir)
    with pytest.raises(InvalidSettingError, match="tensor_parallel_comm: shm runs between CPU"):
        tensor_parallel_rank0(s, cfg, QuantConfig("none"), cuda)
