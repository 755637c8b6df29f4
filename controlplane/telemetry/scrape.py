"""The metrics built at each scrape from current state, not kept in between: the engine's
cumulative counters and gauges from its latest StepStats (nothing between scrapes is lost),
config_info, and the SQL recorder's dropped and buffered records."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from controlplane.engine.types import StepStats

log = logging.getLogger("controlplane.telemetry.metrics")  # the same log lines as before

PREFIX = "controlplane:"  # vLLM's names, with this prefix for `vllm:` (server.metrics_prefix)

# Cumulative StepStats counters and gauges exposed as they are: (name, StepStats field, help).
ENGINE_COUNTERS = (
    (
        "prefix_cache_queries",
        "prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    (
        "prefix_cache_hits",
        "prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    (
        "prefix_cache_evictions",
        "prefix_cache_evictions_total",
        "Cached KV blocks evicted to make room for new ones.",
    ),
    (
        "async_steps",
        "async_steps_total",
        "Steps launched before the previous step's tokens were known (async scheduling).",
    ),
    ("spec_decode_num_drafts", "spec_decode_num_drafts_total", "Number of spec decoding drafts."),
    (
        "spec_decode_num_draft_tokens",
        "spec_decode_num_draft_tokens_total",
        "Number of draft tokens.",
    ),
    (
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_total",
        "Number of accepted tokens.",
    ),
    (
        "grammar_cache_hits",
        "grammar_cache_hits_total",
        "Structured outputs: requests whose grammar was found compiled in the cache.",
    ),
    (
        "grammar_compiles",
        "grammar_compiles_total",
        "Structured outputs: grammars compiled (cache misses).",
    ),
    (
        "grammar_mask_seconds",
        "grammar_mask_s_total",
        "Structured outputs: seconds spent computing and applying token masks.",
    ),
    (
        "grammar_mask_wait_seconds",
        "grammar_mask_wait_s_total",
        "Structured outputs: seconds steps waited for their masks after the forward pass.",
    ),
)
ENGINE_GAUGES = (
    (
        "kv_cache_cached_blocks",
        "kv_blocks_cached",
        "KV blocks holding a cached prefix (in use or evictable).",
    ),
    (
        "kv_cache_evictable_blocks",
        "kv_blocks_evictable",
        "Cached KV blocks no request holds: reused after the free ones.",
    ),
    (
        "grammar_states",
        "grammar_states",
        "Structured outputs: live grammar states (one per constrained sequence).",
    ),
)
SPECULATION_STATES = ("off", "active", "paused")


class ScrapeTimeCollector:
    """config_info and the recorder's numbers, built at each scrape from current state."""

    def __init__(self, owner: Any) -> None:
        # A controlplane.telemetry.metrics.Metrics (its model name, config labels, recorder
        # readers and latest StepStats); untyped here so that the import runs one way.
        self._owner = owner

    def describe(self) -> list[Metric]:
        prefix = self._owner.prefix
        return [
            GaugeMetricFamily(prefix + "config_info", "", labels=[]),
            CounterMetricFamily(prefix + "records_dropped", "", labels=[]),
            GaugeMetricFamily(prefix + "records_buffered", "", labels=[]),
            *(CounterMetricFamily(prefix + name, "", labels=[]) for name, _, _ in ENGINE_COUNTERS),
            *(GaugeMetricFamily(prefix + name, "", labels=[]) for name, _, _ in ENGINE_GAUGES),
            CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos", "", labels=[]),
            GaugeMetricFamily(prefix + "spec_decode_state", "", labels=[]),
        ]

    def collect(self) -> Iterator[Metric]:
        o = self._owner
        prefix = o.prefix
        names, values = o._config_labels  # one tuple, swapped atomically by set_config
        info = GaugeMetricFamily(
            prefix + "config_info",
            "Live engine and server configuration, as labels; the value is always 1.",
            labels=["model_name", *names],
        )
        if names:
            info.add_metric([o.model_name, *values], 1.0)
        yield info

        dropped_fn, buffered_fn = o._recorder
        dropped = CounterMetricFamily(
            prefix + "records_dropped",
            "Request records the SQL recorder dropped (buffer full or write failed).",
            labels=["model_name"],
        )
        buffered = GaugeMetricFamily(
            prefix + "records_buffered",
            "Request records waiting in the SQL recorder's buffer.",
            labels=["model_name"],
        )
        for family, fn in ((dropped, dropped_fn), (buffered, buffered_fn)):
            try:
                value = 0 if fn is None else fn()
            except Exception:
                log.warning("metrics: reading %s failed", family.name, exc_info=True)
                continue  # leave the series out of this scrape rather than fail the scrape
            family.add_metric([o.model_name], float(value))
        yield dropped
        yield buffered
        yield from self._engine(o._latest)

    def _engine(self, st: StepStats | None) -> Iterator[Metric]:
        """The engine's cumulative counters and gauges, exactly as of its latest step (they
        are cumulative in StepStats, so nothing between scrapes is lost)."""
        m, prefix = self._owner.model_name, self._owner.prefix
        for name, attr, doc in ENGINE_COUNTERS:
            family = CounterMetricFamily(prefix + name, doc, labels=["model_name"])
            family.add_metric([m], float(getattr(st, attr)) if st else 0.0)
            yield family
        for name, attr, doc in ENGINE_GAUGES:
            family = GaugeMetricFamily(prefix + name, doc, labels=["model_name"])
            family.add_metric([m], float(getattr(st, attr)) if st else 0.0)
            yield family
        per_pos = CounterMetricFamily(
            prefix + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens, by their position in the draft (0 = first).",
            labels=["model_name", "position"],
        )
        for pos, n in enumerate(st.spec_decode_accepted_per_pos if st else ()):
            per_pos.add_metric([m, str(pos)], float(n))
        yield per_pos
        state = GaugeMetricFamily(
            prefix + "spec_decode_state",
            "Speculative decoding: 1 for the current state (off, active, or paused because more "
            "sequences run than speculative_max_batch_size), 0 for the others.",
            labels=["model_name", "state"],
        )
        current = st.speculation if st else "off"
        for name in SPECULATION_STATES:
            state.add_metric([m, name], 1.0 if name == current else 0.0)
        yield state
