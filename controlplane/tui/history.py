"""Pure helpers: a 15-minute history of stats snapshots, text trend lines and value formatting
(no Textual)."""

from __future__ import annotations

from collections import deque
from datetime import UTC, datetime
from typing import Any

# Trend lines cover 15 minutes: long enough to see an incident start, and whether a fix
# (confirmed in the 10 s latency figures) holds.
WINDOW_S = 900.0
BARS = "▁▂▃▄▅▆▇█"


class StatsHistory:
    """Stats snapshots of the last `window_s` seconds (by the daemon's own `time` field)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.points: deque[dict[str, Any]] = deque()

    def add(self, stats: dict[str, Any]) -> None:
        t = _num(stats.get("time"))
        if t is None:
            return
        if self.points and t < _num(self.points[-1].get("time")):  # daemon restarted / clock
            self.points.clear()
        self.points.append(stats)
        while self.points and t - self.points[0]["time"] > self.window_s:
            self.points.popleft()

    def clear(self) -> None:
        self.points.clear()

    def series(self, key: str) -> list[float]:
        return [float(p.get(key) or 0.0) for p in self.points]

    def trend(self, key: str, width: int) -> str:
        """`key` over the window as a text sparkline of at most `width` cells."""
        return spark([_num(p.get(key)) for p in self.points], width)

    def rate(self, key: str, over_s: float) -> float | None:
        """Per-second increase of a cumulative counter over the last `over_s` seconds."""
        if len(self.points) < 2:
            return None
        last = self.points[-1]
        first = next((p for p in self.points if last["time"] - p["time"] <= over_s), last)
        dt = last["time"] - first["time"]
        a, b = _num(first.get(key)), _num(last.get(key))
        if dt <= 0 or a is None or b is None or b < a:
            return None
        return (b - a) / dt


def spark(values: list[float | None], width: int, top: float | None = None) -> str:
    """Values (oldest first) as a line of block characters, at most `width` cells: each cell
    the max of its share of the values (a spike never averages away), scaled from 0 to the
    largest value (or `top`); unknown values draw as a space."""
    if width <= 0 or not values:
        return ""
    n = len(values)
    cells: list[float | None] = []
    for i in range(min(width, n)):
        chunk = [
            v
            for v in values[i * n // min(width, n) : (i + 1) * n // min(width, n)]
            if v is not None
        ]
        cells.append(max(chunk) if chunk else None)
    peak = top if top is not None else max((c for c in cells if c is not None), default=0.0)
    out = []
    for c in cells:
        if c is None:
            out.append(" ")
        elif peak <= 0:
            out.append(BARS[0])
        else:
            out.append(BARS[max(0, min(7, round(c / peak * 7)))])
    return "".join(out)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def fmt_num(v: Any, digits: int = 1) -> str:
    n = _num(v)
    if n is None:
        return "–"
    if abs(n) >= 10_000:
        return f"{n / 1000:.1f}k"
    return f"{n:.{digits}f}" if digits else f"{n:.0f}"


def fmt_ms(v: Any) -> str:
    """Milliseconds as ms below 10 s, seconds above (units never wrap in a cramped panel)."""
    n = _num(v)
    if n is None:
        return "–"
    return f"{n:.0f} ms" if n < 10_000 else f"{n / 1000:.1f} s"


def fmt_age(v: Any) -> str:
    """An age in seconds, short: 0.4 s, 38 s, 12 min, 3.5 h (the oldest waiting request)."""
    n = _num(v)
    if n is None:
        return "–" if v is None else str(v)
    if n < 10:
        return f"{n:.1f} s"
    if n < 600:
        return f"{n:.0f} s"
    return f"{n / 60:.0f} min" if n < 3600 * 3 else f"{n / 3600:.1f} h"


def fmt_usd(v: Any) -> str:
    n = _num(v)
    return "–" if n is None else f"${n:.4f}" if n < 1 else f"${n:,.2f}"


def fmt_pct(v: Any, scale: float = 100.0) -> str:
    n = _num(v)
    return "–" if n is None else f"{n * scale:.0f}%"


def fmt_bytes(v: Any) -> str:
    n = _num(v)
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_duration(seconds: Any) -> str:
    n = _num(seconds)
    if n is None:
        return "–"
    s = int(n)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s"


def fmt_value(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(fmt_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{…}"
    return "–" if v is None else str(v)


def fmt_time(value: Any) -> str:
    """ISO time or epoch seconds to HH:MM:SS UTC."""
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, UTC).strftime("%H:%M:%S")
    if isinstance(value, str):
        try:
            t = datetime.fromisoformat(value)
            return (t.astimezone(UTC) if t.tzinfo else t).strftime("%H:%M:%S")
        except ValueError:
            return value[:8]
    return "–"
