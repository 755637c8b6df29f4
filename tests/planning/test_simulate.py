"""The simulator (controlplane/planning/simulate.py) drives the engine's own scheduler on a
cost model's clock: it takes the engine's steps (the same count, the same preemptions, for the
same workload), does the recorded work, keeps its clock by the cost model's arithmetic, and
refuses a cost model fit elsewhere. `controlplane calibrate`, `replay --simulate` and `plan`
end to end on recorded rows."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.settings import EngineSettings
from controlplane.planning.costmodel import CostModel, Fingerprint, fingerprint_of_settings
from controlplane.planning.simulate import simulate
from controlplane.planning.summary import Slo, replay_figures
from controlplane.planning.window import PlanningError, Recorded, Window
from controlplane.planning.workload import build_workload
from tests.planning.test_replay import _insert, _row


def _cost(base_s: float = 0.01, **per: float) -> CostModel:
    here = Fingerprint("cpu", 1, "cpu", "m", "auto", "auto", "torch")
    return CostModel(
        base_s, per.get("prefill", 0.0), per.get("decode", 0.0), per.get("context", 0.0),
        here, num_kv_blocks=1024, block_size=16, kv_bytes_per_block=1024, samples=0,
        rms_error_s=0.0,
    )  # fmt: skip


def _window(rows: list[tuple[float, int, int, int, int]]) -> Window:
    """(arrival s, prompt, cached, completion, n) rows."""
    now = datetime.now(UTC)
    recorded = [
        Recorded(f"r{i}", 1e9 + at, None, "success", p, c, out, n, out // n, None, None, None,
                 None, None, 0, 0, 0, None)
        for i, (at, p, c, out, n) in enumerate(rows)
    ]  # fmt: skip
    return Window(now, now, "m", recorded)


def test_the_clock_is_the_cost_models_arithmetic(tiny_model_dir: Path) -> None:
    """One request, 10 prompt tokens and 5 completion tokens, steps of exactly 10 ms: the
    first token at the end of the prefill step, then one a step."""
    work = build_workload(_window([(0.0, 10, 0, 5, 1)]), 1000, 512)
    s = EngineSettings(model=str(tiny_model_dir))
    run = simulate(work, s, _cost(0.01), "sim")
    (served,) = run.served
    m = served.metrics
    assert served.ok and served.completion_tokens == 5
    assert m.ttft == pytest.approx(0.01) and m.mean_itl == pytest.approx(0.01)
    assert run.wall_s == pytest.approx(0.05)
    assert run.gaps == pytest.approx([0.01] * 4)  # between the 5 tokens: 4 gaps of a step
    # 1 us a prompt token: the prefill step takes 10 us more.
    run = simulate(work, s, _cost(0.01, prefill=1e-6), "sim")
    assert run.served[0].metrics.ttft == pytest.approx(0.01001)


def test_it_takes_the_engines_steps_and_preemptions(tiny_model_dir: Path) -> None:
    """The same 12 requests at once on a KV cache that cannot hold them all: the engine and
    the simulator (each step costing 1 s, so its clock counts steps) schedule alike."""
    rows = [(0.0, 20 + 9 * i, 0, 12 + 5 * (i % 4), 1) for i in range(12)]
    settings = EngineSettings(
        model=str(tiny_model_dir), dtype="float32", compile="off", num_kv_blocks=24,
        block_size=16, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=32,
    )  # fmt: skip
    work = build_workload(_window(rows), 1000, 512)
    engine = Engine(settings)
    for r in work.requests:
        engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    run = simulate(work, settings, _cost(1.0), "sim", speed=math.inf)
    assert engine.stats().num_preemptions > 0
    assert run.preemptions == engine.stats().num_preemptions
    assert run.wall_s == steps
    assert sum(s.completion_tokens for s in run.served) == sum(r.max_tokens for r in work.requests)


def test_it_does_the_recorded_work_with_prefixes_forks_and_swaps(tiny_model_dir: Path) -> None:
    rows = [(0.1 * i, 80, 64 if i % 2 else 0, 24, 1) for i in range(10)] + [(1.2, 30, 0, 20, 2)]
    work = build_workload(_window(rows), 1000, 512)
    for mode in ("recompute", "swap"):
        settings = EngineSettings(
            model=str(tiny_model_dir), num_kv_blocks=16, preemption_mode=mode,
            swap_space_bytes=1 << 20,
        )  # fmt: skip
        f = replay_figures(simulate(work, settings, _cost(0.005), "sim"), Slo(100, 50), 1.0)
        assert f.requests == 11 and f.failed == 0
        assert f.completion_tokens == 10 * 24 + 2 * 10  # n = 2: both choices
        assert f.prefix_hit_rate > 0 and 0 < f.peak_kv_usage <= 1
        assert 0 <= f.slo_attainment <= 1


def test_a_cost_model_fit_elsewhere_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    here = fingerprint_of_settings(EngineSettings(model=str(tiny_model_dir)))
    cost = dataclasses.replace(_cost(), fingerprint=dataclasses.replace(here, machine="Other CPU"))
    with pytest.raises(PlanningError, match=r"machine: fit on 'Other CPU', here '.+'.*calibrate"):
        cost.check(here)
    cost.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == cost
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(PlanningError, match="not a cost model"):
        CostModel.load(tmp_path / "bad.json")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", *args], capture_output=True, text=True, timeout=600
    )


def test_calibrate_then_simulate_and_plan_from_recorded_rows(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from harness import write_config

    db = f"sqlite:///{tmp_path / 'records.db'}"
    config = write_config(
        tmp_path / "cp.toml", tmp_path / "data", tiny_model_dir, engine={"compile": "off"}
    )
    r = _cli("calibrate", "--config", str(config), "--out", str(tmp_path / "cost.json"))
    assert r.returncode == 0, r.stderr
    cost = CostModel.load(tmp_path / "cost.json")
    assert cost.samples > 100 and cost.base_s > 0 and "a prompt token" in r.stdout
    from controlplane.config import load_config, served_model_name_of
    from controlplane.store import upgrade

    upgrade(db)
    name = served_model_name_of(load_config(config))
    start = datetime.now(UTC) - timedelta(minutes=10)
    rows = [
        _row(i, start + timedelta(seconds=i * 0.2), model=name, prompt_tokens=40 + i,
             completion_tokens=16, ttft_s=0.01, mean_itl_s=0.005, queue_time_s=0.0,
             e2e_latency_s=0.1)
        for i in range(60)
    ]  # fmt: skip
    _insert(db, rows)
    window = ["--db", db, "--since", "1h", "--config", str(config)]
    r = _cli("replay", *window, "--simulate", str(tmp_path / "cost.json"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    recorded, simulated = out["figures"]
    assert out["simulated"] and simulated["requests"] == 60 and simulated["failed"] == 0
    assert simulated["completion_tokens"] == recorded["completion_tokens"] == 60 * 16
    slo = "ttft_p99=200ms,itl_p99=50ms"
    plans = {}
    for growth in ("1", "8"):
        r = _cli("plan", *window, "--cost-model", str(tmp_path / "cost.json"), "--growth",
                 growth, "--slo", slo, "--json")  # fmt: skip
        assert r.returncode == 0, r.stderr
        plans[growth] = json.loads(r.stdout)
    best1, best8 = plans["1"]["candidates"][0], plans["8"]["candidates"][0]
    assert best1["instances"] >= 1 and best8["instances"] >= best1["instances"]
    for best in (best1, best8):
        assert best["worst_instance"]["ttft_p99_ms"] <= 200
        assert 0 <= best["headroom"]["ttft"] <= 1 and best["cost_per_hour_usd"] > 0
    r = _cli("plan", *window, "--cost-model", str(tmp_path / "cost.json"), "--slo", slo)
    assert r.returncode == 0 and "best: max_num_seqs = " in r.stdout and "instances:" in r.stdout
