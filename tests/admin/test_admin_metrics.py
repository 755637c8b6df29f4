"""Unit tests for controlplane.telemetry.stats.summarize and controlplane.telemetry.metrics.Metrics.

Steps are the engine's own StepStats (torch-free), built by `Step` with zero defaults for
what a test does not care about. Request metrics are the engine's own, torch-free
RequestMetrics. Expected numbers are computed by hand in the comments.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from controlplane.common import percentile
from controlplane.engine.types import RequestMetrics, StepStats
from controlplane.telemetry.metrics import Metrics
from controlplane.telemetry.stats import cache_and_speculation, summarize

# -- steps ----------------------------------------------------------------------------------

STEP_DEFAULTS = dict(
    num_running=0,
    num_waiting=0,
    num_swapped=0,
    kv_blocks_used=0,
    kv_blocks_total=100,
    num_prefill_tokens=0,
    num_decode_tokens=0,
    num_sampled_tokens=0,
    step_duration=0.0,
    num_preemptions=0,
    num_finished=0,
)


def Step(step: int, time: float, **fields) -> StepStats:
    return StepStats(step=step, time=time, **{**STEP_DEFAULTS, **fields})


# -- summarize ------------------------------------------------------------------------------

LIMITS = {"max_num_seqs": 4, "max_num_batched_tokens": 100}


def test_percentile_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)  # rank 1.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0


def test_summarize_empty_input() -> None:
    s = summarize([], now=1000.0, **LIMITS)
    assert s["num_running"] == s["num_waiting"] == s["num_swapped"] == 0
    assert s["kv_blocks_used"] == s["kv_blocks_total"] == 0
    assert s["kv_usage_perc"] == 0.0
    assert s["prefill_tokens_per_s"] == s["decode_tokens_per_s"] == 0.0
    assert s["step_time_p50_ms"] is None and s["step_time_p99_ms"] is None
    assert s["batch_fill_seqs"] == 0.0
    assert s["batch_fill_tokens"] is None
    assert s["num_preemptions"] == s["preemptions_in_window"] == s["steps_in_window"] == 0


def test_summarize_only_initial_snapshot() -> None:
    # Step 0 is the engine's snapshot before any step: no step in the window, no rates.
    s = summarize([Step(0, 999.0, kv_blocks_total=64)], now=1000.0, **LIMITS)
    assert s["steps_in_window"] == 0
    assert s["prefill_tokens_per_s"] == s["decode_tokens_per_s"] == 0.0
    assert s["step_time_p50_ms"] is None and s["batch_fill_tokens"] is None
    assert s["kv_blocks_total"] == 64 and s["kv_usage_perc"] == 0.0


def test_summarize_window_cut_off() -> None:
    now = 100.0
    steps = [
        Step(1, 85.0, num_prefill_tokens=100, step_duration=0.5),
        # exactly now - window_s: outside (the window is (90, 100])
        Step(2, 90.0, num_prefill_tokens=50, num_decode_tokens=10, step_duration=0.4,
             num_preemptions=1),
        Step(3, 91.0, num_decode_tokens=20, step_duration=0.1, num_preemptions=1),
        Step(4, 95.0, num_prefill_tokens=40, num_decode_tokens=20, step_duration=0.2,
             num_preemptions=3),
        # exactly now: inside
        Step(5, 100.0, num_running=3, num_waiting=2, num_swapped=1, kv_blocks_used=30,
             kv_blocks_total=120, num_decode_tokens=30, step_duration=0.3, num_preemptions=4,
             num_finished=9),
    ]  # fmt: skip
    s = summarize(steps, now=now, window_s=10.0, **LIMITS)
    assert s["steps_in_window"] == 3  # steps 3, 4, 5
    # the steps reach back past the window: divide by the whole 10 s
    assert s["rate_window_s"] == 10.0
    assert s["prefill_tokens_per_s"] == pytest.approx(40 / 10)
    assert s["decode_tokens_per_s"] == pytest.approx((20 + 20 + 30) / 10)
    # durations 100, 200, 300 ms: p50 = 200, p99 = 200 + 0.98 * 100
    assert s["step_time_p50_ms"] == pytest.approx(200.0)
    assert s["step_time_p99_ms"] == pytest.approx(298.0)
    # (20 + 60 + 30) / 100 per step, averaged over 3 steps
    assert s["batch_fill_tokens"] == pytest.approx((0.2 + 0.6 + 0.3) / 3)
    assert s["batch_fill_seqs"] == pytest.approx(3 / 4)
    # cumulative 4 at the end, 1 at step 2 (the last step at or before the window's start)
    assert s["preemptions_in_window"] == 3
    assert s["num_preemptions"] == 4
    assert (s["num_running"], s["num_waiting"], s["num_swapped"]) == (3, 2, 1)
    assert (s["kv_blocks_used"], s["kv_blocks_total"]) == (30, 120)
    assert s["kv_usage_perc"] == pytest.approx(25.0)
    assert s["num_finished"] == 9 and s["step"] == 5


def test_summarize_young_engine_divides_by_its_age() -> None:
    now = 100.0
    steps = [
        Step(0, 97.0),  # initial snapshot: ignored for rates and the window
        Step(1, 98.0, num_prefill_tokens=100, step_duration=0.5, num_running=1),
        Step(2, 99.0, num_decode_tokens=5, step_duration=0.1, num_running=1, num_preemptions=2),
    ]
    s = summarize(steps, now=now, window_s=10.0, **LIMITS)
    # first step began at 98.0 - 0.5 = 97.5: 2.5 s of engine life
    assert s["rate_window_s"] == pytest.approx(2.5)
    assert s["prefill_tokens_per_s"] == pytest.approx(100 / 2.5)
    assert s["decode_tokens_per_s"] == pytest.approx(5 / 2.5)
    assert s["steps_in_window"] == 2
    # steps go back to the engine's first step: all its preemptions are in the window
    assert s["preemptions_in_window"] == 2
    # durations 500 and 100 ms: p50 = 300, p99 = 100 + 0.99 * 400
    assert s["step_time_p50_ms"] == pytest.approx(300.0)
    assert s["step_time_p99_ms"] == pytest.approx(496.0)
    assert s["batch_fill_tokens"] == pytest.approx((1.0 + 0.05) / 2)
    assert s["batch_fill_seqs"] == pytest.approx(0.25)


def test_summarize_ring_shorter_than_window() -> None:
    # The ring only holds steps 50-51 (an older engine): divide by what they cover, and take
    # the oldest step's cumulative preemptions as the baseline.
    steps = [
        Step(50, 95.0, num_decode_tokens=12, step_duration=1.0, num_preemptions=5),
        Step(51, 99.0, num_decode_tokens=12, step_duration=1.0, num_preemptions=7),
    ]
    s = summarize(steps, now=100.0, window_s=10.0, **LIMITS)
    assert s["rate_window_s"] == pytest.approx(6.0)  # 100 - (95 - 1)
    assert s["decode_tokens_per_s"] == pytest.approx(24 / 6)
    assert s["preemptions_in_window"] == 2


def test_summarize_idle_engine() -> None:
    # Last step long ago: state from it, nothing in the window.
    steps = [Step(7, 50.0, num_running=0, kv_blocks_used=10, num_decode_tokens=8,
                  step_duration=0.2, num_preemptions=3)]  # fmt: skip
    s = summarize(steps, now=100.0, window_s=10.0, **LIMITS)
    assert s["steps_in_window"] == 0
    assert s["prefill_tokens_per_s"] == s["decode_tokens_per_s"] == 0.0
    assert s["step_time_p50_ms"] is None and s["step_time_p99_ms"] is None
    assert s["batch_fill_tokens"] is None
    assert s["batch_fill_seqs"] == 0.0
    assert s["preemptions_in_window"] == 0 and s["num_preemptions"] == 3
    assert s["kv_usage_perc"] == pytest.approx(10.0)


# -- Metrics: helpers -----------------------------------------------------------------------

MODEL = "demo"


def scrape(m: Metrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels without model_name): value}; asserts every sample's model_name."""
    payload, content_type = m.render()
    # The HTTP response appends the charset to text/* types (see test_metrics_content_type...).
    assert f"{content_type}; charset=utf-8" == CONTENT_TYPE_LATEST
    out: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(payload.decode()):
        if family.name.startswith("process_"):  # prometheus_client's, no model_name
            continue
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL, sample
            out[(sample.name, frozenset(labels.items()))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def series(samples: dict, name: str) -> list[dict[str, str]]:
    return [dict(lbls) for (n, lbls) in samples if n == name]


P = "controlplane:"


# -- Metrics --------------------------------------------------------------------------------


def test_exposed_metric_names_are_exact() -> None:
    m = Metrics(MODEL)
    m.set_config({"engine.max_num_seqs": 8})
    payload, _ = m.render()
    names = {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in payload.decode().splitlines()
        if line and not line.startswith("#")
    }
    expected = {
        "num_requests_running",
        "num_requests_waiting",
        "num_requests_swapped",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "request_success_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "iteration_tokens_total_count",
        "request_prompt_tokens_count",
        "request_generation_tokens_count",
        "config_info",
        "config_changes_total",
        "records_dropped_total",
        "records_buffered",
    }
    assert {P + n for n in expected} <= names
    # Everything under the prefix but the process metrics, unprefixed as in vLLM.
    assert all(n.startswith(P) for n in names if not n.startswith("process_"))
    assert "process_resident_memory_bytes" in names
    assert not any(n.endswith("_total_total") for n in names)
    # TYPE lines say counters are counters under the exact names
    text = payload.decode()
    assert f"# TYPE {P}prompt_tokens_total counter" in text
    assert f"# TYPE {P}request_success_total counter" in text
    assert f"# TYPE {P}iteration_tokens_total histogram" in text


def test_registries_are_independent() -> None:
    from prometheus_client import REGISTRY

    a, b = Metrics(MODEL), Metrics(MODEL)  # no "Duplicated timeseries" error
    a.observe_steps([Step(1, 1.0, num_prefill_tokens=10)])
    assert value(scrape(a), P + "prompt_tokens_total") == 10
    assert value(scrape(b), P + "prompt_tokens_total") == 0
    assert REGISTRY.get_sample_value(P + "prompt_tokens_total", {"model_name": MODEL}) is None


def test_observe_steps_counts_each_step_once() -> None:
    m = Metrics(MODEL)
    steps = [
        Step(0, 0.0),  # initial snapshot: never counted
        Step(1, 1.0, num_prefill_tokens=64, num_sampled_tokens=1, num_running=1),
        Step(2, 2.0, num_prefill_tokens=16, num_decode_tokens=1, num_sampled_tokens=2, num_running=2),
        Step(3, 3.0, num_decode_tokens=2, num_sampled_tokens=2, num_running=2, num_preemptions=1),
        Step(4, 4.0, num_running=0, num_waiting=1, num_swapped=1, num_preemptions=1),  # no tokens
        Step(5, 5.0, num_prefill_tokens=8, num_decode_tokens=1, num_sampled_tokens=1, num_running=2, num_waiting=3,
             num_swapped=0, kv_blocks_used=25, kv_blocks_total=100, num_preemptions=2),
    ]  # fmt: skip
    m.observe_steps(steps[:4])  # steps 0-3
    m.observe_steps(steps[2:])  # steps 2-5: 2 and 3 again
    m.observe_steps(steps)  # all again
    s = scrape(m)
    assert value(s, P + "prompt_tokens_total") == 64 + 16 + 8
    # Sampled tokens: a completed prefill's first token counts, as in vLLM.
    assert value(s, P + "generation_tokens_total") == 1 + 2 + 2 + 1
    assert value(s, P + "num_preemptions_total") == 2  # cumulative at step 5
    # steps with tokens: 1, 2, 3, 5 -> 64, 17, 2, 9
    assert value(s, P + "iteration_tokens_total_count") == 4
    assert value(s, P + "iteration_tokens_total_sum") == 64 + 17 + 2 + 9
    assert value(s, P + "iteration_tokens_total_bucket", le="1.0") == 0
    assert value(s, P + "iteration_tokens_total_bucket", le="8.0") == 1  # 2
    assert value(s, P + "iteration_tokens_total_bucket", le="16.0") == 2  # 2, 9
    assert value(s, P + "iteration_tokens_total_bucket", le="32.0") == 3  # + 17
    assert value(s, P + "iteration_tokens_total_bucket", le="64.0") == 4  # + 64
    # gauges from step 5; KV usage is a 0-1 fraction as in vLLM v1
    assert value(s, P + "num_requests_running") == 2
    assert value(s, P + "num_requests_waiting") == 3
    assert value(s, P + "num_requests_swapped") == 0
    assert value(s, P + "kv_cache_usage_perc") == pytest.approx(0.25)

    # a stale window (older than what was seen) changes nothing, gauges included
    m.observe_steps(steps[1:3])
    m.observe_steps([])
    assert scrape(m) == s


def test_observe_steps_preemptions_survive_missed_steps() -> None:
    m = Metrics(MODEL)
    m.observe_steps([Step(1, 1.0, num_decode_tokens=1, num_sampled_tokens=1, num_preemptions=1)])
    # steps 2-4 were never handed over; the engine's cumulative count still covers them
    m.observe_steps([Step(5, 5.0, num_decode_tokens=1, num_sampled_tokens=1, num_preemptions=6)])
    s = scrape(m)
    assert value(s, P + "num_preemptions_total") == 6
    assert value(s, P + "generation_tokens_total") == 2


def test_request_success_and_latency_histograms() -> None:
    m = Metrics(MODEL)
    # stop: queue 0.5, ttft 1.0, e2e 3.0; tokens at 101.0, 101.25, 101.5, 102.5 -> gaps
    # 0.25, 0.25, 1.0
    r1 = RequestMetrics(100.0, 100.5, 101.0, 103.0, num_prompt_tokens=10, num_output_tokens=4)
    m.observe_request("stop", r1, token_times=[101.0, 101.25, 101.5, 102.5])
    # length: queue 0.2, ttft 0.4, e2e 2.4; no token times: mean ITL (2.4-0.4)/4 = 0.5, 4 times
    r2 = RequestMetrics(200.0, 200.2, 200.4, 202.4, num_prompt_tokens=20, num_output_tokens=5)
    m.observe_request("length", r2)
    # stop with one token: no ITL observation either way
    r3 = RequestMetrics(300.0, 300.0, 300.1, 300.1, num_prompt_tokens=5, num_output_tokens=1)
    m.observe_request("stop", r3, token_times=[300.1])
    # abort while waiting: never scheduled, no token; only e2e (1.5) and token counts
    r4 = RequestMetrics(400.0, None, None, 401.5, num_prompt_tokens=7, num_output_tokens=0)
    m.observe_request("abort", r4)
    s = scrape(m)

    assert value(s, P + "request_success_total", finished_reason="stop") == 2
    assert value(s, P + "request_success_total", finished_reason="length") == 1
    assert value(s, P + "request_success_total", finished_reason="abort") == 1

    assert value(s, P + "time_to_first_token_seconds_count") == 3
    assert value(s, P + "time_to_first_token_seconds_sum") == pytest.approx(1.0 + 0.4 + 0.1)
    assert value(s, P + "request_queue_time_seconds_count") == 3
    assert value(s, P + "request_queue_time_seconds_sum") == pytest.approx(0.5 + 0.2 + 0.0)
    assert value(s, P + "e2e_request_latency_seconds_count") == 4
    assert value(s, P + "e2e_request_latency_seconds_sum") == pytest.approx(3.0 + 2.4 + 0.1 + 1.5)
    # e2e buckets (vLLM's): 0.1 <= 0.3; 1.5 <= 1.5; 2.4 <= 2.5; 3.0 <= 5.0
    assert value(s, P + "e2e_request_latency_seconds_bucket", le="0.3") == 1
    assert value(s, P + "e2e_request_latency_seconds_bucket", le="1.5") == 2
    assert value(s, P + "e2e_request_latency_seconds_bucket", le="2.5") == 3
    assert value(s, P + "e2e_request_latency_seconds_bucket", le="5.0") == 4

    # ITL: 3 gaps from r1 + 4 means from r2
    assert value(s, P + "inter_token_latency_seconds_count") == 3 + 4
    assert value(s, P + "inter_token_latency_seconds_sum") == pytest.approx(1.5 + 4 * 0.5)
    assert value(s, P + "inter_token_latency_seconds_bucket", le="0.2") == 0
    assert value(s, P + "inter_token_latency_seconds_bucket", le="0.3") == 2
    assert value(s, P + "inter_token_latency_seconds_bucket", le="0.5") == 6
    assert value(s, P + "inter_token_latency_seconds_bucket", le="1.0") == 7

    assert value(s, P + "request_prompt_tokens_count") == 4
    assert value(s, P + "request_prompt_tokens_sum") == 10 + 20 + 5 + 7
    assert value(s, P + "request_generation_tokens_count") == 4
    assert value(s, P + "request_generation_tokens_sum") == 4 + 5 + 1 + 0
    assert value(s, P + "request_generation_tokens_bucket", le="1.0") == 2  # 0 and 1
    assert value(s, P + "request_generation_tokens_bucket", le="5.0") == 4


def test_vllm_bucket_boundaries() -> None:
    s = scrape(Metrics(MODEL, max_model_len=1000))

    def les(name: str) -> list[float]:
        return sorted(float(lbl["le"]) for lbl in series(s, P + name + "_bucket"))

    assert les("time_to_first_token_seconds")[:3] == [0.001, 0.005, 0.01]
    assert les("time_to_first_token_seconds")[-2:] == [2560.0, math.inf]
    assert les("inter_token_latency_seconds")[:2] == [0.01, 0.025]
    assert les("e2e_request_latency_seconds")[-2:] == [7680.0, math.inf]
    assert les("iteration_tokens_total") == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, math.inf
    ]  # fmt: skip
    # 1-2-5 up to max_model_len
    assert les("request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, math.inf]


def test_config_info_keeps_one_series() -> None:
    m = Metrics(MODEL)
    assert series(scrape(m), P + "config_info") == []  # nothing until the first set_config
    m.set_config({
        "engine.max_num_seqs": 8,
        "engine.max_num_batched_tokens": 512,
        "engine.preemption_mode": "recompute",
        "server.max_queue_len": 64,
    })  # fmt: skip
    m.set_config({
        "engine.max_num_seqs": 16,
        "engine.max_num_batched_tokens": 512,
        "engine.prefill_chunk_size": None,
        "engine.preemption_mode": "swap",
        "server.max_queue_len": 64,
    })  # fmt: skip
    s = scrape(m)
    assert series(s, P + "config_info") == [
        {
            "max_num_seqs": "16",
            "max_num_batched_tokens": "512",
            "prefill_chunk_size": "",
            "preemption_mode": "swap",
            "max_queue_len": "64",
        }
    ]
    (info_value,) = [v for (n, _), v in s.items() if n == P + "config_info"]
    assert info_value == 1.0


def test_config_info_colliding_short_names_keep_sections() -> None:
    m = Metrics(MODEL)
    m.set_config({"engine.timeout": 1, "server.timeout": 2, "engine.max_num_seqs": 4})
    assert series(scrape(m), P + "config_info") == [
        {"engine_timeout": "1", "server_timeout": "2", "max_num_seqs": "4"}
    ]


def test_config_changes_by_source() -> None:
    m = Metrics(MODEL)
    m.config_changed("api", 3)
    m.config_changed("tui")
    m.config_changed("api")
    s = scrape(m)
    assert value(s, P + "config_changes_total", source="api") == 4
    assert value(s, P + "config_changes_total", source="tui") == 1
    for source in ("default", "file", "env"):
        assert value(s, P + "config_changes_total", source=source) == 0


def test_recorder_numbers_are_read_at_scrape_time() -> None:
    m = Metrics(MODEL)
    s = scrape(m)
    assert value(s, P + "records_dropped_total") == 0
    assert value(s, P + "records_buffered") == 0

    state = {"dropped": 2, "buffered": 5}
    m.bind_recorder(lambda: state["dropped"], lambda: state["buffered"])
    s = scrape(m)
    assert value(s, P + "records_dropped_total") == 2
    assert value(s, P + "records_buffered") == 5
    state.update(dropped=3, buffered=0)
    s = scrape(m)
    assert value(s, P + "records_dropped_total") == 3
    assert value(s, P + "records_buffered") == 0

    def broken() -> int:
        raise RuntimeError("recorder closed")

    m.bind_recorder(lambda: 4, broken)  # a failing callback drops its series, not the scrape
    s = scrape(m)
    assert value(s, P + "records_dropped_total") == 4
    assert series(s, P + "records_buffered") == []


def test_metrics_content_type_has_one_charset() -> None:
    # The real /metrics route and HTTP stack; the daemon is a stand-in with what the route uses.
    from types import SimpleNamespace

    from litestar import Litestar
    from litestar.testing import TestClient

    from controlplane.admin.routes import metrics_handler

    daemon = SimpleNamespace(
        cfg=SimpleNamespace(server=SimpleNamespace(metrics_require_token=False)),
        metrics=Metrics(MODEL),
        pump_metrics=lambda: None,
    )
    with TestClient(Litestar([metrics_handler(daemon)])) as client:
        r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].count("charset") == 1, r.headers["content-type"]
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    assert "controlplane:num_requests_running" in r.text


