"""The effective configuration of a running daemon, and the one path every change takes.

A change from the admin API, the TUI or the config file is flattened to dotted fields
(`engine.max_num_seqs`), checked against the live/restart-only split, validated by the same
code that validates the config file and `Engine.update_settings`, and applied all or nothing:
`plan` validates, the caller writes the audit rows (the daemon: `Daemon.change_config`), and
only then `commit` applies and tells the listeners (engine, jobs, SSE events, metrics). A change
whose audit row cannot be written is never applied.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controlplane.config import (
    AlertsSettings,
    AutopilotSettings,
    Config,
    Price,
    build_config,
    env_overrides,
    field_limits,
)
from controlplane.engine.settings import EngineSettings
from controlplane.errors import FieldError
from controlplane.store.models import CONFIG_SOURCES

log = logging.getLogger("controlplane.config")

SOURCES = CONFIG_SOURCES
# [limits] keys read at each request or refresh (the backend and its Redis need a restart).
LIMITS_LIVE = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "max_tokens_per_request",
    "redis_failure",
    "budget_soft_threshold",
    "budget_refresh_s",
)
# Fields an operator may change on a running daemon. Everything else needs a restart.
LIVE_FIELDS = frozenset(
    {f"engine.{name}" for name in EngineSettings.live_fields()}
    | {"server.max_queue_len", "server.max_n", "server.max_choices_share"}
    | {"server.drain_timeout_s", "prices"}
    | {"server.max_grammar_bytes", "server.grammar_compile_timeout_s"}
    | {"server.suspended_keys"}
    | {
        "jobs.utilization_interval_s",
        "jobs.rollup_interval_s",
        "jobs.gpu_hourly_usd",
        "jobs.peak_flops",
    }
    | {f"autopilot.{f.name}" for f in dataclasses.fields(AutopilotSettings)}
    | {f"alerts.{f.name}" for f in dataclasses.fields(AlertsSettings)}
    | {f"limits.{name}" for name in LIMITS_LIVE}
)


class ConfigChangeError(FieldError):
    """`status` is the HTTP status the admin API answers with: 422 invalid, 409 restart needed,
    503 the change could not be audited (nothing was applied)."""

    def __init__(self, field: str, message: str, status: int = 422) -> None:
        super().__init__(field, message)
        self.status = status


class ConfigAuditError(ConfigChangeError):
    """The audit row could not be written, so the change was not applied."""

    def __init__(self, message: str) -> None:
        super().__init__("audit", message, 503)


@dataclass(frozen=True, slots=True)
class FieldChange:
    field: str
    old: Any
    new: Any
    reason: str | None = None  # why, where the source says (the autopilot)


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated change, not applied yet: `commit` applies it if `base` is still in force."""

    base: Config
    new: Config
    changes: tuple[FieldChange, ...]


# audit(new_config, changes, source, actor): records the change durably or raises; it runs
# before the change is applied, so a change is never in force without its audit row.
Audit = Callable[[Config, list[FieldChange], str, str | None], None]


