"""Host values onto the device without waiting for it: the one way a step's inputs (token ids,
positions, attention metadata, sampling parameters, row indices) leave the host.

A copy from ordinary (pageable) host memory to a GPU first waits for everything already queued
on the stream (CUDA's rule for such copies; torch's blocking `copy_` then waits for the copy
too). In a step's preparation the first such copy holds the host until the step in flight has
ended, and each further one costs a round trip, while the device sits idle until the host has
launched the next step: asynchronous scheduling (engine/overlap.py) is undone at every launch.
So on CUDA every value goes from pinned memory
(torch's caching host allocator, which reuses a block only once the copies that read it have
run) with `non_blocking=True`, queued behind the step in flight rather than waiting for it.
On a CPU the values become a plain tensor, shared with an `array`'s buffer where given one.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

Values = Sequence[int] | Sequence[float] | array | torch.Tensor
# The array type of each dtype host values are built in.
_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float64: "d", torch.float32: "f"}
_DTYPES = {code: dtype for dtype, code in _TYPECODES.items()}


def host_tensor(values: Values, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """`values` as a host tensor of `dtype`, in pinned memory when `pin`. Through an array's
    buffer (read in place when given an array of that type): torch.tensor reads a list element
    by element, several times slower even for a step's few values."""
    if isinstance(values, torch.Tensor):
        t = values if values.dtype == dtype else values.to(dtype)
    elif not len(values):  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype, pin_memory=pin)
    elif isinstance(values, array) and values.typecode in _DTYPES:
        # Read in place, converted by torch when another type is wanted (not int by int).
        t = torch.frombuffer(values, dtype=_DTYPES[values.typecode])
        t = t if t.dtype == dtype else t.to(dtype)
    elif (code := _TYPECODES.get(dtype)) is None:
        return torch.tensor(values, dtype=dtype, pin_memory=pin)
    else:
        if isinstance(values, list):  # fromlist reads a list faster than array(code, list)
            buf = array(code)
            buf.fromlist(values)
        else:
            buf = array(code, values)
        t = torch.frombuffer(buf, dtype=dtype)  # shares the array's memory, keeps it alive
    return t.pin_memory() if pin and not t.is_pinned() else t


def to_device(
    values: Values, device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """A tensor of host `values` on `device`; on CUDA the copy is queued, not waited for.
    (A tensor already on a device is moved as it is: nothing of it is on the host.)"""
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return values.to(device, dtype, non_blocking=True)
    if device.type == "cpu":
        return host_tensor(values, dtype)
    return host_tensor(values, dtype, pin=device.type == "cuda").to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, values: Values) -> None:
    """Write host `values` (as many as dst holds, in its shape) into `dst`, a buffer that stays
    put (the inputs a CUDA graph was captured with); on CUDA the copy is queued."""
    src = host_tensor(values, dst.dtype, pin=dst.device.type == "cuda")
    dst.copy_(src.view(dst.shape), non_blocking=True)
