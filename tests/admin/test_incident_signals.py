"""The incident figures of /admin/stats: traffic rates, the oldest wait, prefill vs decode step
times, the SLO, the [alerts] thresholds and the diagnosis. Pure functions first, then a real
daemon on loopback (tiny model) overloaded by `controlplane loadgen`, drained, retargeted."""

from __future__ import annotations

import time

import httpx
import pytest

import controlplane.engine.sampler as sampler_module
from controlplane.config import AlertsSettings, AutopilotSettings, build_config
from controlplane.engine.types import StepStats
from controlplane.errors import FieldError
from controlplane.runtime.ledger import Finished
from controlplane.telemetry.diagnosis import Signals, diagnose
from controlplane.telemetry.slo import slo, thresholds
from controlplane.telemetry.stats import summarize
from controlplane.telemetry.traffic import Traffic
from harness import InProcessDaemon
from tests.admin.test_admin_api import MODEL, TOKEN, loadgen


# -- the diagnosis rules ---------------------------------------------------------------------
def test_overloaded_when_arrivals_exceed_the_best_completion_rate_and_the_queue_grows():
    d = diagnose(
        Signals(arrivals_per_s=6.0, best_completion_rate_per_s=4.1, queue_growing=True, waiting=9)
    )
    assert d is not None and d.code == "overloaded" and d.knob == "server.max_queue_len"
    assert d.message == (
        "overloaded: 6.0 req/s arriving, at most 4.1 req/s completed in 15 min: shed load "
        "(server.max_queue_len) or add instances; retuning the batch cannot fix it"
    )
    # A long wait stands in for a growing queue; a queue neither growing nor old does not.
    long_wait = Signals(arrivals_per_s=6.0, best_completion_rate_per_s=4.1, oldest_waiting_s=5.5)
    assert diagnose(long_wait).code == "overloaded"
    steady = Signals(arrivals_per_s=6.0, best_completion_rate_per_s=4.1, oldest_waiting_s=4.0)
    assert diagnose(steady) is None
    # Within 10% of the best: not overloaded, however the queue looks.
    within = Signals(arrivals_per_s=4.5, best_completion_rate_per_s=4.1, queue_growing=True)
    assert diagnose(within) is None


def test_overloaded_comes_before_memory_bound():
    s = Signals(
        arrivals_per_s=10.0,
        best_completion_rate_per_s=2.0,
        queue_growing=True,
        waiting=50,
        kv_usage_perc=100.0,
    )
    assert diagnose(s).code == "overloaded"


def test_memory_bound_when_requests_wait_on_a_full_kv_cache_or_preemptions():
    d = diagnose(Signals(waiting=146, kv_usage_perc=100.0))
    assert d is not None and d.code == "memory_bound" and d.knob == "engine.max_num_seqs"
    assert d.message == (
        "memory-bound: KV cache 100% full, 146 waiting: lower engine.max_num_seqs to stop "
        "preemption churn; more throughput needs KV memory (engine.kv_cache_dtype int8, "
        "restart) or instances"
    )
    churn = diagnose(Signals(waiting=3, kv_usage_perc=70.0, preemptions_in_window=4))
    assert churn.code == "memory_bound" and "4 preemptions in 10 s" in churn.message
    # Nothing waits: a full cache is just a full cache.
    assert diagnose(Signals(waiting=0, kv_usage_perc=100.0, preemptions_in_window=2)) is None
    assert diagnose(Signals(waiting=5, kv_usage_perc=94.9)) is None


def test_prefill_stall_when_prefill_steps_dwarf_decode_steps():
    d = diagnose(Signals(prefill_step_p50_ms=5500.0, decode_step_p50_ms=40.0))
    assert d is not None and d.code == "prefill_stall"
    assert d.knob == "engine.max_num_batched_tokens"
    assert d.message == (
        "prefill stalls: steps with prefill take 5.5 s, decode-only 40 ms: lower "
        "engine.max_num_batched_tokens (or engine.prefill_chunk_size)"
    )
    # Slow but not 4x, 4x but short, or a side unknown: no stall.
    assert diagnose(Signals(prefill_step_p50_ms=300.0, decode_step_p50_ms=100.0)) is None
    assert diagnose(Signals(prefill_step_p50_ms=190.0, decode_step_p50_ms=10.0)) is None
    assert diagnose(Signals(prefill_step_p50_ms=5000.0, decode_step_p50_ms=None)) is None


def test_no_diagnosis_for_a_healthy_daemon():
    healthy = Signals(
        arrivals_per_s=3.0,
        best_completion_rate_per_s=5.0,
        queue_growing=False,
        oldest_waiting_s=0.2,
        waiting=1,
        kv_usage_perc=40.0,
        prefill_step_p50_ms=30.0,
        decode_step_p50_ms=20.0,
    )
    assert diagnose(healthy) is None
    assert diagnose(Signals()) is None  # no data at all


