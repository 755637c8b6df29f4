"""`controlplane replay --report out.html`: the side-by-side table and latency-over-time plots
(TTFT and mean ITL of each request against its arrival, one colour a column) in one HTML file
with inline SVG: no script, no dependency, opens anywhere, attaches to a ticket."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.planning.replay import ReplayRun
from controlplane.planning.summary import Figures, table
from controlplane.planning.window import Window

_COLOURS = ("#444444", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
_W, _H, _PAD = 720, 240, 48  # plot size and margin, pixels


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    points: list[tuple[float, float]]  # (seconds after the window's first arrival, ms)


def recorded_series(window: Window) -> tuple[Series, Series]:
    """(TTFT, mean ITL) of each recorded request against its arrival."""
    t0 = window.rows[0].arrival
    ttft = [(r.arrival - t0, r.ttft_s * 1000) for r in window.rows if r.ttft_s is not None]
    itl = [(r.arrival - t0, r.mean_itl_s * 1000) for r in window.rows if r.mean_itl_s is not None]
    return Series("recorded", ttft), Series("recorded", itl)


def run_series(run: ReplayRun) -> tuple[Series, Series]:
    """(TTFT, mean ITL) of each replayed request against its recorded arrival offset."""
    ttft, itl = [], []
    for s in run.served:
        m = s.metrics
        if m is None:
            continue
        if m.ttft is not None:
            ttft.append((s.request.offset_s, m.ttft * 1000))
        if m.mean_itl is not None:
            itl.append((s.request.offset_s, m.mean_itl * 1000))
    return Series(run.label, ttft), Series(run.label, itl)


def _plot(title: str, series: Sequence[Series]) -> str:
    points = [p for s in series for p in s.points]
    if not points:
        return f"<p>{html.escape(title)}: no data</p>"
    x_max = max(x for x, _ in points) or 1.0
    y_max = max(y for _, y in points) or 1.0

    def at(x: float, y: float) -> str:
        px = _PAD + x / x_max * (_W - 2 * _PAD)
        py = _H - _PAD - y / y_max * (_H - 2 * _PAD)
        return f"{px:.1f},{py:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" role="img">',
        f"<title>{html.escape(title)}</title>",
        f'<text x="{_PAD}" y="18" font-size="13">{html.escape(title)}</text>',
        f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#999"/>',
        f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_H - _PAD}" stroke="#999"/>',
        f'<text x="4" y="{_PAD + 4}" font-size="11">{y_max:,.1f} ms</text>',
        f'<text x="4" y="{_H - _PAD}" font-size="11">0</text>',
        f'<text x="{_W - _PAD - 40}" y="{_H - _PAD + 16}" font-size="11">{x_max:,.0f} s</text>',
    ]
    for i, s in enumerate(series):
        colour = _COLOURS[i % len(_COLOURS)]
        for x, y in s.points:
            cx, cy = at(x, y).split(",")
            parts.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{colour}" fill-opacity="0.7"/>')
        parts.append(
            f'<text x="{_W - _PAD + 4}" y="{_PAD + 14 * i}" font-size="11" fill="{colour}">'
            f"{html.escape(s.label)}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts)


def html_report(
    heading: str, columns: list[Figures], ttft: list[Series], itl: list[Series], notes: list[str]
) -> str:
    body = [
        "<!doctype html>",
        '<html><head><meta charset="utf-8"><title>controlplane replay</title></head>',
        "<body style='font-family: sans-serif'>",
        f"<h1>{html.escape(heading)}</h1>",
        f"<pre>{html.escape(table(columns))}</pre>",
        _plot("TTFT (ms) by arrival (s)", ttft),
        _plot("Mean inter-token latency (ms) by arrival (s)", itl),
    ]
    body += [f"<p>{html.escape(n)}</p>" for n in notes]
    body.append("</body></html>")
    return "\n".join(body) + "\n"
