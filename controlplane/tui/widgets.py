"""Dashboard panels. Each takes plain payload dicts from the admin API and renders them."""

from __future__ import annotations

import contextlib
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, ProgressBar, Sparkline, Static

from controlplane.tui.history import (
    StatsHistory,
    fmt_bytes,
    fmt_duration,
    fmt_num,
    fmt_pct,
    fmt_time,
    fmt_usd,
    fmt_value,
)

STATE_STYLE = {
    "serving": "bold green",
    "draining": "bold yellow",
    "loading": "bold cyan",
    "unreachable": "bold red",
    "unauthorized": "bold red",
    "connecting": "bold cyan",
    "dead": "bold red",
    "stopped": "bold red",
}


AUTOPILOT_STYLE = {"off": "dim", "holding": "bold green", "adjusting": "bold yellow"}


def display_state(state: str | None) -> str:
    return {"ready": "serving", None: "unreachable"}.get(state, state or "unreachable")


class HeaderBar(Static):
    """One line: daemon URL, model, uptime, state, connection notes."""

    def show(
        self,
        url: str,
        stats: dict[str, Any] | None,
        connected: bool,
        note: str = "",
        down_state: str = "unreachable",
    ) -> None:
        state = display_state(stats.get("state")) if stats and connected else down_state
        t = Text()
        t.append(" controlplane ", style="bold reverse")
        t.append(f" {url} ")
        t.append(" state ", style="dim")
        t.append(state, style=STATE_STYLE.get(state, "bold"))
        if stats:
            t.append("  model ", style="dim")
            t.append(str(stats.get("model") or "–"))
            quant = (stats.get("memory") or {}).get("quantization")
            if quant and quant != "none":
                t.append(f" {quant}", style="bold")
            t.append("  up ", style="dim")
            t.append(fmt_duration(stats.get("uptime_s")))
            pilot = stats.get("autopilot")
            if pilot:
                t.append("  autopilot ", style="dim")
                t.append(pilot["state"], style=AUTOPILOT_STYLE.get(pilot["state"], ""))
                goals = [
                    f"{name} ≤ {pilot[key]:g} ms"
                    for name, key in (("ITL", "itl_p99_ms"), ("TTFT", "ttft_p99_ms"))
                    if pilot.get(key)
                ]
                if goals and pilot["state"] != "off":
                    t.append(f" (p99 {', '.join(goals)})", style="dim")
        if note and connected:
            t.append(f"  {note}", style="yellow")
        elif note:  # its own line: the reason must fit at 80 columns
            t.append(f"\n {note}", style="bold red")
        self.update(t)