# -- summarize: prefill vs decode-only step times -------------------------------------------
def _step(n: int, t: float, prefill: int, decode: int, duration: float) -> StepStats:
    return StepStats(n, t, 1, 0, 0, 1, 10, prefill, decode, decode, duration, 0, 0)


def test_summarize_splits_step_times_into_prefill_and_decode_only():
    steps = [
        _step(1, 100.0, 64, 0, 0.5),  # before the window
        _step(2, 101.0, 64, 2, 0.9),
        _step(3, 102.0, 0, 3, 0.01),
        _step(4, 103.0, 128, 0, 1.1),
        _step(5, 104.0, 0, 3, 0.03),
        _step(6, 105.0, 0, 3, 0.02),
        _step(7, 106.0, 0, 0, 0.001),  # neither (an empty step): in no split
    ]
    out = summarize(steps, now=106.0, window_s=5.5, max_num_seqs=4, max_num_batched_tokens=256)
    assert out["steps_in_window"] == 6
    assert out["prefill_step_p50_ms"] == pytest.approx(1000.0)  # p50 of 900, 1100
    assert out["decode_step_p50_ms"] == pytest.approx(20.0)  # p50 of 10, 30, 20
    decode_only = summarize(
        steps[4:6], now=106.0, window_s=5.0, max_num_seqs=4, max_num_batched_tokens=256
    )
    assert decode_only["prefill_step_p50_ms"] is None
    assert decode_only["decode_step_p50_ms"] == pytest.approx(25.0)
    empty = summarize([], now=1.0, max_num_seqs=4, max_num_batched_tokens=256)
    assert empty["prefill_step_p50_ms"] is None and empty["decode_step_p50_ms"] is None


# -- traffic ---------------------------------------------------------------------------------
def test_traffic_rates_best_rate_and_queue_growth():
    t = Traffic(started=0.0)
    for i in range(20):  # 2 per second over 10 s
        t.arrived(100.5 + i * 0.5)
    for i in range(10):
        t.finished(failed=i == 0, now=101.0 + i)
    t.rejected(429, 105.0)
    t.rejected(429, 106.0)
    t.rejected(503, 107.0)
    r = t.rates(110.0)
    assert r["arrivals_per_s"] == pytest.approx(2.0)
    assert r["completions_per_s"] == pytest.approx(1.0)
    assert r["failed_per_s"] == pytest.approx(0.1)
    assert r["rejected_429_per_s"] == pytest.approx(0.2)
    assert r["rejected_503_per_s"] == pytest.approx(0.1)
    assert r["rejected_per_s"] == pytest.approx(0.3)
    assert t.rates(200.0)["arrivals_per_s"] == 0.0  # out of the window
    # A young counter divides by its age (at least a second), not the whole window.
    young = Traffic(started=50.0)
    young.arrived(51.0)
    young.arrived(51.5)
    assert young.rates(52.0)["arrivals_per_s"] == pytest.approx(1.0)

    # The best completion rate: the highest sampled in 15 minutes, however low it is now.
    b = Traffic(started=0.0)
    for i in range(30):
        b.finished(False, 1000.0 + i * 0.2)  # 30 in 6 s: 3 per second over the 10 s window
    b.sample(1006.0, queue_length=0)
    assert b.best_completion_rate(1006.0) == pytest.approx(3.0)
    b.sample(1100.0, queue_length=0)  # nothing since: now 0, the best kept
    assert b.rates(1100.0)["completions_per_s"] == 0.0
    assert b.best_completion_rate(1100.0) == pytest.approx(3.0)
    assert b.best_completion_rate(1006.0 + 901.0) == 0.0  # forgotten after 15 minutes

    q = Traffic(started=0.0)
    assert not q.queue_growing(10.0, 5)  # no history yet
    for i, length in enumerate([1, 2, 3, 4, 5, 6]):
        q.sample(10.0 + i, length)
    assert q.queue_growing(15.0, 6)
    assert not q.queue_growing(15.0, 1)


