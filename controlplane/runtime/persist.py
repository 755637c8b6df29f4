"""Live values across restarts: what a restart dropped, and writing live values to the file.

A live change (admin API, TUI, fleet, autopilot) lives in memory and in the audit log only:
the config file still says what it said. At start the daemon compares, field by field, the
value last in force in its previous run (the newest audit row of this instance id, unless the
file itself set it, among the rows since the last restart row or save: `check_restart`) with
what the config now gives, and names every live value the restart dropped (`dropped_values`). `POST /admin/config/save`
(`controlplane config save`) writes the live values into the config file with tomlkit,
keeping the operator's comments and layout (`plan_save`, `write_file`); after that a restart
drops nothing.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from controlplane.config import Config, build_config
from controlplane.errors import FieldError
from controlplane.runtime.live_config import LIVE_FIELDS, flatten

# Sources whose value is not a live value: the file (read at start or reloaded), the
# environment, the defaults, and the restart check's own row.
NOT_LIVE_SOURCES = frozenset({"file", "env", "default", "restart"})
SAVE_HINT = "`controlplane config save` writes live values to the file"


class SaveError(Exception):
    """The live values cannot be written to the config file (the admin API answers 409)."""


# -- restart --------------------------------------------------------------------------------
def dropped_values(
    latest: Mapping[str, Mapping[str, Any]], effective: Config
) -> list[dict[str, Any]]:
    """`latest`: per field, the newest audit row of the previous run (store.audit.latest_values).
    Each live field whose last value was set live (not by the file) and differs from what the
    config gives now: `{"field", "live", "file"}`, by field name."""
    now = flatten(effective)
    out = []
    for field in sorted(latest):
        row = latest[field]
        if field not in LIVE_FIELDS or field not in now or row["source"] in NOT_LIVE_SOURCES:
            continue
        if row["new_value"] != now[field]:
            out.append({"field": field, "live": row["new_value"], "file": now[field]})
    return out


def _short(value: Any, limit: int = 60) -> str:
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        text = f"[{len(value)} entries]"  # prices
    else:
        text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_dropped(dropped: list[dict[str, Any]]) -> str:
    """`engine.max_num_seqs 32 (file: 96), server.max_queue_len 16 (file: 256)`."""
    return ", ".join(
        f"{d['field']} {_short(d['live'])} (file: {_short(d['file'])})" for d in dropped
    )


def previous_start(db: Any, instance_id: str) -> datetime | None:
    """When this instance's previous run registered (its fleet row; None: no row yet)."""
    from sqlalchemy import inspect, select

    from controlplane.store.models import InstanceRow

    table = InstanceRow.__table__
    if not inspect(db).has_table(table.name):
        return None
    with db.connect() as conn:
        return conn.execute(
            select(table.c.started_at).where(table.c.id == instance_id)
        ).scalar_one_or_none()


def last_accounted(db: Any, instance_id: str) -> datetime | None:
    """The newest audit row after which every earlier live value is accounted for: a restart
    that named what it dropped (field `restart`), or a save of the live values into the file
    (field `config_file`)."""
    from sqlalchemy import func, select

    from controlplane.store.audit import CONFIG_CHANGES

    c = CONFIG_CHANGES.c
    stmt = select(func.max(c.time)).where(
        c.instance_id == instance_id, c.field.in_(("restart", "config_file"))
    )
    with db.connect() as conn:
        return conn.execute(stmt).scalar_one_or_none()


def check_restart(db: Any, instance_id: str, effective: Config) -> list[dict[str, Any]]:
    """The live values this start dropped (see the module docstring); reads only. The rows
    compared are those since the later of the previous run's registration in the fleet table
    and the last row that accounted for the live values (`last_accounted`)."""
    from controlplane.store.audit import latest_values

    marks = [t for t in (previous_start(db, instance_id), last_accounted(db, instance_id)) if t]
    since = max(marks) if marks else None
    return dropped_values(latest_values(db, instance_id=instance_id, since=since), effective)


# -- save -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SavePlan:
    text: str  # the new file
    raw: dict[str, Any]  # the new file, parsed
    saved: list[tuple[str, Any]]  # (field, value) written


def _toml_value(field: str, value: Any) -> Any:
    import tomlkit

    if field == "prices":
        if not value:
            return tomlkit.array()
        aot = tomlkit.aot()
        for price in value:
            t = tomlkit.table()
            for k, v in price.items():
                t[k] = datetime.fromisoformat(v) if k == "effective_from" else v
            aot.append(t)
        return aot
    return list(value) if isinstance(value, tuple) else value


def plan_save(path: Path, text: str, effective: Config) -> SavePlan:
    """The config file at `path`, read as `text` (controlplane.runtime.config_file reads it:
    only a regular file, bounded, off the config lock), with every live field whose effective
    value differs from what the file gives set to the effective value (comments and layout
    kept); SaveError when the file is invalid or the result would be."""
    import tomlkit

    try:
        doc = tomlkit.parse(text)
        given = flatten(build_config(doc.unwrap(), env={}))
    except (tomlkit.exceptions.ParseError, FieldError) as exc:
        raise SaveError(f"config file {path} is invalid now, not overwritten: {exc}") from None
    live = flatten(effective)
    saved = [(f, live[f]) for f in sorted(LIVE_FIELDS) if live[f] != given[f]]
    for field, value in saved:
        if "." in field:
            section, key = field.split(".", 1)
            if section not in doc:
                doc[section] = tomlkit.table()
            table = doc[section]
            if value is None:
                table.pop(key, None)
            else:
                table[key] = _toml_value(field, value)
        elif value is None:
            doc.pop(field, None)
        else:
            doc[field] = _toml_value(field, value)
    new_text = tomlkit.dumps(doc)
    raw = tomllib.loads(new_text)
    try:  # what the file will give must be the live values, or nothing is written
        check = flatten(build_config(raw, env={}))
    except FieldError as exc:
        raise SaveError(f"the saved file would not be valid ({exc}); not written") from None
    wrong = [f for f, v in saved if check[f] != v]
    if wrong:
        raise SaveError(f"could not write {', '.join(wrong)} into {path}; not written")
    return SavePlan(new_text, raw, saved)


def write_file(path: Path, text: str) -> None:
    """Replace the file's content: atomically (a temporary file renamed over it) when this
    process owns the file and may write its directory, else in place (the file keeps its
    owner, mode and inode). Symlinks are followed (the target is written)."""
    real = Path(os.path.realpath(path))
    st = real.stat()
    if st.st_uid == os.geteuid() and os.access(real.parent, os.W_OK):
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", dir=real.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, st.st_mode & 0o7777)
            os.replace(tmp, real)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return
    with open(real, "r+", encoding="utf-8") as f:
        f.write(text)
        f.truncate()
        f.flush()
        os.fsync(f.fileno())
