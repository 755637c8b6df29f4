"""Prometheus metrics for the daemon, named and meant like vLLM's.

Every vLLM metric here keeps its name with the ``vllm:`` prefix swapped for ``controlplane:``
(or kept: server.metrics_prefix = "vllm" names every series ``vllm:...``, ours included)
and carries the same ``model_name`` label, so a Grafana dashboard built for vLLM works after a
search-and-replace of the prefix. The metrics live in a registry owned by each `Metrics` (never
the global one), so several daemons can share a test process.

Exposed names (``render()`` output; the ``_created`` samples prometheus_client adds to counters
and histograms are not listed):

- gauges: ``controlplane:num_requests_running``, ``controlplane:num_requests_waiting``,
  ``controlplane:num_requests_swapped`` (vLLM v0 only; v1 dropped it),
  ``controlplane:kv_cache_usage_perc`` (vLLM v1 semantics: a fraction, 1 means 100 percent);
- counters: ``controlplane:prompt_tokens_total``, ``controlplane:generation_tokens_total``,
  ``controlplane:num_preemptions_total``, ``controlplane:request_success_total{finished_reason}``;
- histograms: ``controlplane:time_to_first_token_seconds``,
  ``controlplane:inter_token_latency_seconds``, ``controlplane:e2e_request_latency_seconds``,
  ``controlplane:request_queue_time_seconds``, ``controlplane:iteration_tokens_total``,
  ``controlplane:request_prompt_tokens``, ``controlplane:request_generation_tokens``,
  ``controlplane:request_prefill_time_seconds``, ``controlplane:request_decode_time_seconds``,
  ``controlplane:request_inference_time_seconds``,
  ``controlplane:request_max_num_generation_tokens``, ``controlplane:request_params_max_tokens``,
  ``controlplane:request_params_n`` (with vLLM v1's bucket boundaries);
- vLLM's older names beside the current ones: the histogram
  ``controlplane:time_per_output_token_seconds`` (the inter-token latency's observations) and
  gauges ``controlplane:gpu_cache_usage_perc`` / ``controlplane:cpu_cache_usage_perc`` (the KV
  use on a CUDA / CPU engine, the other 0);
- process metrics ``process_*`` (prometheus_client's ProcessCollector, never prefixed) and the
  HTTP series ``controlplane:http_requests_total{route,method,status}`` and
  ``controlplane:http_request_duration_seconds{route,method}`` (controlplane.telemetry.http);
- prefix caching (vLLM v1's names): counters ``controlplane:prefix_cache_queries_total`` and
  ``controlplane:prefix_cache_hits_total`` (prompt tokens looked up / found cached), and our
  own ``controlplane:prefix_cache_evictions_total`` (cached blocks evicted to make room),
  gauges ``controlplane:kv_cache_cached_blocks`` (blocks holding a cached prefix, in use or
  not) and ``controlplane:kv_cache_evictable_blocks`` (cached and unused: reusable, evicted
  after the free ones);
- speculative decoding (vLLM v1's names): counters ``controlplane:spec_decode_num_drafts_total``,
  ``controlplane:spec_decode_num_draft_tokens_total``,
  ``controlplane:spec_decode_num_accepted_tokens_total`` and
  ``controlplane:spec_decode_num_accepted_tokens_per_pos_total{position}``; our own gauge
  ``controlplane:spec_decode_state{state}`` (1 for the current state of off / active / paused,
  0 for the others: the enum pattern, so a panel can show the state and an alert can fire on
  ``paused`` without decoding numbers);
- controlplane's own: ``controlplane:config_info`` (gauge = 1, labels = the live knobs),
  ``controlplane:config_changes_total{source}``, ``controlplane:records_dropped_total`` and
  ``controlplane:records_buffered`` (read from the SQL recorder at scrape time),
  ``controlplane:ignored_request_fields_total{field}`` (/v1 request fields the server does not
  read and ignored; label values bounded, see `Metrics.ignored_request_fields`);
- structured outputs: ``controlplane:structured_requests_total{type}`` (json_schema,
  json_object, regex, choice, grammar, tools), the histogram
  ``controlplane:grammar_compile_seconds`` (cache misses), counters
  ``controlplane:grammar_cache_hits_total``, ``controlplane:grammar_compiles_total``,
  ``controlplane:grammar_mask_seconds_total`` (computing and applying token masks) and
  ``controlplane:grammar_mask_wait_seconds_total`` (steps waiting for masks after their
  forward), gauge ``controlplane:grammar_states``;
- spend budgets (controlplane.tenants.budgets): counters
  ``controlplane:budget_events_total{api_key,event}`` (a key passed its soft threshold,
  ``soft_threshold``, or reached its budget, ``exhausted``: once per key and period) and
  ``controlplane:budget_requests_total{api_key,action}`` (requests of keys at their budget,
  ``rejected`` with 429 or admitted ``deprioritized``); the key label bounded as the ignored
  fields' is (`Metrics.budget_key_label`);
- tenants (controlplane.tenants.usage): counter
  ``controlplane:requests_throttled_total{api_key,reason}`` (requests refused before they ran:
  the four rate limits by name, ``insufficient_quota``, ``queue_full``,
  ``limiter_unavailable``, ``suspended``; an open API's requests under ``(open)``; the key label
  bounded by the same `Metrics.budget_key_label`, one set of names for every per-key counter)
  and the histogram ``controlplane:request_queue_time_by_class_seconds{priority_class}`` (the
  queue wait of each finished request by the class it was scheduled in, 0 to 9);
- asynchronous scheduling: counter ``controlplane:async_steps_total`` (steps launched before
  the previous step's tokens were known; /admin/stats' ``async_step_share`` over its window);
- what the engine runs on: ``controlplane:kernels_loaded{reason}`` (1 while our C++ CPU
  kernels serve or are not needed, reason empty; 0 while torch's kernels serve instead, the
  reason as /admin/stats `kernels` says it) and ``controlplane:compiled_step{state}`` (1 for
  the compiled decode step's current state of off / cold / warming / ready / failed, 0 for
  the others), both read at scrape time once the model has loaded (`bind_kernels`).

prometheus_client appends ``_total`` to counter names itself, so counters are created without
it (``Counter("controlplane:prompt_tokens", ...)`` renders ``controlplane:prompt_tokens_total``).
``controlplane:iteration_tokens_total`` is a histogram, so it keeps the name as given, as in vLLM.

Differences from vLLM, forced by where the numbers come from:

- ``prompt_tokens_total`` counts prefill tokens as the engine computes them, step by step
  (``StepStats.num_prefill_tokens``): chunks count as they run, prompts recomputed after a
  preemption count again. vLLM v1 counts each prompt once when its prefill completes.
- ``generation_tokens_total`` counts the tokens each step sampled
  (``StepStats.num_sampled_tokens``), the first token of each request included, as vLLM does.
- Request histograms (TTFT, inter-token latency, queue time, e2e) are observed when the
  request finishes, not token by token.
- There is no ``engine`` label (one engine per daemon).
"""

