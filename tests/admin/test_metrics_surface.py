"""The /metrics surface against real daemons on loopback (tiny model, real HTTP, the real
exposition parsed by prometheus_client): vLLM's request-phase series, the older names, process
and HTTP metrics, server.metrics_prefix, and the deploy/ examples that read these names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from controlplane.config import load_config
from controlplane.errors import FieldError
from controlplane.store.models import CostRollupRow
from harness import InProcessDaemon
from tests.admin.test_admin_api import TOKEN, admin_cfg

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-metrics-0123456789"
P = "controlplane:"
MAX_TOKENS = (5, 7, 30)  # one per completion below, with ignore_eos: each generates exactly that
# vLLM's series the issue found missing, all with the model_name label.
REQUEST_HISTOGRAMS = (
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_max_num_generation_tokens",
    "request_params_max_tokens",
    "request_params_n",
)
PROCESS = (
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_cpu_seconds_total",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
)


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of the live exposition: (name, labels without model_name) -> value."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def get(s: dict, name: str, **labels: str) -> float:
    return s.get((name, frozenset(labels.items())), 0.0)


def names(s: dict) -> set[str]:
    return {name for name, _ in s}


@pytest.fixture(scope="module")
def daemon(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        admin=True,
        api_keys=[{"name": "team", "key": KEY}],
        engine={"max_num_seqs": 8, "max_model_len": 1024},
    )


@pytest.fixture(scope="module")
def vllm_daemon(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    path = admin_cfg(tmp, tiny_model_dir, engine={"max_model_len": 1024})
    cfg = load_config(path, env={"CONTROLPLANE_SERVER__METRICS_PREFIX": "vllm"})
    assert cfg.server.metrics_prefix == "vllm"
    with InProcessDaemon(cfg, config_path=path) as d:
        with d.client() as c:
            r = c.post("/v1/completions", json={"model": "model", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200, r.text
        d.daemon.runtime.pump_metrics()
        yield d


@pytest.fixture(scope="module")
def served(daemon):
    """Three completions, one streamed chat, and a few HTTP outcomes; the scrapes around them."""
    before = samples(daemon.url)
    with daemon.client(KEY) as c:
        for n in MAX_TOKENS:
            body = {"model": "model", "prompt": "count to ten", "max_tokens": n, "ignore_eos": True}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n, r.text
        chat = {
            "model": "model",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
        }
        with c.stream("POST", "/v1/chat/completions", json=chat) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert c.get("/v1/models").status_code == 200
        assert c.get("/no/such/route").status_code == 404
    with daemon.client() as c:
        assert c.get("/v1/models").status_code == 401
    with daemon.client(TOKEN) as c:
        for rid in ("req-one", "req-two"):  # two ids, one route template
            assert c.post(f"/admin/requests/{rid}/abort").status_code == 404
    daemon.daemon.runtime.pump_metrics()
    return before, samples(daemon.url)


def delta(served, name: str, **labels: str) -> float:
    before, after = served
    return get(after, name, **labels) - get(before, name, **labels)


def test_request_phase_histograms(served) -> None:
    requests = len(MAX_TOKENS) + 1
    _, after = served
    for name in REQUEST_HISTOGRAMS:
        assert delta(served, P + name + "_count") == requests, name
    prefill = delta(served, P + "request_prefill_time_seconds_sum")
    decode = delta(served, P + "request_decode_time_seconds_sum")
    inference = delta(served, P + "request_inference_time_seconds_sum")
    assert prefill > 0 and decode > 0
    # Scheduled -> first token -> finish: the two phases add up to the running time.
    assert inference == pytest.approx(prefill + decode, rel=1e-6)
    assert inference <= delta(served, P + "e2e_request_latency_seconds_sum")
    # The older name carries the same observations as inter_token_latency_seconds.
    for suffix in ("_count", "_sum"):
        assert delta(served, P + "time_per_output_token_seconds" + suffix) == pytest.approx(
            delta(served, P + "inter_token_latency_seconds" + suffix)
        )
    assert delta(served, P + "time_per_output_token_seconds_count") == sum(
        n - 1 for n in (*MAX_TOKENS, 4)
    )
    # max_tokens 5, 7, 30 and the chat's 4 in vLLM's 1-2-5 buckets (cumulative); with
    # ignore_eos every request generated exactly its max_tokens, so both histograms agree.
    for name in ("request_params_max_tokens", "request_max_num_generation_tokens"):
        bucket = P + name + "_bucket"
        assert [delta(served, bucket, le=le) for le in ("2.0", "5.0", "10.0", "20.0", "50.0")] == [
            0,
            2,
            3,
            3,
            4,
        ], name
        assert delta(served, P + name + "_sum") == sum(MAX_TOKENS) + 4
    assert delta(served, P + "request_params_n_bucket", le="1.0") == requests
    # KV use under vLLM v0's names: on a CPU engine the CPU one is the KV use, the GPU one 0.
    assert get(after, P + "gpu_cache_usage_perc") == 0.0
    assert get(after, P + "cpu_cache_usage_perc") == get(after, P + "kv_cache_usage_perc")
    assert (P + "cpu_cache_usage_perc", frozenset()) in after


def test_http_metrics_by_route_template(served) -> None:
    requests = P + "http_requests_total"
    assert delta(served, requests, route="/v1/completions", method="POST", status="200") == 3
    # The streamed chat counts once, when its stream ended.
    assert delta(served, requests, route="/v1/chat/completions", method="POST", status="200") == 1
    assert delta(served, requests, route="/v1/models", method="GET", status="200") == 1
    assert delta(served, requests, route="/v1/models", method="GET", status="401") == 1
    assert delta(served, requests, route="none", method="GET", status="404") == 1
    abort = "/admin/requests/{request_id}/abort"
    assert delta(served, requests, route=abort, method="POST", status="404") == 2
    _, after = served
    routes = {dict(labels).get("route") for name, labels in after if name == requests}
    assert not any("req-one" in r or "such" in r for r in routes), routes
    duration = P + "http_request_duration_seconds"
    assert delta(served, duration + "_count", route="/v1/completions", method="POST") == 3
    assert delta(served, duration + "_sum", route="/v1/chat/completions", method="POST") > 0
    # The scrapes themselves are counted (the second scrape sees the first).
    assert get(after, requests, route="/metrics", method="GET", status="200") >= 1


def test_process_metrics(served) -> None:
    _, after = served
    for name in PROCESS:
        assert get(after, name) > 0, name


def test_vllm_prefix(vllm_daemon) -> None:
    s = samples(vllm_daemon.url)
    for name in ("num_requests_waiting", "gpu_cache_usage_perc", "kv_cache_usage_perc"):
        assert ("vllm:" + name, frozenset()) in s, name
    assert get(s, "vllm:request_success_total", finished_reason="length") == 1
    assert get(s, "vllm:request_prefill_time_seconds_count") == 1
    assert not [n for n in names(s) if n.startswith("controlplane:")]
    # Our own series keep their names under the vllm prefix.
    assert any(n == "vllm:config_info" for n in names(s))
    assert "vllm:http_requests_total" in names(s)


def test_bad_prefix_names_the_field(tmp_path, tiny_model_dir) -> None:
    path = admin_cfg(tmp_path, tiny_model_dir, server={"metrics_prefix": "prometheus"})
    with pytest.raises(FieldError) as err:
        load_config(path, env={})
    assert err.value.field == "server.metrics_prefix"
    assert "controlplane" in str(err.value) and "vllm" in str(err.value)
    assert "prometheus" in str(err.value)


# -- deploy/ ------------------------------------------------------------------------------

GATEWAY = ROOT / "deploy" / "gateway-inference-extension.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "controlplane.json"


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def _exposed(url: str) -> set[str]:
    """Every series name a query may select on the live exposition: each family's samples,
    and for a labelled family with no sample yet (autopilot_decisions_total before the first
    decision) the names its TYPE gives it."""
    out = set()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        out |= {s.name for s in family.samples}
        out |= {family.name + x for x in SUFFIXES.get(family.type, ("",))}
    return out


def test_gateway_example_reads_series_the_daemon_exposes(vllm_daemon) -> None:
    docs = [d for d in yaml.safe_load_all(GATEWAY.read_text()) if d]
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    (pool,) = by_kind["InferencePool"]
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    daemons = deployments[pool["metadata"]["name"]]
    # The pool selects the daemons' pods, on the port they serve.
    pod_labels = daemons["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"].items() <= pod_labels.items()
    (container,) = daemons["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CONTROLPLANE_SERVER__METRICS_PREFIX"] == "vllm"
    ports = {p["containerPort"] for p in container["ports"]}
    assert pool["spec"]["targetPortNumber"] in ports
    # The endpoint picker's metric flags name series the daemon exposes with that prefix.
    picker = deployments[pool["spec"]["extensionRef"]["name"]]
    (epp,) = picker["spec"]["template"]["spec"]["containers"]
    flags = dict(a.lstrip("-").split("=", 1) for a in epp["args"] if "=" in a)
    exposed = _exposed(vllm_daemon.url)
    # An empty flag turns that metric off (the LoRA one: no adapters here).
    metric_flags = {k: v for k, v in flags.items() if k.endswith("Metric") and v}
    assert {"totalQueuedRequestsMetric", "kvCacheUsagePercentageMetric"} <= metric_flags.keys()
    for flag, name in metric_flags.items():
        assert name.split("{")[0] in exposed, (flag, name)
    # Every env override the example sets is a key the daemon knows.
    load_config(None, env={k: v for k, v in env.items() if k.startswith("CONTROLPLANE_")})


PROMQL_WORDS = {
    "sum", "rate", "irate", "increase", "histogram_quantile", "avg", "max", "min", "count",
    "topk", "bottomk", "clamp_min", "clamp_max", "by", "without", "on", "ignoring",
    "group_left", "group_right", "and", "or", "unless", "bool", "offset", "time", "vector",
    "scalar", "delta", "deriv", "changes", "resets", "avg_over_time", "max_over_time", "abs",
    "label_replace", "sort_desc", "le",
}  # fmt: skip


def promql_names(expr: str) -> set[str]:
    """The metric names an expression selects: strings, label matchers, ranges and grouping
    clauses removed, then every identifier that is not PromQL's own."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    found = re.findall(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", expr)
    return {n for n in found if n not in PROMQL_WORDS}