class Panel(Vertical):
    """A bordered box with a title."""

    def __init__(self, title: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = title


class ThroughputPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static(id="prefill-label", classes="line")
        yield Sparkline([], id="prefill-spark", summary_function=max)
        yield Static(id="decode-label", classes="line")
        yield Sparkline([], id="decode-spark", summary_function=max)
        yield Static(id="rps-label", classes="line")

    def show(self, stats: dict[str, Any], hist: StatsHistory) -> None:
        rps = hist.rate("num_finished", 60.0)
        self.query_one("#prefill-label", Static).update(
            f"prefill [b]{fmt_num(stats.get('prefill_tokens_per_s'), 0)}[/] tok/s"
        )
        self.query_one("#decode-label", Static).update(
            f"decode  [b]{fmt_num(stats.get('decode_tokens_per_s'), 0)}[/] tok/s"
        )
        self.query_one("#rps-label", Static).update(
            f"req/s [b]{fmt_num(rps, 2)}[/]  [dim](last 5 min)[/]"
        )
        self.query_one("#prefill-spark", Sparkline).data = hist.series("prefill_tokens_per_s")
        self.query_one("#decode-spark", Sparkline).data = hist.series("decode_tokens_per_s")


class BatchPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static(id="batch-body")

    def show(self, stats: dict[str, Any]) -> None:
        running, max_seqs = stats.get("num_running"), stats.get("max_num_seqs")
        self.query_one("#batch-body", Static).update(
            f"running [b]{fmt_value(running)}[/] / [b]{fmt_value(max_seqs)}[/] max_num_seqs\n"
            f"tokens/step [b]{fmt_pct(stats.get('batch_fill_tokens'))}[/] of "
            f"{fmt_value(stats.get('max_num_batched_tokens'))}\n"
            f"queue [b]{fmt_value(stats.get('queue_length'))}[/]  "
            f"swapped {fmt_value(stats.get('num_swapped'))}\n"
            + speculation_line(stats)
            + "\n"
            + structured_line(stats)
        )


def structured_line(stats: dict[str, Any]) -> str:
    """Structured outputs: the share of constrained requests (last minute) and the mask work
    per constrained step (and how much of it the step waited for)."""
    share = stats.get("structured_share")
    if not share and not stats.get("grammar_states"):
        return "[dim]structured outputs: none[/]"
    return (
        f"structured [b]{fmt_pct(share)}[/] of requests  "
        f"mask [b]{fmt_num(stats.get('grammar_mask_ms_per_step'), 1)}[/] ms/step "
        f"(wait {fmt_num(stats.get('grammar_mask_wait_ms_per_step'), 1)})"
    )


def speculation_line(stats: dict[str, Any]) -> str:
    """Speculative decoding: method, k, state, and how well the drafts do (last minute)."""
    method = stats.get("speculative_method") or "off"
    if method == "off":
        return "[dim]speculation off[/]"
    state = stats.get("speculation") or "?"
    colour = "yellow" if state == "paused" else "green"
    return (
        f"spec {method} k={fmt_value(stats.get('speculative_num_tokens'))} [{colour}]{state}[/] "
        f"[b]{fmt_pct(stats.get('spec_acceptance_rate'))}[/] "
        f"len [b]{fmt_num(stats.get('spec_mean_accepted_len'), 2)}[/]"
    )


class KVPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static(id="kv-label")
        yield ProgressBar(total=100, show_eta=False, id="kv-bar")
        yield Static(id="kv-map")
        yield Static(id="kv-cache")
        yield Static(id="kv-preempt")
        yield Static(id="kv-memory")

    def show_map(self, occupancy: list[float], cached: list[float] | None = None) -> None:
        """One character per range of block ids, from empty (space) to full (█): its height is
        the share of blocks in use plus cached; cyan where cached blocks (unused, reusable
        prefixes) outnumber the ones in use. Drawn on a slightly lighter strip (the theme's
        $boost) so that empty ranges show, not in reverse video: that would paint the free
        share of a cell, in cyan for a mostly cached one."""
        levels = " ▁▂▃▄▅▆▇█"
        cached = cached if cached and len(cached) == len(occupancy) else [0.0] * len(occupancy)
        cells = []
        for used, idle in zip(occupancy, cached, strict=True):
            f = used + idle
            # Any block in use shows at least the lowest level: a big cache stays visible.
            glyph = levels[0 if f <= 0 else max(1, min(8, round(f * 8)))]
            cells.append(f"[cyan]{glyph}[/]" if idle > used else glyph)
        text = "".join(cells)
        self.query_one("#kv-map", Static).update(f"map [on $boost]{text}[/]" if cells else "")

    def show(self, stats: dict[str, Any], hist: StatsHistory) -> None:
        used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
        self.query_one("#kv-label", Static).update(
            f"blocks [b]{fmt_value(used)}[/] / {fmt_value(total)}"
        )
        perc = stats.get("kv_usage_perc")
        self.query_one("#kv-bar", ProgressBar).update(
            progress=float(perc) if isinstance(perc, (int, float)) else 0.0
        )
        hit = stats.get("prefix_cache_hit_rate")
        # Also the map's legend: its cyan cells are mostly cached, unused blocks.
        self.query_one("#kv-cache", Static).update(
            f"hit [b]{fmt_pct(hit)}[/]  [cyan]█ cached[/] "
            f"{fmt_value(stats.get('kv_blocks_cached'))} "
            f"({fmt_value(stats.get('kv_blocks_evictable'))} idle)"
            if stats.get("enable_prefix_caching", True)
            else "[dim]prefix caching off[/]"
        )
        per_min = hist.rate("num_preemptions", 60.0)
        if per_min is None:  # one snapshot so far: the 10 s window's count, scaled
            per_min = float(stats.get("preemptions_in_window") or 0) * 6
        else:
            per_min *= 60
        self.query_one("#kv-preempt", Static).update(
            f"preempt/min [b]{fmt_num(per_min)}[/] (Σ {fmt_value(stats.get('num_preemptions'))})"
        )
        mem = stats.get("memory") or {}
        self.query_one("#kv-memory", Static).update(
            f"weights [b]{fmt_bytes(mem.get('weights_bytes'))}[/]  "
            f"KV [b]{fmt_bytes(mem.get('kv_cache_bytes'))}[/]"
            + (f" {mem['kv_cache_dtype']}" if mem.get("kv_cache_dtype") else "")
        )


class LatencyPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static(id="latency-body")

    def show(self, stats: dict[str, Any]) -> None:
        lines = []
        if "ttft_p50_ms" in stats or "itl_p50_ms" in stats:
            lines.append(
                f"TTFT p50 [b]{fmt_num(stats.get('ttft_p50_ms'))}[/] "
                f"p99 [b]{fmt_num(stats.get('ttft_p99_ms'))}[/] ms"
            )
            lines.append(
                f"ITL  p50 [b]{fmt_num(stats.get('itl_p50_ms'))}[/] "
                f"p99 [b]{fmt_num(stats.get('itl_p99_ms'))}[/] ms"
            )
        lines.append(
            f"step p50 [b]{fmt_num(stats.get('step_time_p50_ms'))}[/] ms\n"
            f"step p99 [b]{fmt_num(stats.get('step_time_p99_ms'))}[/] ms"
        )
        if "ttft_p50_ms" not in stats:
            lines.append("[dim]no TTFT/ITL in the API:\nstep time shown instead[/]")
        self.query_one("#latency-body", Static).update("\n".join(lines))


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


class CostPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static(id="cost-body")

    def show(self, costs: dict[str, Any] | None, util: dict[str, Any] | None) -> None:
        if costs is None and util is None:
            self.query_one("#cost-body", Static).update("[dim]loading reports…[/]")
            return
        lines = [
            "$/1M completion tok, 1 h",
            f" list [b]{fmt_usd(_report_total(costs, 'list_usd_per_mtok_completion'))}[/]"
            f"  GPU [b]{fmt_usd(_report_total(costs, 'gpu_usd_per_mtok'))}[/]",
            f"util [b]{fmt_pct(_report_total(util, 'mean_busy_fraction'))}[/]"
            f"  KV {fmt_pct(_report_total(util, 'mean_kv_usage'))}",
        ]
        if has_gpu_telemetry(util):
            lines.append(
                f"GPU util [b]{fmt_num(_report_total(util, 'mean_gpu_utilization_pct'), 0)}%[/]"
                f" {fmt_num(_report_total(util, 'mean_gpu_power_w'), 0)} W"
                f" max {fmt_num(_report_total(util, 'max_gpu_temperature_c'), 0)}°C"
            )
        else:
            lines.append("[dim]no GPU telemetry[/]")
        self.query_one("#cost-body", Static).update("\n".join(lines))


REQUEST_COLUMNS = (
    ("id", "ID"),
    ("api_key_name", "key"),
    ("age_s", "age s"),
    ("prompt_tokens", "prompt"),
    ("output_tokens", "output"),
    ("state", "state"),
)


class RequestsTable(DataTable):
    """Live requests, sortable by column (click a header or press `o`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.sort_key: str = "age_s"
        self.sort_reverse: bool = True
        self.rows_data: list[dict[str, Any]] = []

    def on_mount(self) -> None:
        for key, label in REQUEST_COLUMNS:
            self.add_column(label, key=key)

    def show(self, live: list[dict[str, Any]]) -> None:
        self.rows_data = list(live)
        selected = self.selected_id()
        self.clear()
        for r in self._sorted():
            self.add_row(
                str(r.get("id")),
                str(r.get("api_key_name") or "–"),
                fmt_num(r.get("age_s")),
                fmt_value(r.get("prompt_tokens")),
                fmt_value(r.get("output_tokens")),
                str(r.get("state")),
                key=str(r.get("id")),
            )
        if selected is not None:
            with contextlib.suppress(Exception):  # the selected request may have finished
                self.move_cursor(row=self.get_row_index(selected), animate=False)
        self.border_title = f"Live requests ({len(live)})  sort: {self.sort_key}" + (
            " ↓" if self.sort_reverse else " ↑"
        )

    def _sorted(self) -> list[dict[str, Any]]:
        def key(r: dict[str, Any]) -> tuple:
            v = r.get(self.sort_key)
            return (v is None, v if isinstance(v, (int, float)) else str(v or ""))

        return sorted(self.rows_data, key=key, reverse=self.sort_reverse)

    def sort_by(self, key: str) -> None:
        if key == self.sort_key:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_key, self.sort_reverse = (
                key,
                key in ("age_s", "prompt_tokens", "output_tokens"),
            )
        self.show(self.rows_data)

    def cycle_sort(self) -> None:
        keys = [k for k, _ in REQUEST_COLUMNS]
        self.sort_key = keys[(keys.index(self.sort_key) + 1) % len(keys)]
        self.sort_reverse = self.sort_key in ("age_s", "prompt_tokens", "output_tokens")
        self.show(self.rows_data)

    def selected_id(self) -> str | None:
        if not self.row_count:
            return None
        try:
            return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except Exception:
            return None


class ChangesTable(DataTable):
    """Recent config changes, newest first: history at start, then SSE config events."""

    MAX_ROWS = 200

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.border_title = "Config changes"

    def on_mount(self) -> None:
        for label in ("time", "source", "actor", "field", "old → new"):
            self.add_column(label, key=label)

    def show(self, entries: list[dict[str, Any]]) -> None:
        """Entries newest first: {time, source, actor, field, old, new, reason}."""
        self.clear()
        for e in entries[: self.MAX_ROWS]:
            change = f"{fmt_value(e.get('old'))} → {fmt_value(e.get('new'))}"
            if e.get("reason"):  # the autopilot says why; the operator reads it here
                change += f"  ({e['reason']})"
            self.add_row(
                fmt_time(e.get("time")),
                str(e.get("source") or "–"),
                str(e.get("actor") or "–"),
                str(e.get("field")),
                change,
            )