# -- SLO and thresholds ----------------------------------------------------------------------
def test_slo_and_thresholds_follow_the_autopilot_targets_else_the_alerts():
    alerts = AlertsSettings()
    done = [
        Finished(1.0, 0.2, [0.05, 0.05], False),  # ttft 200 ms, mean itl 50 ms
        Finished(1.0, 0.9, [0.02], False),  # ttft 900 ms
        Finished(1.0, None, [], False),  # no first token: not counted
        Finished(1.0, 0.1, [0.4, 0.4], False),  # mean itl 400 ms
    ]
    plain = slo(alerts, AutopilotSettings(), done, ttft_p99_ms=880.0, itl_p99_ms=390.0)
    assert plain == {
        "ttft_p99_ms": 3000.0,
        "itl_p99_ms": 300.0,
        "source": "thresholds",
        "attainment": pytest.approx(2 / 3, abs=1e-4),
        "met": False,  # itl 390 > 300
    }
    pilot = AutopilotSettings(ttft_p99_ms=500.0)
    targeted = slo(alerts, pilot, done, ttft_p99_ms=400.0, itl_p99_ms=390.0)
    assert (targeted["source"], targeted["ttft_p99_ms"], targeted["itl_p99_ms"]) == (
        "autopilot",
        500.0,
        None,
    )
    assert targeted["attainment"] == pytest.approx(2 / 3, abs=1e-4)  # 900 ms misses
    assert targeted["met"] is True  # only the TTFT target, and 400 <= 500
    nothing = slo(alerts, pilot, [], ttft_p99_ms=None, itl_p99_ms=None)
    assert nothing["attainment"] is None and nothing["met"] is None

    th = thresholds(alerts, pilot)
    assert th["ttft_p99_ms"] == {"warn": 400.0, "crit": 500.0}
    assert th["itl_p99_ms"] == {"warn": 100.0, "crit": 300.0}  # no ITL target: [alerts]
    assert set(th) == {
        "ttft_p99_ms",
        "itl_p99_ms",
        "kv_usage_perc",
        "queue_fill",
        "rejected_per_s",
        "failed_per_s",
        "heartbeat_age_s",
    }


# -- [alerts] validation ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("alerts", "field", "says"),
    [
        ({"queue_fill_warn": 1.5}, "alerts.queue_fill_warn", "in [0, 1]"),
        ({"kv_usage_perc_crit": 101}, "alerts.kv_usage_perc_crit", "in [0, 100]"),
        ({"failed_per_s_warn": -0.1}, "alerts.failed_per_s_warn", "must be in [0, "),
        ({"ttft_p99_ms_crit": 500}, "alerts.ttft_p99_ms_crit", "alerts.ttft_p99_ms_warn (1000)"),
        ({"itl_p99_ms_warn": "fast"}, "alerts.itl_p99_ms_warn", "must be a float"),
        ({"heartbeat_age": 3}, "alerts.heartbeat_age", "unknown key"),
    ],
)
def test_alerts_validation_names_the_field(alerts, field, says):
    with pytest.raises(FieldError) as info:
        build_config({"alerts": alerts}, env={})
    assert info.value.field == field
    assert says in info.value.message


def test_alerts_defaults_and_environment():
    cfg = build_config({}, env={"CONTROLPLANE_ALERTS__QUEUE_FILL_CRIT": "0.75"})
    assert cfg.alerts.pairs()["queue_fill"] == (0.5, 0.75)
    assert cfg.alerts.pairs()["ttft_p99_ms"] == (1000.0, 3000.0)


# -- against a real daemon -------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(make_module_daemon) -> InProcessDaemon:
    """Two sequences at a time and a queue of three: easy to overload."""
    return make_module_daemon(
        admin=True,
        engine={"max_num_seqs": 2, "max_model_len": 1024},
        server={"max_queue_len": 3},
    )


def _stats(c: httpx.Client) -> dict:
    r = c.get("/admin/stats")
    assert r.status_code == 200
    return r.json()


def test_overload_shows_arrivals_rejections_waits_and_the_diagnosis(small):
    c = small.client(TOKEN)
    gen = loadgen(
        small.url,
        "--requests",
        "150",
        "--rate",
        "40",
        "--prompt-len",
        "8-16",
        "--output-len",
        "100-140",
        "--stream",
        "--timeout",
        "60",
    )
    seen_wait = seen_diagnosis = None
    peak = {"arrivals_per_s": 0.0, "rejected_429_per_s": 0.0, "completions_per_s": 0.0}
    try:
        deadline = time.monotonic() + 40
        while seen_wait is None or seen_diagnosis is None or not peak["completions_per_s"]:
            assert gen.poll() is None and time.monotonic() < deadline, f"peaks {peak}"
            st = _stats(c)
            for key in ("arrivals_per_s", "rejected_429_per_s", "completions_per_s"):
                peak[key] = max(peak.get(key, 0.0), st[key])
            if st["oldest_waiting_s"] is not None and st["queue_length"] + st["num_waiting"] > 0:
                seen_wait = st["oldest_waiting_s"]
            diagnosis = st["diagnosis"] or {}
            if diagnosis.get("code") == "overloaded" and st["rejected_429_per_s"] > 0:
                seen_diagnosis = st
            time.sleep(0.2)
    finally:
        gen.kill()
        gen.wait(30)
    assert seen_wait > 0
    st = seen_diagnosis
    assert st["arrivals_per_s"] > 0 and st["rejected_429_per_s"] > 0
    assert st["arrivals_per_s"] > 1.1 * st["best_completion_rate_per_s"]
    assert st["diagnosis"]["knob"] == "server.max_queue_len"
    assert "retuning the batch cannot fix it" in st["diagnosis"]["message"]
    assert peak["completions_per_s"] > 0
    assert st["best_completion_rate_per_s"] >= st["completions_per_s"]
    assert st["rejected_per_s"] == pytest.approx(
        st["rejected_429_per_s"] + st["rejected_503_per_s"], abs=1e-3
    )
    # The shape the dashboard reads.
    assert st["slo"]["source"] == "thresholds" and st["slo"]["ttft_p99_ms"] == 3000.0
    assert st["thresholds"]["queue_fill"] == {"warn": 0.5, "crit": 0.9}
    for key in ("ttft_p99_10s_ms", "itl_p99_10s_ms", "prefill_step_p50_ms", "decode_step_p50_ms"):
        assert key in st