def test_engine_classes_fit() -> None:
    common = dict(num_running=2, num_waiting=1, num_swapped=0, kv_blocks_total=40)
    steps = [
        StepStats(step=1, time=99.0, kv_blocks_used=10, num_prefill_tokens=32,
                  num_decode_tokens=0, num_sampled_tokens=1, step_duration=0.25, num_preemptions=0, num_finished=0,
                  **common),
        StepStats(step=2, time=100.0, kv_blocks_used=12, num_prefill_tokens=0,
                  num_decode_tokens=2, num_sampled_tokens=2, step_duration=0.05, num_preemptions=1, num_finished=1,
                  **common),
    ]  # fmt: skip
    s = summarize(steps, now=100.0, **LIMITS)
    assert s["kv_usage_perc"] == pytest.approx(100 * steps[-1].kv_usage)
    assert s["steps_in_window"] == 2
    assert s["rate_window_s"] == pytest.approx(1.25)  # 100 - (99 - 0.25)
    assert s["prefill_tokens_per_s"] == pytest.approx(32 / 1.25)

    m = Metrics(MODEL)
    m.observe_steps(steps)
    rm = RequestMetrics(10.0, 10.5, 11.0, 12.0, num_prompt_tokens=32, num_output_tokens=3)
    m.observe_request("stop", rm)
    out = scrape(m)
    assert value(out, P + "kv_cache_usage_perc") == pytest.approx(0.3)
    assert value(out, P + "prompt_tokens_total") == 32
    assert value(out, P + "num_preemptions_total") == 1
    assert value(out, P + "generation_tokens_total") == rm.num_output_tokens == 3
    assert value(out, P + "inter_token_latency_seconds_count") == 2  # mean 0.5, twice
    assert value(out, P + "inter_token_latency_seconds_sum") == pytest.approx(1.0)


