"""Small parsers and statistics shared by the config, the store, the admin API, the report CLI
and the load generator: one definition of each, so a "7d" or a p99 means the same everywhere.

Torch-free and cheap to import (stdlib only, plus the engine's error type, itself torch-free):
`controlplane.client.loadgen` and the CLI import it.
"""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from controlplane.errors import FieldError

__all__ = ["parse_group_by", "parse_report_time", "parse_time", "percentile"]


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between closest ranks:
    sorted values x[0..n-1], rank r = q/100 * (n-1), result x[floor r] + (r - floor r) *
    (x[ceil r] - x[floor r]). Same as numpy's default (method="linear"). None for no values
    (a window with no requests has no p99); a q outside [0, 100] is a ValueError."""
    if not 0 <= q <= 100:
        raise FieldError("q", f"must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return None
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (rank - lo) * (xs[hi] - xs[lo])


_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([mhdw])\s*$", re.IGNORECASE)
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_time(
    name: str, value: Any, *, relative: bool = True, now: datetime | None = None
) -> datetime:
    """A point in time, always timezone-aware UTC; FieldError(name, ...) otherwise.

    Accepts a datetime, a TOML date, an ISO date ("2026-03-01", midnight UTC) or date-time
    (UTC unless it has an offset; "Z" allowed) and, when `relative` (report bounds, not config
    values), a duration before `now`: "24h" / "7d" / "30m" / "2w"."""
    if isinstance(value, datetime):
        at = value
    elif isinstance(value, str):
        m = _RELATIVE.match(value) if relative else None
        if m:
            now = datetime.now(UTC) if now is None else now.astimezone(UTC)
            try:
                return now - timedelta(**{_UNITS[m.group(2).lower()]: float(m.group(1))})
            except OverflowError:  # "99999999d": before year 1
                raise FieldError(name, f"{value!r} is out of range") from None
        try:
            at = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            expected = (
                "expected a duration like 24h / 7d / 30m / 2w, or an ISO date or time"
                if relative
                else "must be an ISO 8601 date or time"
            )
            raise FieldError(name, f"{expected}, got {value!r}") from None
    elif hasattr(value, "year"):  # a TOML date
        at = datetime(value.year, value.month, value.day)
    else:
        raise FieldError(name, f"must be a date or time, got {value!r}")
    try:
        return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
    except OverflowError:  # year 1 with a positive offset, 9999 with a negative one
        raise FieldError(
            name, f"{value!r} is out of range (not a time in UTC years 1 to 9999)"
        ) from None


# The window a report may ask for (API and CLI): the hour arithmetic around the bounds stays
# within the years a datetime holds.
MIN_REPORT_TIME = datetime(1970, 1, 1, tzinfo=UTC)
MAX_REPORT_TIME = datetime(9999, 1, 1, tzinfo=UTC)


def parse_report_time(name: str, value: Any, *, now: datetime | None = None) -> datetime:
    """parse_time for a report bound, which must lie in [MIN_REPORT_TIME, MAX_REPORT_TIME]."""
    at = parse_time(name, value, now=now)
    if not MIN_REPORT_TIME <= at <= MAX_REPORT_TIME:
        raise FieldError(
            name,
            f"{value!r} is out of range ({MIN_REPORT_TIME.date()} to {MAX_REPORT_TIME.date()})",
        )
    return at


def parse_group_by(value: str | Sequence[str], allowed: Sequence[str]) -> list[str]:
    """Validated group columns in canonical (`allowed`) order; a string is comma-separated."""
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [n.strip() for n in names if n.strip()]
    for n in names:
        if n not in allowed:
            raise FieldError("group_by", f"unknown column {n!r}; use any of {', '.join(allowed)}")
    if "day" in names and "hour" in names:
        raise FieldError("group_by", "day and hour exclude each other")
    return [n for n in allowed if n in names]


# printable ASCII, no spaces: what may go on the wire as a URL or header value
_PRINTABLE_URL_RE = re.compile(r"[\x21-\x7e]{1,255}")


def check_url(url: str, what: str = "advertise_url") -> str:
    """`url` if it is where a fleet member (or any daemon) can be asked: http(s), a host, no
    user info, no query, no fragment, nothing but printable ASCII; FieldError(`what`) otherwise."""
    if not isinstance(url, str) or not url or not _PRINTABLE_URL_RE.fullmatch(url):
        raise FieldError(what, f"must be a printable http:// or https:// URL, got {url!r}")
    if "?" in url or "#" in url:
        raise FieldError(what, f"must have no query or fragment, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a malformed port)
    except ValueError as exc:
        raise FieldError(what, f"{exc}, got {url!r}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise FieldError(what, f"must be an http:// or https:// URL, got {url!r}")
    if parts.username is not None or parts.password is not None:
        raise FieldError(what, f"must carry no user or password, got {url!r}")
    return url


def cpu_name() -> str:
    """The CPU's model name, family and model numbers and core count (from /proc/cpuinfo where
    there is one): "AMD EPYC" alone names both a Zen 3 and a Zen 5 part."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    return (
        f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model "
        f"{info.get('model', '?')}), {os.cpu_count()} CPUs"
    )