from __future__ import annotations

import enum
import itertools
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.engine.types import RequestMetrics, StepStats
from controlplane.store.models import CONFIG_SOURCES

__all__ = ["CONFIG_SOURCES", "FINISH_REASONS", "Metrics", "RequestMetrics"]

from controlplane.telemetry.http import HttpMetrics
from controlplane.telemetry.scrape import (
    PREFIX,
    ScrapeTimeCollector,
)

log = logging.getLogger(__name__)

# The exposition's media type without its charset: the HTTP response appends "; charset=utf-8"
# to every text/* type itself, and prometheus_client's CONTENT_TYPE_LATEST already ends in one
# (passing it on unchanged sent the charset twice).
MEDIA_TYPE = "; ".join(
    part for part in CONTENT_TYPE_LATEST.split("; ") if not part.startswith("charset=")
)

# "error": one request failed inside the engine, which kept serving the others.
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM v1 (vllm/v1/metrics/loggers.py, PrometheusStatLogger) bucket boundaries.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)  # request_params_n
DEFAULT_MAX_MODEL_LEN = 131072
# ignored_request_fields_total's `field` label: clients choose field names, so the label's
# cardinality is bounded; longer names and names beyond the first distinct ones share OTHER.
MAX_IGNORED_FIELD_LABELS = 100
MAX_IGNORED_FIELD_CHARS = 64
OTHER_FIELD = "other"
# The `api_key` label of the per-key counters (budgets', requests_throttled_total): keys are
# made by operators, not clients, but a table may hold many; beyond the first distinct names
# (and for none) they share OTHER_KEY.
MAX_BUDGET_KEY_LABELS = 100
OTHER_KEY = "(other)"
BUDGET_EVENTS = ("soft_threshold", "exhausted")
BUDGET_ACTIONS = ("rejected", "deprioritized")


