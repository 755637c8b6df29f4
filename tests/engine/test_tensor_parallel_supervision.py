"""Supervision of a tensor-parallel engine (engine/parallel/workers.py): a worker that dies or
hangs stops the engine with an error naming its rank and the cause; closing it leaves no
process behind; the daemon reports `dead` with the cause, every request it held gets its one
final row, and it exits with status 1 for a supervisor to restart it. The engine's ranks talk
through shared memory by default on a CPU (tensor_parallel_comm = auto); the killed and hung
workers are tested over gloo too."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from controlplane.config import load_config
from controlplane.engine import Engine, SamplingParams
from controlplane.engine.parallel.workers import TensorParallelError
from harness import DaemonProcess, wait_rows, write_config

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


def _workers_left() -> list[multiprocessing.Process]:
    """This process's tensor-parallel children still running (active_children joins the
    finished ones: a zombie would show here as alive)."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("tp-rank-")]


def _two_ranks(model: Path, **kw: object) -> Engine:
    return Engine(model=str(model), dtype="float32", tensor_parallel_size=2, **kw)


@pytest.mark.parametrize("comm", ["auto", "gloo"])
def test_a_killed_worker_stops_the_engine_naming_its_rank_and_signal(
    tiny_model_dir: Path, comm: str
) -> None:
    engine = _two_ranks(tiny_model_dir, tensor_parallel_comm=comm)
    try:
        engine.add_request([5, 6, 7], LONG)
        engine.step()
        (worker,) = engine.runner.workers.procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(30)
        with pytest.raises(TensorParallelError, match="rank 1: killed by SIGKILL") as caught:
            engine.step()
        assert caught.value.rank == 1
        # Between steps too (the step loop checks while idle): the same error, at once.
        with pytest.raises(TensorParallelError, match="rank 1"):
            engine.check_ranks()
    finally:
        engine.close()
    assert _workers_left() == []


@pytest.mark.parametrize("comm", ["auto", "gloo"])
def test_a_hung_worker_is_named_after_the_timeout_and_killed_at_close(
    tiny_model_dir: Path, comm: str
) -> None:
    """SIGSTOP: the worker is alive but takes no step. Rank 0's collective times out after
    tensor_parallel_timeout_s; the rank that had not taken the step is the one named."""
    engine = _two_ranks(tiny_model_dir, tensor_parallel_timeout_s=3.0, tensor_parallel_comm=comm)
    (worker,) = engine.runner.workers.procs
    try:
        engine.add_request([5, 6, 7], LONG)
        engine.step()
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1: hung: did not take step 2") as e:
            engine.step()
        waited = time.monotonic() - t0
        assert e.value.rank == 1 and 2.5 < waited < 60, waited
    finally:
        engine.close()
    assert worker.exitcode == -signal.SIGKILL  # a stopped process takes no message: killed
    assert _workers_left() == []