def _plain(value: Any) -> Any:
    """JSON-friendly form of a config value."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Price):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def flatten(cfg: Config) -> dict[str, Any]:
    """Dotted field -> JSON-friendly value, for every field of the config."""
    out: dict[str, Any] = {"data_dir": cfg.data_dir}
    for section in ("server", "store", "jobs", "fleet", "autopilot", "alerts", "limits", "engine"):
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            out[f"{section}.{f.name}"] = _plain(getattr(obj, f.name))
    out["prices"] = _plain(cfg.prices)
    # Keys are secrets: expose names only.
    out["api_keys"] = [k.name for k in cfg.api_keys]
    out["admin_tokens"] = [t.name for t in cfg.admin_tokens]
    return out


def flatten_raw(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys of a parsed TOML / JSON body (tables become sections, arrays stay whole)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            for sub, v in value.items():
                out[f"{key}.{sub}"] = v
        else:
            out[key] = value
    return out


def flatten_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """flatten_raw for a JSON body (PATCH /admin/config): a field given twice, dotted and
    nested (`{"engine.max_num_seqs": 8, "engine": {"max_num_seqs": 9}}`), is refused (422)
    rather than one value silently winning."""
    out: dict[str, Any] = {}
    for key, value in body.items():
        pairs = (
            [(f"{key}.{sub}", v) for sub, v in value.items()]
            if isinstance(value, Mapping)
            else [(key, value)]
        )
        for name, v in pairs:
            if name in out:
                raise ConfigChangeError(name, "given twice in the body (dotted and nested)")
            out[name] = v
    return out


# What a JSON body must send for each kind of field (GET /admin/config's "type").
_JSON_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
PRICE_FIELDS = tuple(f.name for f in dataclasses.fields(Price))


@functools.cache
def _defaults() -> dict[str, Any]:
    return flatten(Config())


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_kind_ok(kind: str, value: Any) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):  # a JSON true is no number
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, int | float)
    return isinstance(value, str)


def _check_prices(value: Any) -> None:
    if not isinstance(value, list):
        raise ConfigChangeError("prices", f"must be an array of price objects, got {_shown(value)}")
    for i, entry in enumerate(value):
        where = f"prices[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigChangeError(where, f"must be an object, got {_shown(entry)}")
        for name in PRICE_FIELDS:  # no defaults: a missing price would silently be $0
            if name not in entry:
                raise ConfigChangeError(
                    f"{where}.{name}",
                    f"is required (every price entry gives all of {', '.join(PRICE_FIELDS)})",
                )
            kind = "str" if name in ("model", "effective_from") else "float"
            if not _json_kind_ok(kind, entry[name]):
                raise ConfigChangeError(
                    f"{where}.{name}", f"must be {_JSON_KINDS[kind]}, got {_shown(entry[name])}"
                )


def check_json_types(changes: Mapping[str, Any]) -> None:
    """The values of a JSON body (PATCH /admin/config, /admin/autopilot; dotted fields) have
    the field's own type: `"8"` is no integer and `1` no boolean (only the environment, where
    every value is text, has its values parsed), and every field of a price entry is given.
    ConfigChangeError (422) naming the field; unknown fields are left to `plan`."""
    limits, defaults = field_limits(), _defaults()
    for key, value in changes.items():
        if key == "prices":
            _check_prices(value)
            continue
        default = defaults.get(key)
        if isinstance(default, list) and key not in ("api_keys", "admin_tokens"):
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ConfigChangeError(key, f"must be an array of strings, got {_shown(value)}")
            continue
        kind = "str" if key == "data_dir" else limits.get(key, {}).get("type")
        if kind is None or (value is None and default is None):  # null: unset
            continue
        if not _json_kind_ok(kind, value):
            raise ConfigChangeError(key, f"must be {_JSON_KINDS[kind]}, got {_shown(value)}")


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if "." in key:
            section, sub = key.split(".", 1)
            out.setdefault(section, {})[sub] = value
        else:
            out[key] = value
    return out


class LiveConfig:
    def __init__(self, cfg: Config, file_raw: Mapping[str, Any], env: Mapping[str, str]) -> None:
        self.effective = cfg
        self._file_raw = dict(file_raw)
        self._env = dict(env)
        # Names of the api_keys table's keys (the runtime's KeyCache): server.suspended_keys
        # may name them as well as the config file's keys.
        self.table_key_names: Callable[[], Iterable[str]] = lambda: ()
        self.sources: dict[str, str] = {}
        for key in flatten_raw(file_raw):
            self.sources[key] = "file"
        for key in flatten_raw(env_overrides(env)):
            self.sources[key] = "env"
        self._listeners: list[Callable[[Config, list[FieldChange], str, str | None], None]] = []

    def subscribe(
        self, listener: Callable[[Config, list[FieldChange], str, str | None], None]
    ) -> None:
        """listener(new_config, changes, source, actor), called after every applied change."""
        self._listeners.append(listener)

    def describe(self) -> dict[str, dict[str, Any]]:
        return {
            key: {
                "value": value,
                "source": self.sources.get(key, "default"),
                "live": key in LIVE_FIELDS,
            }
            for key, value in flatten(self.effective).items()
        }

    def live_values(self) -> dict[str, Any]:
        flat = flatten(self.effective)
        return {key: flat[key] for key in sorted(LIVE_FIELDS) if key != "prices"}

    # -- the one path -----------------------------------------------------------------------
    def _candidate(self, changes: Mapping[str, Any]) -> Config:
        """The whole config with `changes` applied, validated like a config file (all or nothing)."""
        known = flatten(self.effective)
        # None means "unset" (e.g. engine.num_kv_blocks); secrets are not in `flatten` and are
        # carried over from the effective config below.
        raw = nest(
            {
                k: v
                for k, v in known.items()
                if k not in ("api_keys", "admin_tokens") and v is not None
            }
        )
        # The keys themselves, so that server.suspended_keys is checked against them.
        raw["api_keys"] = [dataclasses.asdict(k) for k in self.effective.api_keys]
        configured = {k.name for k in self.effective.api_keys}
        raw["api_keys"] += [  # placeholders, checked against only (dropped below)
            {"name": n, "key": "table"}
            for n in sorted(self.table_key_names())
            if n not in configured
        ]
        restart = []
        for key, value in changes.items():
            if key not in known:
                raise ConfigChangeError(key, "unknown field; GET /admin/config lists them")
            if key not in LIVE_FIELDS:
                if value == known[key]:
                    continue
                # Validated like the rest first: an invalid value is 422, a valid one 409.
                restart.append(key)
            section, _, name = key.rpartition(".")
            table = raw.setdefault(section, {}) if section else raw
            if value is None and _defaults().get(key) is None:
                table.pop(name, None)  # null: unset (engine.num_kv_blocks), as `known` has it
            else:
                table[name] = value
        try:
            new = build_config(raw, env={})
        except FieldError as exc:
            raise ConfigChangeError(exc.field, exc.message) from None
        if restart:
            raise ConfigChangeError(
                restart[0], "cannot change on a running daemon; restart needed", 409
            )
        return dataclasses.replace(
            new, api_keys=self.effective.api_keys, admin_tokens=self.effective.admin_tokens
        )

    def plan(self, changes: Mapping[str, Any], source: str) -> Plan:
        """Validate `changes` against the effective config; raises ConfigChangeError naming the
        field. Applies nothing."""
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}")
        base = self.effective
        new = self._candidate(changes)
        before, after = flatten(base), flatten(new)
        diff = tuple(
            FieldChange(k, before[k], after[k]) for k in sorted(changes) if before[k] != after[k]
        )
        return Plan(base, new, diff)

    def commit(self, plan: Plan, source: str, actor: str | None = None) -> list[FieldChange]:
        """Apply a planned (and audited) change and tell the listeners."""
        if not plan.changes:
            return []
        if plan.base is not self.effective:
            # Another change was applied in between: its fields would be silently reverted.
            raise ConfigChangeError("config", "changed concurrently; send the change again", 409)
        diff = list(plan.changes)
        self.effective = plan.new
        for change in diff:
            self.sources[change.field] = source
        for listener in self._listeners:
            listener(plan.new, diff, source, actor)
        log.info(
            "config change from %s%s: %s",
            source,
            f" ({actor})" if actor else "",
            ", ".join(f"{c.field} {c.old!r} -> {c.new!r}" for c in diff),
        )
        return diff

    def apply(
        self,
        changes: Mapping[str, Any],
        source: str,
        actor: str | None = None,
        audit: Audit | None = None,
    ) -> list[FieldChange]:
        """Validate, audit, apply: raises ConfigChangeError (naming the field) and changes
        nothing if the change is invalid or `audit` raises. The daemon audits in a worker
        thread instead (`Daemon.change_config`), through the same plan and commit."""
        plan = self.plan(changes, source)
        if plan.changes and audit is not None:
            audit(plan.new, list(plan.changes), source, actor)
        return self.commit(plan, source, actor)

    def file_changes(self, raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """What a reload of the file would change: (live changes to apply, restart-only keys
        that differ). Only keys whose value in the file changed count, so a reload never
        reverts a change made through the API to a key the file did not touch. Raises
        ConfigChangeError if the new file is invalid (a broken file changes nothing)."""
        old, new = flatten_raw(self._file_raw), flatten_raw(raw)
        try:
            build_config(raw, env=self._env)
        except FieldError as exc:
            raise ConfigChangeError(exc.field, exc.message) from None
        touched = {k: new.get(k) for k in set(old) | set(new) if old.get(k) != new.get(k)}
        defaults = flatten(Config())
        restart = sorted(k for k in touched if k not in LIVE_FIELDS)
        live = {}
        for key in touched:
            if key in LIVE_FIELDS:
                # A key removed from the file falls back to its default.
                live[key] = touched[key] if key in new else defaults[key]
        return live, restart

    def file_keys(self) -> set[str]:
        """The dotted keys the last applied config file set."""
        return set(flatten_raw(self._file_raw))

    def file_differs(self, raw: Mapping[str, Any]) -> list[str]:
        """The dotted keys whose value in `raw` (the file as read now) is not the one in the
        file last applied: an edit a reload has not applied (yet)."""
        old, new = flatten_raw(self._file_raw), flatten_raw(raw)
        return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))

    def file_read(self, raw: Mapping[str, Any]) -> None:
        """Remember `raw` as the file's content once its changes are applied."""
        self._file_raw = dict(raw)
        for key in flatten_raw(raw):
            if key not in LIVE_FIELDS:
                self.sources.setdefault(key, "file")

    def file_saved(self, raw: Mapping[str, Any], fields: list[str]) -> None:
        """`fields` were written to the file (POST /admin/config/save) as `raw` (the file
        read back) has them: the file now gives them, and a reload sees no change in them.
        Only these keys: other edits of the file not applied yet still are, at the next reload."""
        saved = flatten_raw(raw)
        current = flatten_raw(self._file_raw)
        for key in fields:
            if key in saved:
                current[key] = saved[key]
            else:
                current.pop(key, None)
            self.sources[key] = "file"
        self._file_raw = nest(current)
