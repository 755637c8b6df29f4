"""Python's cyclic garbage collector, kept from pausing the engine's steps.

A full collection walks every object the collector tracks. Once the daemon has loaded its
model and tokenizer and imported its libraries, those are hundreds of thousands of objects,
and a full collection, which the allocations of a busy engine trigger every few hundred
steps, stops the step it falls in for as long as some tens of steps take: an inter-token
latency spike for every request in the batch (docs/benchmarks.md#gc-pauses).
Those objects live as long as the process, so they are frozen once the daemon is ready
(`gc.freeze`: moved to a generation no collection visits), as vLLM's engine does after its
start-up; what requests allocate afterwards is collected as before.

Only the daemon's own process freezes: a process that starts daemons in-process (the tests)
would keep every object alive at each start out of collection for good.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Collect what is garbage now (so that it is freed, not frozen), then freeze everything
    still alive. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "froze %d start-up objects: full garbage collections no longer walk them",
        frozen,
        extra={"event": "gc_freeze", "frozen": frozen},
    )
    return frozen
