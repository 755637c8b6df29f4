"""Host values onto the device (engine/transfer.py): the same values as torch.tensor on a CPU;
on a GPU the copies are queued behind the step in flight instead of waiting for it, and an
asynchronous step synchronizes nowhere but where it reads its tokens."""

from __future__ import annotations

import time
from array import array

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.transfer import copy_into, host_tensor, to_device
from tests.conftest import MIXED_ENGINE, mixed_workload, run_to_end

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([5], torch.long),
        ([5, -1, 2**40], torch.long),
        (list(range(-3, 300)), torch.long),
        ([7, 2**31 - 1, -(2**31)], torch.int32),
        ([0.7, 1.0, 1e-3], torch.float32),
        ([0.1, 2.5], torch.float64),
        ([True, False, True], torch.bool),  # no array type: through torch.tensor
        ([], torch.long),
        ([], torch.int32),
    ],
)
def test_host_values_become_what_torch_tensor_makes(values, dtype):
    want = torch.tensor(values, dtype=dtype)
    for got in (host_tensor(values, dtype), to_device(values, CPU, dtype)):
        assert got.dtype == dtype and got.device == CPU
        assert torch.equal(got, want)


def test_an_array_of_the_dtype_is_read_in_place_and_others_are_converted():
    ids = array("q", [3, 1, 4])
    t = host_tensor(ids, torch.long)
    ids[0] = 9  # the tensor is a view of the array's buffer
    assert t.tolist() == [9, 1, 4]
    narrow = host_tensor(array("i", [3, 1, 4]), torch.long)
    assert narrow.dtype == torch.long and narrow.tolist() == [3, 1, 4]
    wide = host_tensor(array("q", [7, 2**31 - 1, -(2**31)]), torch.int32)  # a block table
    assert wide.dtype == torch.int32 and wide.tolist() == [7, 2**31 - 1, -(2**31)]
    assert to_device(array("q"), CPU).shape == (0,)


def test_a_host_tensor_is_converted_only_when_its_dtype_differs():
    t = torch.arange(4, dtype=torch.int32)
    assert host_tensor(t, torch.int32) is t
    assert host_tensor(t, torch.long).dtype == torch.long
    assert to_device(t, CPU, torch.long).tolist() == [0, 1, 2, 3]


def test_copy_into_writes_a_strided_view_and_nothing_else():
    """As prepare_into refills the first columns of a static block table."""
    table = torch.full((3, 5), -1, dtype=torch.int32)
    copy_into(table[:, :2], [1, 2, 3, 4, 5, 6])
    assert table.tolist() == [[1, 2, -1, -1, -1], [3, 4, -1, -1, -1], [5, 6, -1, -1, -1]]
    ids = torch.zeros(4, dtype=torch.long)
    copy_into(ids[:3], array("q", [7, 8, 9]))
    assert ids.tolist() == [7, 8, 9, 0]
    with pytest.raises(RuntimeError):  # too few values for the view: refused, not padded
        copy_into(ids[:3], [1, 2])


@pytest.mark.gpu
@needs_cuda
def test_gpu_copies_are_queued_behind_the_work_in_flight():
    """With the stream busy for a fifth of a second or so, the copies return at once and land in order after it:
    a blocking copy would have waited for the sleep first."""
    dev = torch.device("cuda")
    dst = torch.zeros(300, dtype=torch.long, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(300_000_000)  # GPU clock cycles: ~0.15-0.2 s
    got = to_device(list(range(300)), dev)
    copy_into(dst[:100], array("q", range(100, 200)))
    queued = time.perf_counter() - t0
    torch.cuda.synchronize()
    waited = time.perf_counter() - t0
    assert queued < waited / 4, (queued, waited)
    assert got.tolist() == list(range(300))
    assert dst[:100].tolist() == list(range(100, 200)) and not dst[100:].any()
    # A tensor already on the device is moved as it is (pinning it would fail).
    assert to_device(got, dev, torch.int32).tolist() == list(range(300))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graphs", ["off", "auto"])
def test_gpu_an_asynchronous_step_never_waits_for_the_device(hf_model_dirs, graphs):
    """Every step of a mixed workload (prefill chunks, preemption, greedy and seeded top-p
    rows) under torch's sync debug mode set to error: a blocking copy or a host read of a
    device value anywhere in a step raises, and the request it hit would fail. The only wait
    left is on the event of the step's tokens, which that mode does not count. The engine runs
    the workload once before (its compiles and captures done, which may wait) and gives the
    same tokens both times."""
    eng = Engine(
        model=str(hf_model_dirs["llama"]),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        compile="on",
        cuda_graphs=graphs,
        async_scheduling="on",
        **MIXED_ENGINE,
    )
    prompts, params = mixed_workload(eng.model_config.vocab_size, 3, 10)
    params = [
        p if i % 2 else SamplingParams(max_tokens=p.max_tokens, top_p=0.9, seed=i, ignore_eos=True)
        for i, p in enumerate(params)
    ]
    want = run_to_end(eng, prompts, params)
    eng.reset_prefix_cache()
    preemptions, steps = eng.scheduler.num_preemptions, eng.stats().async_steps_total
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run_to_end(eng, prompts, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got == want
    assert eng.stats().async_steps_total > steps and eng.scheduler.num_preemptions > preemptions
