"""engine.scheduling_policy (engine/policy.py): fcfs, priority and fair change who runs first,
never what a request computes; priority serves a better-ranked request first and lets it take a
slot from a worse one; fair keeps a flooding tenant from starving a light one."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from controlplane.engine import Engine, InvalidSettingError, SamplingParams
from controlplane.engine.policy import Policy, tenant_of
from controlplane.engine.sequence import SequenceStatus
from tests.conftest import MIXED_ENGINE, mixed_workload, run_to_end

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(model_dir: Path, **kw: Any) -> Engine:
    return Engine(model=str(model_dir), dtype="float32", attention_backend="torch", **kw)


def _prompt(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(3, vocab - 8, (n,), generator=gen).tolist()


def _left_clean(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_used == 0 and not engine.requests


@pytest.mark.parametrize(
    ("preemption", "ahead"), [("recompute", "off"), ("swap", "off"), ("swap", "on")]
)
def test_every_policy_computes_the_fcfs_tokens(
    tiny_model_dir: Path, preemption: str, ahead: str
) -> None:
    """Chunked prefill, preemption and prefix hits, requests spread over three tenants with
    mixed priorities and classes: each policy orders them differently, the tokens are the same
    (and with asynchronous scheduling, where a preempted sequence may have a token in flight)."""
    engine = _engine(
        tiny_model_dir, preemption_mode=preemption, async_scheduling=ahead, **MIXED_ENGINE
    )
    prompts, params = mixed_workload(engine.model_config.vocab_size, 11, 10)
    tenants = ["a", "b", None]
    params = [
        dataclasses.replace(p, tenant=tenants[i % 3], priority=-(i % 4), priority_class=i % 2)
        for i, p in enumerate(params)
    ]
    expected = run_to_end(engine, prompts, params)
    for policy in ("priority", "fair"):
        before = engine.stats().num_preemptions
        engine.update_settings(scheduling_policy=policy)
        assert run_to_end(engine, prompts, params) == expected, policy
        assert engine.stats().num_preemptions > before, policy  # the workload preempts
        _left_clean(engine)


def _steps_to_first_token(engine: Engine, rid: str, limit: int = 400) -> int:
    for step in range(1, limit):
        for out in engine.step():
            if out.request_id == rid and out.token_ids:
                return step
    raise AssertionError(f"{rid} produced no token in {limit} steps")


def _abort_all(engine: Engine) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    _left_clean(engine)


def test_fair_lets_a_light_tenant_through_a_flood(tiny_model_dir: Path) -> None:
    """A tenant queues 24 long prompts; another then sends one short request. fcfs makes the
    short one wait for the flood's prefills; fair gives it the next step's tokens."""
    engine = _engine(
        tiny_model_dir, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64
    )
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(3)
    waits = {}
    for policy in ("fcfs", "fair"):
        engine.update_settings(scheduling_policy=policy)
        for _ in range(24):
            flood = SamplingParams(max_tokens=4, tenant="flood", **GREEDY)
            engine.add_request(_prompt(gen, vocab, 200), flood)
        engine.step()  # the flood is running
        light = SamplingParams(max_tokens=2, tenant="light", **GREEDY)
        waits[policy] = _steps_to_first_token(engine, engine.add_request([5, 6, 7], light))
        _abort_all(engine)
    assert waits["fair"] <= 2 < 10 < waits["fcfs"], waits


def test_fair_takes_slots_back_from_a_tenant_holding_all_of_them(tiny_model_dir: Path) -> None:
    """Every batch slot decodes for one tenant: under fair a second tenant's request preempts
    one of them at once (and is not preempted back); under fcfs it waits for one to finish."""
    engine = _engine(tiny_model_dir, max_num_seqs=4)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(4)
    waits = {}
    for policy in ("fcfs", "fair"):
        engine.update_settings(scheduling_policy=policy)
        for _ in range(6):
            hog = SamplingParams(max_tokens=60, tenant="hog", **GREEDY)
            engine.add_request(_prompt(gen, vocab, 8), hog)
        for _ in range(3):
            engine.step()
        before = engine.stats().num_preemptions
        light = SamplingParams(max_tokens=30, tenant="light", **GREEDY)
        rid = engine.add_request([5, 6, 7], light)
        waits[policy] = _steps_to_first_token(engine, rid)
        if policy == "fair":
            assert engine.stats().num_preemptions == before + 1
            for _ in range(10):  # it keeps its slot: no thrash
                engine.step()
                assert engine.requests[rid].status is SequenceStatus.RUNNING
        _abort_all(engine)
    assert waits["fair"] == 1 and waits["fcfs"] > 50, waits


def test_priority_runs_the_better_ranked_first_and_preempts_the_worse(
    tiny_model_dir: Path,
) -> None:
    engine = _engine(tiny_model_dir, max_num_seqs=2, scheduling_policy="priority")
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(5)
    worse = SamplingParams(max_tokens=40, priority_class=1, **GREEDY)
    low = [engine.add_request(_prompt(gen, vocab, 8), worse) for _ in range(3)]
    engine.step()
    # A better class beats any request priority; a lower `priority` beats arrival.
    urgent = engine.add_request([4, 5], SamplingParams(max_tokens=3, priority=-5, **GREEDY))
    first = engine.add_request(
        [6, 7], SamplingParams(max_tokens=3, priority=10, priority_class=0, **GREEDY)
    )
    engine.step()
    status = {rid: engine.requests[rid].status for rid in (*low, urgent, first)}
    # Both new ones displaced the two running requests of class 1...
    assert status[urgent] is status[first] is SequenceStatus.RUNNING
    assert [status[r] for r in low].count(SequenceStatus.RUNNING) == 0
    # ...and a request of a worse class, however urgent its own priority, waits behind them.
    engine.abort(first)
    slow = engine.add_request(
        [8, 9], SamplingParams(max_tokens=3, priority=-100, priority_class=3, **GREEDY)
    )
    engine.step()
    assert engine.requests[slow].status is SequenceStatus.WAITING
    _abort_all(engine)


def test_kv_pressure_preempts_the_lowest_class_then_the_tenant_holding_most() -> None:
    """Policy.victim on hand-made sequences (the choice, not the engine, is under test)."""
    from controlplane.engine.sequence import Sequence
    from controlplane.engine.types import RequestMetrics

    def seq(t: str, cls: int, blocks: int, at: float) -> Sequence:
        s = Sequence(
            request_id=f"{t}{at}",
            prompt_token_ids=[1, 2],
            params=SamplingParams(tenant=t, priority_class=cls),
            metrics=RequestMetrics(arrival_time=at),
            detokenizer=None,  # type: ignore[arg-type]
        )
        s.block_table = list(range(blocks))
        return s

    a1, a2, b1, c1 = (
        seq("a", 0, 3, 1.0),
        seq("a", 0, 3, 2.0),
        seq("b", 0, 5, 3.0),
        seq("c", 1, 1, 0.5),
    )
    policy = Policy()
    policy.begin_step("fair", [a1, a2, b1, c1])
    assert policy.victim([a1, a2, b1, c1]) is c1  # the lowest class, whatever it holds
    assert policy.victim([a1, a2, b1]) is a2  # a holds 6 blocks: its latest request
    assert policy.victim([a1, b1]) is b1
    policy.begin_step("priority", [a1, a2, b1])
    assert policy.victim([a1, a2, b1]) is b1  # equal class and priority: the latest arrival
    assert tenant_of(seq("", 0, 0, 0.0)) == ""


def test_fair_shares_tokens_between_active_tenants_and_banks_no_credit() -> None:
    policy = Policy()
    policy.begin_step("fair", [])
    policy.served.update(old=0.0)  # idle since long ago
    from types import SimpleNamespace

    def live(*tenants: str) -> list[Any]:
        return [SimpleNamespace(params=SamplingParams(tenant=t)) for t in tenants]

    policy.begin_step("fair", live("a"))
    policy.charge(live("a")[0], 1000)
    policy.begin_step("fair", live("a", "old", "new"))
    # Joining tenants start at the least virtual time of those already active: no credit.
    assert policy.served["old"] == policy.served["new"] == policy.served["a"] == 1000
    assert set(policy.served) == {"a", "old", "new"}
    policy.charge(live("new")[0], 50)
    policy.begin_step("fair", live("new"))
    assert "a" not in policy.served and "old" not in policy.served  # idle at the floor: forgotten


def test_scheduling_fields_are_checked_and_the_policy_is_live(tiny_model_dir: Path) -> None:
    with pytest.raises(
        InvalidSettingError, match=r"priority_class: must be an integer in \[0, 9\]"
    ):
        SamplingParams(priority_class=10)
    with pytest.raises(
        InvalidSettingError,
        match=r"priority: must be an int32, in \[-2\^31, 2\^31-1\], got 1099511627776",
    ):
        SamplingParams(priority=2**40)
    with pytest.raises(InvalidSettingError, match="tenant: must be a string"):
        SamplingParams(tenant=3)  # type: ignore[arg-type]
    engine = _engine(tiny_model_dir)
    with pytest.raises(
        InvalidSettingError, match="scheduling_policy: must be one of fcfs, priority, fair"
    ):
        engine.update_settings(scheduling_policy="lottery")
    engine.update_settings(scheduling_policy="fair")
    engine.step()  # applied at the step boundary
    assert engine.scheduler.settings.scheduling_policy == "fair"


def test_fair_keeps_prefix_cache_partitions(tiny_model_dir: Path) -> None:
    """Fairness reorders requests, never their cache partition: a prompt cached under one
    salt (the server's per-key part) is a hit for the same salt only."""
    engine = _engine(
        tiny_model_dir, scheduling_policy="fair", enable_prefix_caching=True, block_size=16
    )
    prompt = list(range(10, 90))

    def cached(tenant: str, salt: str) -> int:
        params = SamplingParams(max_tokens=2, tenant=tenant, cache_salt=salt, **GREEDY)
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    found = out.metrics.num_cached_tokens
        return found

    assert cached("a", "key-a") == 0
    assert cached("b", "key-b") == 0  # the same prompt under another key's salt: no hit
    assert cached("a", "key-a") == 64  # its own: the full blocks before the last token
    _left_clean(engine)