def test_grafana_dashboard_queries_series_the_daemon_exposes(daemon, served) -> None:
    board = json.loads(DASHBOARD.read_text())
    panels = [p for p in board["panels"] if p.get("type") != "row"]
    exposed = _exposed(daemon.url)
    seen: set[str] = set()
    sql: list[str] = []
    for panel in panels:
        assert panel.get("targets"), panel["title"]
        for target in panel["targets"]:
            if "rawSql" in target:
                sql.append(target["rawSql"])
                continue
            used = promql_names(target["expr"])
            assert used, (panel["title"], target["expr"])
            missing = used - exposed
            assert not missing, (panel["title"], missing)
            seen |= used
    # vLLM's dashboard's questions and the ones only this daemon answers all have a panel.
    for name in (
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "autopilot_decisions_total",
        "config_changes_total",
        "prefix_cache_hits_total",
        "spec_decode_num_accepted_tokens_total",
        "request_prefill_time_seconds_sum",
        "http_requests_total",
    ):
        assert P + name in seen, name
    # Cost comes from the store (hourly rollups by model and key), not from /metrics: the SQL
    # panels read the view over cost_rollups (migration 0012), summed columns of the same names.
    assert sql
    columns = set(CostRollupRow.__table__.columns.keys())
    for query in sql:
        assert "FROM hourly_cost_by_model_key" in query
        used = set(re.findall(r"\b[a-z_]+(?:_usd|_tokens|_bucket|_name)\b", query))
        assert used and used <= columns, used - columns