def test_the_async_engine_stops_when_a_worker_dies_while_it_is_idle(tiny_model_dir: Path) -> None:
    import asyncio

    from controlplane.engine import AsyncEngine

    async def scenario() -> BaseException | None:
        aeng = AsyncEngine(_two_ranks(tiny_model_dir))
        aeng.start()
        try:
            (worker,) = aeng.engine.runner.workers.procs
            os.kill(worker.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while aeng.is_running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return aeng.error
        finally:
            await aeng.shutdown()

    error = asyncio.run(scenario())
    assert isinstance(error, TensorParallelError) and error.rank == 1
    assert _workers_left() == []


def test_the_daemon_reports_dead_records_every_request_and_exits_1(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg_path = write_config(
        tmp_path / "cp.toml",
        tmp_path / "data",
        tiny_model_dir,
        engine={"tensor_parallel_size": 2, "dtype": "float32"},
        server={"dead_exit_s": 3.0},
        store={"flush_interval_s": 0.1},
    )
    url = load_config(cfg_path, env={}).store_url
    d = DaemonProcess.start(cfg_path)
    (worker,) = [
        c
        for c in psutil.Process(d.proc.pid).children()
        if "resource_tracker" not in " ".join(c.cmdline())
    ]
    assert httpx.get(d.url + "/health/ready").status_code == 200  # the worker has loaded
    model = httpx.get(d.url + "/v1/models").json()["data"][0]["id"]
    streaming = threading.Barrier(4)
    results: list[str] = []

    def call(i: int) -> None:
        body = {"model": model, "prompt": f"r{i}", "max_tokens": 2000, "ignore_eos": True}
        with httpx.stream(
            "POST", d.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # generating
            streaming.wait(30)
            results.append("\n".join(lines))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        streaming.wait(30)
        worker.kill()
        deadline = time.monotonic() + 20
        while (h := httpx.get(d.url + "/health")).json()["status"] != "dead":
            assert time.monotonic() < deadline, h.text
            time.sleep(0.05)
        assert h.status_code == 503 and "tensor-parallel rank 1" in h.json()["error"]
        for t in threads:
            t.join(60)
        assert len(results) == 3 and all("rank 1" in text for text in results), results
        assert d.proc.wait(60) == 1  # after dead_exit_s
    finally:
        d.kill()
    assert any('"event": "dead"' in line or "reporting dead" in line for line in d.lines)
    got = wait_rows(url, lambda r: len(r) == 3)
    assert all(r["status"] == "error" and "rank 1" in r["error"] for r in got), got
    assert not psutil.pid_exists(worker.pid) or worker.status() != psutil.STATUS_ZOMBIE


def test_the_ranks_memory_and_step_times_are_visible(make_daemon) -> None:
    """/admin/stats' tensor_parallel, the tensor_parallel_* gauges of /metrics and the TUI's
    lines, from the ranks' own figures: weights and KV cache split in two, steps counted on
    both ranks, and the share of a step inside the collectives between 0 and 1."""
    from controlplane.tui.panels import tensor_parallel_lines
    from harness.config import ADMIN_TOKEN

    d = make_daemon(admin=True, engine={"tensor_parallel_size": 2, "dtype": "float32"})
    model = d.engine.model_config
    with d.client(ADMIN_TOKEN) as c:
        name = c.get("/v1/models").json()["data"][0]["id"]
        for i in range(3):
            body = {"model": name, "prompt": f"p{i}", "max_tokens": 16, "ignore_eos": True}
            assert c.post("/v1/completions", json=body).status_code == 200
        # Each rank counts a step once its own part is done, and a reader never waits on a
        # step: the last step's count can trail the response by a moment on one rank (CI:
        # 48 against 47). Idle, the counts meet, unless a rank missed a step.
        deadline = time.monotonic() + 10
        while True:
            tp = c.get("/admin/stats").json()["tensor_parallel"]
            counts = {r["steps"] for r in tp["ranks"]}
            if len(counts) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        metrics = c.get("/metrics").text
    assert tp["size"] == 2 and [r["rank"] for r in tp["ranks"]] == [0, 1]
    r0, r1 = tp["ranks"]
    # Each rank holds half the heads and MLP rows: its KV cache is half of one rank's.
    assert r0["kv_cache_bytes"] == r1["kv_cache_bytes"] > 0
    assert r0["weights_bytes"] > 0 and r1["weights_bytes"] > 0
    assert r0["weights_bytes"] + r1["weights_bytes"] < 2 * model.num_params * 4
    for r in (r0, r1):
        assert r["steps"] >= 16 and r["step_ms"] > 0
        assert 0 < r["all_reduce_share"] < 1 and r["all_reduce_ms"] <= r["step_ms"]
    assert r0["steps"] == r1["steps"]  # every step ran on both ranks
    assert 'tensor_parallel_size{model_name="' in metrics
    assert 'rank="1"' in metrics.split("tensor_parallel_rank_all_reduce_share")[-1]
    lines = tensor_parallel_lines({"tensor_parallel": tp})
    assert "TP [b]2[/] ranks" in lines and "r1 " in lines and "all-reduce" in lines


def test_workers_exit_when_rank_0_is_killed(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A daemon killed outright (no close, no stop message): its worker, asleep between steps
    on its semaphore (shared memory), sees rank 0 gone and exits, and no segment is left in
    /dev/shm (its name went once the worker had mapped it)."""
    cfg_path = write_config(
        tmp_path / "cp.toml",
        tmp_path / "data",
        tiny_model_dir,
        engine={"tensor_parallel_size": 2, "dtype": "float32"},
    )
    d = DaemonProcess.start(cfg_path)
    (worker,) = [
        c
        for c in psutil.Process(d.proc.pid).children()
        if "resource_tracker" not in " ".join(c.cmdline())
    ]
    model = httpx.get(d.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "hi", "max_tokens": 8, "ignore_eos": True}
    assert httpx.post(d.url + "/v1/completions", json=body, timeout=60).status_code == 200
    segments = [n for n in os.listdir("/dev/shm") if n.startswith(f"cp-tp-{d.proc.pid}-")]
    d.kill()

    def gone() -> bool:
        try:
            return worker.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 20
    while not gone():
        assert time.monotonic() < deadline, "the worker outlived rank 0"
        time.sleep(0.1)
    assert segments == []
