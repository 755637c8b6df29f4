"""The cost panel and the cost reports' arithmetic it shares with the requests table (spend
by API key, model or end user over the chosen window)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.reactive import var
from textual.widgets import Static

from controlplane.tui.history import fmt_num, fmt_pct, fmt_usd
from controlplane.tui.panels import Panel


def _report_total(report: dict[str, Any] | None, key: str) -> Any:
    if not report or report.get("empty"):
        return None
    return (report.get("totals") or {}).get(key)


def has_gpu_telemetry(util: dict[str, Any] | None) -> bool:
    if not util or util.get("empty"):
        return False
    cols = [c for c in util.get("columns", []) if "gpu" in c]
    rows = [*util.get("rows", []), util.get("totals") or {}]
    return any(r.get(c) is not None for r in rows for c in cols)


def spend_column(report: dict[str, Any] | None) -> str | None:
    """The report's spend column (list-price USD), whatever the report calls it."""
    cols = (report or {}).get("columns") or []
    usd = [c for c in cols if "usd" in c and "per" not in c]
    return next((c for c in usd if "list" in c), usd[0] if usd else None)


def spend_by(report: dict[str, Any] | None, field: str) -> dict[str, float]:
    """{group value: spend} of a cost report grouped by `field` (api_key, model, end_user)."""
    col = spend_column(report)
    out: dict[str, float] = {}
    if not report or report.get("empty") or col is None:
        return out
    for row in report.get("rows") or []:
        name = str(row.get(field) if row.get(field) is not None else "–")
        value = row.get(col)
        if isinstance(value, (int, float)):
            out[name] = out.get(name, 0.0) + value
    return out


class CostPanel(Panel):
    """Spend over the chosen window (`$` / `:cost`) by key, model and end user, labelled with its
    scope (this instance or the fleet); list and GPU-amortized $ per 1M completion tokens and
    utilization over the last hour. Its reactives are bound to the dashboard screen's."""

    costs: var[dict[str, Any] | None] = var(None)  # the last whole hour, $ per 1M tokens
    util: var[dict[str, Any] | None] = var(None)  # utilization over the last hour
    spend: var[dict[str, Any]] = var(dict)  # group_by -> the cost report over `spend_window`
    spend_window: var[str] = var("")  # the window `spend` was read for
    window: var[str] = var("1h")  # the window chosen: the title says it at once
    scope: var[str] = var("instance")  # of `spend`: this daemon's requests or the fleet's

    def __init__(self, title: str, **kwargs: Any) -> None:
        super().__init__(title, **kwargs)
        self.body = Static(id="cost-body")

    def compose(self) -> ComposeResult:
        yield self.body

    def _redraw(self) -> None:
        self.body.update(self.text())

    watch_costs = watch_util = watch_spend = watch_spend_window = watch_scope = _redraw

    def watch_window(self, old: str, new: str) -> None:
        if old != new:  # the title names the window once it has been chosen
            self.border_title = f"Cost, last {new} ({self.scope})"

    def text(self) -> str:
        costs, util, spend, window = self.costs, self.util, self.spend, self.spend_window
        if costs is None and util is None and not spend:
            return "[dim]loading reports…[/]"
        lines = []
        by_key = (spend or {}).get("api_key")
        col = spend_column(by_key)
        total = _report_total(by_key, col) if col else None
        lines.append(f"spend {window} [dim]({self.scope})[/] [b]{fmt_usd(total)}[/]")
        width = self.content_size.width or 30
        for field, label in (("api_key", "key"), ("model", "model"), ("end_user", "user")):
            top = sorted(spend_by((spend or {}).get(field), field).items(), key=lambda kv: -kv[1])
            # The biggest spenders that fit the line whole (a name never parts from its $).
            shown, used = [], len(label) + 1
            for name, v in top[:3]:
                item = f"{name} {fmt_usd(v)}"
                if shown and used + 2 + len(item) + 4 > width:
                    break
                shown.append(item)
                used += 2 + len(item)
            if shown:
                more = f" +{len(top) - len(shown)}" if len(top) > len(shown) else ""
                lines.append(f"[dim]{label}[/] " + "  ".join(shown) + more)
        lines.append(
            "[dim]$/1M compl, last whole hour[/]\n"
            f" list [b]{fmt_usd(_report_total(costs, 'list_usd_per_mtok_completion'))}[/]"
            f"  GPU [b]{fmt_usd(_report_total(costs, 'gpu_usd_per_mtok'))}[/]"
        )
        lines.append(
            f"util [b]{fmt_pct(_report_total(util, 'mean_busy_fraction'))}[/]"
            f"  KV {fmt_pct(_report_total(util, 'mean_kv_usage'))}"
        )
        if has_gpu_telemetry(util):
            lines.append(
                f"GPU util [b]{fmt_num(_report_total(util, 'mean_gpu_utilization_pct'), 0)}%[/]"
                f" {fmt_num(_report_total(util, 'mean_gpu_power_w'), 0)} W"
                f" max {fmt_num(_report_total(util, 'max_gpu_temperature_c'), 0)}°C"
            )
        else:
            lines.append("[dim]no GPU telemetry[/]")
        return "\n".join(lines)