# structured_requests_total's `type` label: what constrained the output.
STRUCTURED_TYPES = ("json_schema", "json_object", "regex", "choice", "grammar", "tools")
# Grammar compile times: from a cached-lexer JSON schema (~1 ms) to the compile timeout.
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's request-token-count buckets)."""
    out: list[int] = []
    mantissa, exponent = (1, 2, 5), 0
    while True:
        for m in mantissa:
            v = m * 10**exponent
            if v > max_value:
                return out
            out.append(v)
        exponent += 1


_LABEL_BAD = re.compile(r"[^a-zA-Z0-9_]")


def _label_name(key: str) -> str:
    name = _LABEL_BAD.sub("_", str(key)).lstrip("_") or "knob"
    if name[0].isdigit():
        name = "k_" + name
    return "config_model_name" if name == "model_name" else name


def _label_value(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        value = value.value
    return str(value)


def _span(start: float | None, end: float | None) -> float | None:
    """Seconds from `start` to `end` (never negative); None when either is unknown."""
    return None if start is None or end is None else max(0.0, end - start)


class Metrics:
    """Prometheus metrics for one daemon (one model), in a registry of its own.

    Thread-safe: the step collector, request completions and scrapes may run on different
    threads.
    """

    def __init__(
        self,
        model_name: str,
        *,
        max_model_len: int | None = None,
        prefix: str = PREFIX,
        device: str = "cpu",
        http: HttpMetrics | None = None,
    ) -> None:
        """`model_name` labels every model series; the daemon passes the served name, known
        before the model loads (controlplane.config.served_model_name_of): a placeholder while
        loading would be listed as a model by a dashboard's Model dropdown. `max_model_len` sets
        the top of the request-token-count buckets (1-2-5 series, as vLLM); without it they go
        up to 131072. `prefix`: every series' name starts with it
        (``controlplane:`` or ``vllm:``, server.metrics_prefix). `device`: the engine's
        (``cuda...`` sets ``gpu_cache_usage_perc``, anything else ``cpu_cache_usage_perc``).
        `http`: the HTTP middleware's series (kept by the runtime across the registry swap
        when the model has loaded); without it this registry has none. Process metrics
        (``process_*``, unprefixed as everywhere) are always registered."""
        self.model_name = model_name
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self._on_gpu = str(device).startswith("cuda")
        self._lock = threading.Lock()
        self._last_step = 0  # highest step number already counted (step 0 is no step)
        self._preemptions_seen = 0  # engine's cumulative preemption count already counted
        self._latest: StepStats | None = None  # the newest step seen (cumulative counters)
        self._config_labels: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._recorder: tuple[Callable[[], int] | None, Callable[[], int] | None] = (None, None)
        # /admin/stats `kernels` and `compiled_step`, read at scrape time (bind_kernels).
        self._kernels: tuple[Callable[[], Mapping[str, Any]], Callable[[], str]] | None = None
        self._ranks: Callable[[], Mapping[str, Any] | None] | None = None
        self._ignored_names: set[str] = set()  # field names with a label of their own
        self._budget_keys: set[str] = set()  # key names with a budget label of their own
        self._ignored_other = False  # whether the OTHER_FIELD label is in use

        reg, labels, m = self.registry, ["model_name"], model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(prefix + name, doc, labels, registry=reg).labels(m)

        def counter(name: str, doc: str) -> Counter:
            return Counter(prefix + name, doc, labels, registry=reg).labels(m)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(prefix + name, doc, labels, registry=reg, buckets=buckets).labels(m)

        self.num_requests_running = gauge(
            "num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.num_requests_swapped = gauge(
            "num_requests_swapped", "Number of requests swapped to CPU."
        )
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        # vLLM v0's names (v1 kept gpu_cache_usage_perc as a deprecated copy): tools such as
        # the Gateway API Inference Extension's endpoint picker still read them.
        self.gpu_cache_usage_perc = gauge(
            "gpu_cache_usage_perc",
            "GPU KV-cache usage (the engine on CUDA; 0 on a CPU engine). 1 means 100 percent "
            "usage. DEPRECATED in vLLM: use kv_cache_usage_perc.",
        )
        self.cpu_cache_usage_perc = gauge(
            "cpu_cache_usage_perc",
            "CPU KV-cache usage (the engine on the CPU; 0 on a CUDA engine). 1 means 100 "
            "percent usage.",
        )

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self.num_preemptions = counter(
            "num_preemptions", "Cumulative number of preemption from the engine."
        )
        self._request_success = Counter(
            prefix + "request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        for reason in FINISH_REASONS:
            self._request_success.labels(m, reason)
        self._config_changes = Counter(
            prefix + "config_changes",
            "Configuration changes applied, by where they came from.",
            [*labels, "source"],
            registry=reg,
        )
        for source in CONFIG_SOURCES:
            self._config_changes.labels(m, source)
        self._ignored_fields = Counter(
            prefix + "ignored_request_fields",
            "Request fields the server does not read and ignored, by field name.",
            [*labels, "field"],
            registry=reg,
        )

        self._budget_events = Counter(
            prefix + "budget_events",
            "API keys that passed their budget's soft threshold or reached the budget, once per "
            "key and period.",
            [*labels, "api_key", "event"],
            registry=reg,
        )
        self._requests_throttled = Counter(
            prefix + "requests_throttled",
            "Requests refused before they ran, by API key and reason: a rate limit "
            "(requests_per_minute, tokens_per_minute, max_concurrent, max_tokens_per_request), "
            "the key's budget (insufficient_quota), the server's queue (queue_full), the rate "
            "limiter unreachable (limiter_unavailable), a suspended key (suspended).",
            [*labels, "api_key", "reason"],
            registry=reg,
        )
        self._budget_requests = Counter(
            prefix + "budget_requests",
            "Requests of API keys at their spend budget: rejected (429 insufficient_quota) or "
            "admitted deprioritized.",
            [*labels, "api_key", "action"],
            registry=reg,
        )

        self._autopilot_decisions = Counter(
            prefix + "autopilot_decisions",
            "Knob changes the SLO autopilot made, by knob and direction (latency, throughput).",
            [*labels, "knob", "direction"],
            registry=reg,
        )
        self.autopilot_enabled = gauge("autopilot_enabled", "1 while the SLO autopilot is on.")
        self._structured_requests = Counter(
            prefix + "structured_requests",
            "Requests whose output was constrained, by what constrained it.",
            [*labels, "type"],
            registry=reg,
        )
        for kind in STRUCTURED_TYPES:
            self._structured_requests.labels(m, kind)
        self.grammar_compile_time = histogram(
            "grammar_compile_seconds",
            "Structured outputs: grammar compile time (cache misses only).",
            GRAMMAR_COMPILE_BUCKETS,
        )
        self._slo_attainment = Gauge(
            prefix + "slo_attainment",
            "Fraction of requests finished in the autopilot's window within the target.",
            [*labels, "target"],
            registry=reg,
        )

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        # The queue wait per scheduling class (0-10 label values at most): what a priority-
        # aware engine.scheduling_policy changes, where request_queue_time_seconds mixes them.
        self._queue_time_by_class = Histogram(
            prefix + "request_queue_time_by_class_seconds",
            "Histogram of time spent in WAITING phase for request, by the request's priority "
            "class (its API key's priority_class; 9 once over a deprioritizing budget).",
            [*labels, "priority_class"],
            registry=reg,
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        token_buckets = build_1_2_5_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.", REQUEST_N_BUCKETS
        )
        # vLLM v1 observes the same per-token gaps under the older name as well.
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            ITL_BUCKETS,
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

        reg.register(ScrapeTimeCollector(self))
        reg.register(_KernelsCollector(self))
        reg.register(_RanksCollector(self))
        ProcessCollector(registry=reg)
        self.http = http
        if http is not None:
            http.register(reg)

    # -- the autopilot ----------------------------------------------------------------------
    def observe_autopilot(
        self,
        knob: str | None,
        direction: str | None,
        attainment: Mapping[str, float | None] | None = None,
    ) -> None:
        """One autopilot decision (a change when `knob` is set) and the window's attainment.
        `autopilot_enabled` is set where the metrics are pumped (Runtime.pump_metrics)."""
        if knob is not None and direction is not None:
            self._autopilot_decisions.labels(self.model_name, knob, direction).inc()
        for target, value in (attainment or {}).items():
            if value is not None:
                self._slo_attainment.labels(self.model_name, target).set(value)

    def observe_structured(self, kind: str, compile_s: float | None) -> None:
        """One admitted constrained request; `compile_s` when its grammar was compiled for it
        (None: found in the cache)."""
        self._structured_requests.labels(self.model_name, kind).inc()
        if compile_s is not None:
            self.grammar_compile_time.observe(compile_s)

    # -- engine steps ---------------------------------------------------------------------
    def observe_steps(self, steps: Iterable[StepStats]) -> None:
        """Count the steps not counted before and set the gauges from the latest step.

        Steps are recognized by their ``step`` number: only steps numbered above the highest
        one already counted add to the counters, so overlapping windows of the ring can be
        passed again and again. Step numbers must grow (one Metrics per engine); step 0, the
        engine's snapshot before its first step, is never counted. Preemptions come from the
        engine's cumulative count, so steps missing from the windows do not lose them; tokens
        of steps that were never passed are lost.

        ``iteration_tokens_total`` observes prefill + decode tokens of each new step that
        processed at least one token.
        """
        steps = list(steps)
        if not steps:
            return
        latest = max(steps, key=lambda s: s.step)
        with self._lock:
            if latest.step < self._last_step:
                return  # a stale window: nothing new, and its gauges would go back in time
            new = [s for s in steps if s.step > self._last_step]
            prefill = decode = 0
            for s in new:
                prefill += s.num_prefill_tokens
                decode += s.num_sampled_tokens
                tokens = s.num_prefill_tokens + s.num_decode_tokens
                if tokens > 0:
                    self.iteration_tokens.observe(tokens)
            if prefill:
                self.prompt_tokens.inc(prefill)
            if decode:
                self.generation_tokens.inc(decode)
            if new:
                self._last_step = latest.step
                if latest.num_preemptions > self._preemptions_seen:
                    self.num_preemptions.inc(latest.num_preemptions - self._preemptions_seen)
                    self._preemptions_seen = latest.num_preemptions
            self._latest = latest
            self.num_requests_running.set(latest.num_running)
            self.num_requests_waiting.set(latest.num_waiting)
            self.num_requests_swapped.set(latest.num_swapped)
            total = latest.kv_blocks_total
            usage = latest.kv_blocks_used / total if total else 0.0
            self.kv_cache_usage_perc.set(usage)
            self.gpu_cache_usage_perc.set(usage if self._on_gpu else 0.0)
            self.cpu_cache_usage_perc.set(0.0 if self._on_gpu else usage)

    # -- requests -------------------------------------------------------------------------
    def observe_request(
        self,
        finish_reason: str,
        metrics: RequestMetrics,
        token_times: Sequence[float] | None = None,
        *,
        max_tokens: int | None = None,
        n: int = 1,
        max_choice_tokens: int | None = None,
        priority_class: int | None = None,
    ) -> None:
        """Record one finished request.

        ``finish_reason`` labels ``request_success_total`` (stop | length | abort | error; as in vLLM,
        aborted and failed requests are counted there too). Latencies that are None (never scheduled, no
        token) are not observed. ``token_times``: the time of each output token; each gap
        between consecutive tokens is one inter-token-latency observation (and one of
        ``time_per_output_token_seconds``, vLLM's older name for it). Without it, ``mean_itl``
        is observed ``num_output_tokens - 1`` times.

        Phases (as vLLM v1): prefill from first scheduled to first token, decode from first
        token to finish, inference from first scheduled to finish; a phase whose ends are not
        both known is not observed. ``max_tokens`` and ``n``: the request's parameters
        (``request_params_*``; max_tokens not observed when None). ``max_choice_tokens``: the
        most tokens one of its choices generated (``request_max_num_generation_tokens``, as
        vLLM: the longest of the n); None: ``num_output_tokens`` (right for n = 1).
        ``priority_class``: the class the request was scheduled in (SamplingParams'), whose
        ``request_queue_time_by_class_seconds`` also observes its queue time; None: not
        observed there.
        """
        self._request_success.labels(self.model_name, finish_reason).inc()
        scheduled, first, end = (
            metrics.first_scheduled_time,
            metrics.first_token_time,
            metrics.finish_time,
        )
        for hist, value in (
            (self.time_to_first_token, metrics.ttft),
            (self.request_queue_time, metrics.queue_time),
            (self.e2e_request_latency, metrics.e2e_latency),
            (self.request_prefill_time, _span(scheduled, first)),
            (self.request_decode_time, _span(first, end)),
            (self.request_inference_time, _span(scheduled, end)),
        ):
            if value is not None:
                hist.observe(value)
        if priority_class is not None and metrics.queue_time is not None:
            self._queue_time_by_class.labels(self.model_name, str(priority_class)).observe(
                metrics.queue_time
            )
        self.request_prompt_tokens.observe(metrics.num_prompt_tokens)
        self.request_generation_tokens.observe(metrics.num_output_tokens)
        self.request_max_num_generation_tokens.observe(
            metrics.num_output_tokens if max_choice_tokens is None else max_choice_tokens
        )
        if max_tokens is not None:
            self.request_params_max_tokens.observe(max_tokens)
        self.request_params_n.observe(n)
        if token_times is not None:
            gaps = [max(0.0, b - a) for a, b in itertools.pairwise(token_times)]
        else:
            itl = metrics.mean_itl
            gaps = [] if itl is None else [itl] * (metrics.num_output_tokens - 1)
        for gap in gaps:
            self.inter_token_latency.observe(gap)
            self.time_per_output_token.observe(gap)

    # -- configuration --------------------------------------------------------------------
    def set_config(self, live: Mapping[str, object]) -> None:
        """Make ``controlplane:config_info`` show these knobs (replacing the previous set).

        Label names are the keys without their section (``engine.max_num_seqs`` gives
        ``max_num_seqs``; the whole key where two would collide), characters outside
        ``[a-zA-Z0-9_]`` becoming ``_``; values are ``str()`` of the values (booleans as
        true/false, None as empty, enums by value). `server.suspended_keys` is left out:
        tenants' names are not for an endpoint that is open by default.
        """
        live = {k: v for k, v in live.items() if k != "server.suspended_keys"}
        short = [str(k).rsplit(".", 1)[-1] for k in live]
        names = [
            _label_name(s if short.count(s) == 1 else k) for s, k in zip(short, live, strict=True)
        ]
        items = sorted(zip(names, map(_label_value, live.values()), strict=True))
        self._config_labels = (tuple(k for k, _ in items), tuple(v for _, v in items))

    def config_changed(self, source: str, n: int = 1) -> None:
        """Count ``n`` configuration changes from ``source`` (default|file|env|api|tui)."""
        self._config_changes.labels(self.model_name, source).inc(n)

    # -- requests' ignored fields ---------------------------------------------------------
    def ignored_request_fields(self, names: Iterable[str]) -> list[str]:
        """Count one request's ignored fields; return the labels seen for the first time.

        The label is the field name, except that names longer than MAX_IGNORED_FIELD_CHARS,
        and new names once MAX_IGNORED_FIELD_LABELS distinct ones are in use, are counted as
        OTHER_FIELD: a client sending random field names cannot grow the exposition. One
        increment per label, however many fields a hostile body holds.
        """
        counts: dict[str, int] = {}
        new: list[str] = []
        with self._lock:
            known = self._ignored_names
            for name in names:
                if name in known:
                    label = name
                elif len(name) <= MAX_IGNORED_FIELD_CHARS and len(known) < MAX_IGNORED_FIELD_LABELS:
                    known.add(name)
                    label = name
                    new.append(name)
                else:
                    label = OTHER_FIELD
                    if not self._ignored_other:
                        self._ignored_other = True
                        new.append(OTHER_FIELD)
                counts[label] = counts.get(label, 0) + 1
        for label, n in counts.items():
            self._ignored_fields.labels(self.model_name, label).inc(n)
        return new

    # -- spend budgets -----------------------------------------------------------------------
    def budget_key_label(self, key: str | None) -> str:
        """The `api_key` label of every per-key counter (the budget counters',
        requests_throttled_total's): the key's name, or OTHER_KEY for names beyond the first
        MAX_BUDGET_KEY_LABELS distinct ones, all counters together (the exposition cannot grow
        without bound, and a key keeps one label across them)."""
        with self._lock:
            if key is not None and key in self._budget_keys:
                return key
            if key is not None and len(self._budget_keys) < MAX_BUDGET_KEY_LABELS:
                self._budget_keys.add(key)
                return key
        return OTHER_KEY

    def budget_event(self, key: str | None, event: str) -> None:
        """A key passed its soft threshold or reached its budget (BUDGET_EVENTS)."""
        self._budget_events.labels(self.model_name, self.budget_key_label(key), event).inc()

    def request_throttled(self, key: str | None, reason: str) -> None:
        """A request of `key` was refused before it ran, for `reason`
        (controlplane.tenants.usage.REASONS); the key label bounded as the budget counters'."""
        self._requests_throttled.labels(self.model_name, self.budget_key_label(key), reason).inc()

    def budget_request(self, key: str | None, action: str) -> None:
        """A request of a key at its budget was rejected or deprioritized (BUDGET_ACTIONS)."""
        self._budget_requests.labels(self.model_name, self.budget_key_label(key), action).inc()

    def bind_recorder(self, dropped: Callable[[], int], buffered: Callable[[], int]) -> None:
        """Read ``records_dropped_total`` / ``records_buffered`` from these at each scrape.

        Until bound both read 0; if a callback raises, its series is left out of that scrape.
        """
        self._recorder = (dropped, buffered)

    def bind_kernels(
        self, kernels: Callable[[], Mapping[str, Any]], compiled_step: Callable[[], str]
    ) -> None:
        """Read ``kernels_loaded`` (from /admin/stats' `kernels` dict) and ``compiled_step``
        from these at each scrape; until bound neither series is exposed."""
        self._kernels = (kernels, compiled_step)

    def bind_ranks(self, ranks: Callable[[], Mapping[str, Any] | None]) -> None:
        """Read the tensor_parallel_* gauges from this (/admin/stats' `tensor_parallel`) at
        each scrape; none are exposed until bound, nor while it answers None (one rank)."""
        self._ranks = ranks

    # -- exposition -----------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition (UTF-8) and its media type, without the charset (see
        MEDIA_TYPE)."""
        return generate_latest(self.registry), MEDIA_TYPE


# The compiled decode step's states (CompiledDecode.state, or off without one).
COMPILED_STEP_STATES = ("off", "cold", "warming", "ready", "failed")


class _KernelsCollector(Collector):
    """``kernels_loaded{reason}`` and ``compiled_step{state}``, read at scrape time."""

    def __init__(self, owner: Metrics) -> None:
        self._owner = owner

    def describe(self) -> list[Metric]:
        prefix = self._owner.prefix
        return [
            GaugeMetricFamily(prefix + "kernels_loaded", "", labels=[]),
            GaugeMetricFamily(prefix + "compiled_step", "", labels=[]),
        ]

    def collect(self) -> Iterator[Metric]:
        o = self._owner
        if o._kernels is None:
            return
        kernels_fn, compiled_fn = o._kernels
        try:
            kernels, compiled = kernels_fn(), compiled_fn()
        except Exception:
            log.warning("metrics: reading the kernels' state failed", exc_info=True)
            return
        loaded = GaugeMetricFamily(
            o.prefix + "kernels_loaded",
            "1 while our C++ CPU kernels serve (or are not needed: not on a CPU); 0 while "
            "torch's kernels serve instead, with why in `reason`.",
            labels=["model_name", "reason"],
        )
        ok = kernels.get("status") == "ok"
        loaded.add_metric([o.model_name, "" if ok else str(kernels.get("reason") or "")], float(ok))
        yield loaded
        state = GaugeMetricFamily(
            o.prefix + "compiled_step",
            "The compiled decode step: 1 for its current state (off, cold, warming while it "
            "compiles and steps run eagerly, ready, failed: eager for good), 0 for the others.",
            labels=["model_name", "state"],
        )
        for name in COMPILED_STEP_STATES:
            state.add_metric([o.model_name, name], 1.0 if name == compiled else 0.0)
        yield state


class _RanksCollector(Collector):
    """``tensor_parallel_size`` and each rank's memory, step time and all-reduce share, read
    at scrape time (the ranks write them to shared memory: parallel/workers.py RankBoard)."""

    def __init__(self, owner: Metrics) -> None:
        self._owner = owner

    def describe(self) -> list[Metric]:
        prefix = self._owner.prefix + "tensor_parallel_"
        names = ("size", "rank_memory_bytes", "rank_step_seconds", "rank_all_reduce_share")
        return [GaugeMetricFamily(prefix + name, "", labels=[]) for name in names]

    def collect(self) -> Iterator[Metric]:
        o = self._owner
        try:
            tp = o._ranks() if o._ranks is not None else None
        except Exception:
            log.warning("metrics: reading the tensor-parallel ranks failed", exc_info=True)
            return
        if not tp:
            return
        prefix = o.prefix + "tensor_parallel_"
        size = GaugeMetricFamily(
            prefix + "size", "Ranks the model is split over.", labels=["model_name"]
        )
        size.add_metric([o.model_name], float(tp["size"]))
        yield size
        labels = ["model_name", "rank"]
        memory = GaugeMetricFamily(
            prefix + "rank_memory_bytes",
            "A rank's weights and KV cache, in bytes.",
            labels=[*labels, "kind"],
        )
        step = GaugeMetricFamily(
            prefix + "rank_step_seconds",
            "A rank's forward pass, averaged over its recent steps (host wall time).",
            labels=labels,
        )
        share = GaugeMetricFamily(
            prefix + "rank_all_reduce_share",
            "The share of a rank's recent steps spent in the collectives (all-reduces and "
            "the logits' gather).",
            labels=labels,
        )
        for r in tp["ranks"]:
            rank = str(r["rank"])
            memory.add_metric([o.model_name, rank, "weights"], float(r["weights_bytes"]))
            memory.add_metric([o.model_name, rank, "kv_cache"], float(r["kv_cache_bytes"]))
            step.add_metric([o.model_name, rank], r["step_ms"] / 1000)
            share.add_metric([o.model_name, rank], float(r["all_reduce_share"]))
        yield from (memory, step, share)