def test_drain_answers_503_counted_as_rejected_503(small):
    c = small.client(TOKEN)
    assert c.post("/admin/drain").status_code == 200
    try:
        with small.client(timeout=30) as v1:
            for _ in range(3):
                r = v1.post(
                    "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
                )
                assert r.status_code == 503
        st = _stats(c)
        assert st["state"] == "draining"
        assert st["rejected_503_per_s"] > 0
        assert st["rejected_per_s"] >= st["rejected_503_per_s"]
    finally:
        assert c.post("/admin/resume").status_code == 200
    # A request admitted after the resume is counted as a completion, not a rejection.
    before = _stats(c)["rejected_503_per_s"]
    with small.client(timeout=30) as v1:
        r = v1.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200
    after = _stats(c)
    assert after["completions_per_s"] > 0
    assert after["rejected_503_per_s"] <= before


def test_requests_failed_in_the_engine_count_in_failed_per_s(small, monkeypatch):
    """A fault injected for one prompt (as tests/engine/test_engine_faults.py does): its plain request
    gets a 500, its streamed one an in-band error; both count as failed, neither as rejected."""
    victim = [61, 62, 63, 64, 65]
    real = sampler_module._filter

    def faulty(logits, seqs):
        if any(s.prompt_token_ids == victim and s.output_token_ids for s in seqs):
            raise RuntimeError("injected sampling fault")
        return real(logits, seqs)

    c = small.client(TOKEN)
    before = _stats(c)
    monkeypatch.setattr(sampler_module, "_filter", faulty)
    body = {"model": MODEL, "prompt": victim, "max_tokens": 8, "ignore_eos": True}
    with small.client() as v1:
        assert v1.post("/v1/completions", json=body).status_code == 500
        with v1.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            assert "injected sampling fault" in r.read().decode()
    monkeypatch.undo()
    st = _stats(c)
    assert st["failed_per_s"] > before["failed_per_s"]
    assert st["completions_per_s"] >= st["failed_per_s"]
    assert st["rejected_per_s"] <= before["rejected_per_s"]


def test_thresholds_follow_an_autopilot_target_and_live_alerts(small):
    c = small.client(TOKEN)
    deadline = time.monotonic() + 30
    while (st := _stats(c))["requests_in_flight"]:  # the overload's last requests end
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert st["oldest_waiting_s"] is None  # nothing waits
    assert st["thresholds"]["ttft_p99_ms"] == {"warn": 1000.0, "crit": 3000.0}
    r = c.patch("/admin/config", json={"autopilot": {"ttft_p99_ms": 250.0}})
    assert r.status_code == 200, r.text
    try:
        st = _stats(c)
        assert st["thresholds"]["ttft_p99_ms"] == {"warn": 200.0, "crit": 250.0}
        assert st["thresholds"]["itl_p99_ms"] == {"warn": 100.0, "crit": 300.0}
        assert st["slo"]["source"] == "autopilot"
        assert (st["slo"]["ttft_p99_ms"], st["slo"]["itl_p99_ms"]) == (250.0, None)
        # [alerts] is live: a change shows in the next snapshot; a bad one names its field.
        r = c.patch("/admin/config", json={"alerts": {"kv_usage_perc_warn": 70.0}})
        assert r.status_code == 200, r.text
        assert _stats(c)["thresholds"]["kv_usage_perc"] == {"warn": 70.0, "crit": 97.0}
        bad = c.patch("/admin/config", json={"alerts": {"queue_fill_crit": 0.1}})
        assert bad.status_code == 422
        assert "alerts.queue_fill_crit" in bad.text
    finally:
        c.patch("/admin/config", json={"autopilot": {"ttft_p99_ms": 0.0}})
        c.patch("/admin/config", json={"alerts": {"kv_usage_perc_warn": 85.0}})