# -- prefix cache and speculative decoding --------------------------------------------------

CACHE_SPEC = dict(
    prefix_cache_queries_total=1000,
    prefix_cache_hits_total=600,
    prefix_cache_evictions_total=7,
    kv_blocks_cached=30,
    kv_blocks_evictable=12,
    spec_decode_num_drafts_total=50,
    spec_decode_num_draft_tokens_total=150,
    spec_decode_num_accepted_tokens_total=90,
    spec_decode_accepted_per_pos=(45, 30, 15),
    speculation="active",
)


def test_prefix_cache_and_spec_decode_metrics_are_the_engine_counters() -> None:
    m = Metrics(MODEL)
    out = scrape(m)  # before any step: zeros, the state off
    assert value(out, P + "prefix_cache_hits_total") == 0
    assert value(out, P + "spec_decode_state", state="off") == 1
    assert value(out, P + "spec_decode_state", state="active") == 0

    m.observe_steps([Step(1, 1.0), Step(2, 2.0, **CACHE_SPEC)])
    out = scrape(m)
    assert value(out, P + "prefix_cache_queries_total") == 1000
    assert value(out, P + "prefix_cache_hits_total") == 600
    assert value(out, P + "prefix_cache_evictions_total") == 7
    assert value(out, P + "kv_cache_cached_blocks") == 30
    assert value(out, P + "kv_cache_evictable_blocks") == 12
    assert value(out, P + "spec_decode_num_drafts_total") == 50
    assert value(out, P + "spec_decode_num_draft_tokens_total") == 150
    assert value(out, P + "spec_decode_num_accepted_tokens_total") == 90
    per_pos = [
        value(out, P + "spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(3)
    ]
    assert per_pos == [45, 30, 15]
    assert [value(out, P + "spec_decode_state", state=s) for s in ("off", "active", "paused")] == [
        0,
        1,
        0,
    ]
    # A stale window (an older step) does not move the counters back.
    m.observe_steps([Step(1, 1.0)])
    assert value(scrape(m), P + "prefix_cache_hits_total") == 600


def test_cache_and_speculation_rates_are_window_differences() -> None:
    base = Step(5, 40.0, **{**CACHE_SPEC, "speculation": "off"})
    latest = Step(
        9,
        100.0,
        **{
            **CACHE_SPEC,
            "prefix_cache_queries_total": 1400,  # +400 looked up
            "prefix_cache_hits_total": 900,  # +300 found: 75%
            "spec_decode_num_drafts_total": 60,  # +10 verifications
            "spec_decode_num_draft_tokens_total": 180,  # +30 proposed
            "spec_decode_num_accepted_tokens_total": 114,  # +24 accepted: 80%
            "speculation": "paused",
        },
    )
    r = cache_and_speculation(latest, base)
    assert r["prefix_cache_hit_rate"] == pytest.approx(0.75)
    assert r["prefix_cache_queries_in_window"] == 400
    assert r["spec_acceptance_rate"] == pytest.approx(0.8)
    assert r["spec_mean_accepted_len"] == pytest.approx(24 / 10 + 1)
    assert r["speculation"] == "paused"
    assert (r["kv_blocks_cached"], r["kv_blocks_evictable"]) == (30, 12)
    # Since start (no base): the cumulative totals.
    assert cache_and_speculation(latest, None)["prefix_cache_hit_rate"] == pytest.approx(
        0.9 * 1000 / 1400
    )
    # Nothing looked up or proposed in the window: None, not 0 or a division error.
    idle = cache_and_speculation(latest, latest)
    assert idle["prefix_cache_hit_rate"] is None
    assert idle["spec_acceptance_rate"] is None and idle["spec_mean_accepted_len"] is None
    assert cache_and_speculation(None, None)["speculation"] == "off"
