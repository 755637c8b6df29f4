"""The configuration model: one TOML file, CONTROLPLANE_* environment overrides, typed and
validated in one place. Torch-free on purpose: the CLI parses config without the engine.

Environment overrides use `CONTROLPLANE_<SECTION>__<KEY>`, e.g. `CONTROLPLANE_SERVER__PORT=8001`
or `CONTROLPLANE_ENGINE__MAX_NUM_SEQS=16`; `CONTROLPLANE_DATA_DIR` sets `data_dir`.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.settings import EngineSettings, check

ENV_PREFIX = "CONTROLPLANE_"


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # Name served by /v1/models and expected in requests; default: the model directory's name.
    model_name: str = ""
    # Waiting requests beyond this get 429 with Retry-After (backpressure).
    max_queue_len: int = 256
    # On SIGTERM/SIGINT: how long running requests may finish before they are aborted.
    drain_timeout_s: float = 30.0
    log_format: str = "text"  # text | json
    log_level: str = "info"
    # Identifies this daemon's rows when several share one database; default: generated once
    # and kept in <data_dir>/instance_id.
    instance_id: str = ""
    # GET /metrics is open unless this is true (then it needs an admin token like /admin/*).
    metrics_require_token: bool = False
    # Period of the stats snapshots on GET /admin/events (a client may ask for another).
    events_interval_s: float = 0.5
    # How often the config file is checked for changes (it is also reloaded on SIGHUP).
    config_watch_interval_s: float = 1.0


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
class Price:
    """USD per million tokens, in force from `effective_from` (UTC) until a later price."""

    model: str = "*"  # a served model name, or * for any
    effective_from: datetime = datetime(1970, 1, 1, tzinfo=UTC)
    prompt_per_mtok: float = 0.0
    cached_prompt_per_mtok: float = 0.0
    completion_per_mtok: float = 0.0


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
    engine: EngineSettings = field(default_factory=EngineSettings)
    prices: tuple[Price, ...] = ()
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
            return kind(text)
        except ValueError:
            raise InvalidSettingError(where, f"must be a {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (kind is not None and not isinstance(value, kind)) or (
        kind is int and isinstance(value, bool)
    ):
        raise InvalidSettingError(where, f"must be a {kind.__name__}, got {value!r}")
    return value


def _build(cls: type, table: Mapping[str, Any], section: str) -> Any:
    if not isinstance(table, Mapping):
        raise InvalidSettingError(section, f"must be a table, got {table!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in fields:
            raise InvalidSettingError(
                f"{section}.{key}", f"unknown key; known keys: {', '.join(fields)}"
            )
        f = fields[key]
        default = f.default if f.default is not dataclasses.MISSING else None
        if key == "effective_from":
            values[key] = _parse_time(f"{section}.{key}", value)
        elif default is None and key in ("num_kv_blocks", "max_model_len"):
            values[key] = _coerce(f"{section}.{key}", value, 0)
        else:
            values[key] = _coerce(f"{section}.{key}", value, default)
    try:
        return cls(**values)
    except TypeError as exc:  # a required key is missing
        raise InvalidSettingError(section, str(exc)) from None


def _parse_time(where: str, value: Any) -> datetime:
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, str):
        try:
            dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise InvalidSettingError(
                where, f"must be an ISO 8601 date or time, got {value!r}"
            ) from None
    elif hasattr(value, "year"):  # a TOML date
        dt = datetime(value.year, value.month, value.day)
    else:
        raise InvalidSettingError(where, f"must be a date or time, got {value!r}")
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def _validate(cfg: Config) -> Config:
    s = cfg.server
    if not 0 <= s.port <= 65535:
        raise InvalidSettingError("server.port", f"must be in [0, 65535], got {s.port}")
    if s.max_queue_len < 0:
        raise InvalidSettingError("server.max_queue_len", f"must be >= 0, got {s.max_queue_len}")
    if s.drain_timeout_s < 0:
        raise InvalidSettingError(
            "server.drain_timeout_s", f"must be >= 0, got {s.drain_timeout_s}"
        )
    if s.events_interval_s < 0.05 or s.config_watch_interval_s < 0.05:
        raise InvalidSettingError("server.events_interval_s", "intervals must be >= 0.05 s")
    if s.log_format not in ("text", "json"):
        raise InvalidSettingError(
            "server.log_format", f"must be text or json, got {s.log_format!r}"
        )
    st = cfg.store
    if st.batch_size < 1:
        raise InvalidSettingError("store.batch_size", f"must be >= 1, got {st.batch_size}")
    if st.flush_interval_s <= 0 or st.retry_interval_s <= 0:
        raise InvalidSettingError("store.flush_interval_s", "intervals must be > 0")
    if st.buffer_max_records < 1:
        raise InvalidSettingError(
            "store.buffer_max_records", f"must be >= 1, got {st.buffer_max_records}"
        )
    for i, p in enumerate(cfg.prices):
        for name in ("prompt_per_mtok", "cached_prompt_per_mtok", "completion_per_mtok"):
            if getattr(p, name) < 0:
                raise InvalidSettingError(
                    f"prices[{i}].{name}", f"must be >= 0, got {getattr(p, name)}"
                )
    names = [k.name for k in cfg.api_keys]
    for i, k in enumerate(cfg.api_keys):
        if not k.name or not k.key:
            raise InvalidSettingError(f"api_keys[{i}]", "needs a non-empty name and key")
        if names.count(k.name) > 1:
            raise InvalidSettingError(f"api_keys[{i}].name", f"{k.name!r} is used twice")
        if k.name == "(idle)":
            raise InvalidSettingError(
                f"api_keys[{i}].name", "'(idle)' is reserved for idle GPU time in cost rollups"
            )
    tokens = [t.name for t in cfg.admin_tokens]
    for i, t in enumerate(cfg.admin_tokens):
        if not t.name or len(t.token) < 16:
            raise InvalidSettingError(
                f"admin_tokens[{i}]", "needs a name and a token of at least 16 characters"
            )
        if tokens.count(t.name) > 1:
            raise InvalidSettingError(f"admin_tokens[{i}].name", f"{t.name!r} is used twice")
    j = cfg.jobs
    for name in ("utilization_interval_s", "rollup_interval_s"):
        if not 0.5 <= getattr(j, name) <= 86400:
            raise InvalidSettingError(
                f"jobs.{name}", f"must be in [0.5, 86400] seconds, got {getattr(j, name)}"
            )
    for name in ("sample_retention_days", "request_retention_days", "gpu_hourly_usd", "peak_flops"):
        if getattr(j, name) < 0:
            raise InvalidSettingError(f"jobs.{name}", f"must be >= 0, got {getattr(j, name)}")
    if not 0 <= j.num_gpus <= 1024:
        raise InvalidSettingError("jobs.num_gpus", f"must be in [0, 1024], got {j.num_gpus}")
    check_engine(cfg.engine)
    return cfg


def check_engine(settings: EngineSettings) -> EngineSettings:
    try:
        return check(settings)
    except InvalidSettingError as exc:
        raise InvalidSettingError(f"engine.{exc.field}", str(exc).split(": ", 1)[1]) from None


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """CONTROLPLANE_SECTION__KEY=value -> {section: {key: value}} (values stay strings)."""
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in (
            "CONTROLPLANE_ADMIN_TOKEN",
            "CONTROLPLANE_TEST_POSTGRES",
        ):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        if rest == "data_dir":
            out["data_dir"] = value
        elif "__" in rest:
            section, key = rest.split("__", 1)
            out.setdefault(section, {})[key] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise InvalidSettingError("config", f"{p}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidSettingError("config", f"{p}: invalid TOML: {exc}") from None


def build_config(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Config:
    """Config from a parsed TOML mapping plus environment overrides; raises naming the key."""
    merged: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    for key, value in env_overrides(os.environ if env is None else env).items():
        if isinstance(value, dict):
            merged.setdefault(key, {}).update(value)
        else:
            merged[key] = value
    known = {f.name for f in dataclasses.fields(Config)}
    for key in merged:
        if key not in known:
            raise InvalidSettingError(
                key, f"unknown top-level key; known keys: {', '.join(sorted(known))}"
            )
    prices = merged.get("prices", [])
    keys = merged.get("api_keys", [])
    tokens = merged.get("admin_tokens", [])
    for name, value in (("prices", prices), ("api_keys", keys), ("admin_tokens", tokens)):
        if not isinstance(value, list | tuple):
            raise InvalidSettingError(name, f"must be an array of tables ([[{name}]])")
    cfg = Config(
        data_dir=str(merged.get("data_dir", "data")),
        server=_build(ServerSettings, merged.get("server", {}), "server"),
        store=_build(StoreSettings, merged.get("store", {}), "store"),
        jobs=_build(JobsSettings, merged.get("jobs", {}), "jobs"),
        engine=_build(EngineSettings, merged.get("engine", {}), "engine"),
        prices=tuple(_build(Price, p, f"prices[{i}]") for i, p in enumerate(prices)),
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
