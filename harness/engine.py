"""An engine stepped to the end, and the checks that it gave everything back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def drain(
    engine: Any, on_step: Callable[[Any], None] | None = None, *, by_index: bool = False
) -> dict[Any, Any]:
    """Step `engine` until no request is unfinished; the finished outputs by request id (by
    (request id, choice index) with `by_index`: a request of n > 1 finishes n times).
    `on_step(engine)` runs after each step (say, to check an invariant mid-run)."""
    done: dict[Any, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[(out.request_id, out.index) if by_index else out.request_id] = out
        if on_step is not None:
            on_step(engine)
    return done


def assert_no_leaks(engine: Any) -> None:
    """No request left and every KV block back: none in use (cached blocks may stay, as
    evictable), none in the swap pool nor in the draft model's pool."""
    assert not engine.has_unfinished_requests(), "a request is still unfinished"
    pool = engine.block_pool
    assert pool.num_used == 0, "a test left KV blocks allocated"
    assert pool.num_empty + pool.num_evictable == pool.num_blocks, "blocks neither free nor cached"
    assert engine.swap_pool.num_used == 0, "swap blocks still held"
    if engine.draft is not None:
        assert engine.draft.pool.num_used == 0, "draft blocks still held"
