"""Dashboard panels. Each takes plain payload dicts from the admin API and renders them."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import DataTable, ProgressBar, Sparkline, Static

from controlplane.tui.history import (
    StatsHistory,
    fmt_bytes,
    fmt_duration,
    fmt_ms,
    fmt_num,
    fmt_pct,
    fmt_time,
    fmt_usd,
    fmt_value,
)
from controlplane.tui.severity import STYLE as SEVERITY_STYLE
from controlplane.tui.severity import header_slo, metric_level, paint, queue_fill

STATE_STYLE = {
    "serving": "bold green",
    "draining": "bold yellow",
    "drained: safe to stop": "bold reverse yellow",
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
    """One line: daemon, state, staleness, SLO attainment, autopilot, model, uptime; what does
    not fit the width is left out, least urgent first. A connection problem gets a second
    line (its reason must be readable at 80 columns)."""

    _last: tuple[Any, ...] | None = None

    def on_resize(self) -> None:
        if self._last is not None:
            self.show(*self._last)

    def show(
        self,
        url: str,
        stats: dict[str, Any] | None,
        connected: bool,
        note: str = "",
        down_state: str = "unreachable",
        stale_s: float | None = None,
    ) -> None:
        self._last = (url, stats, connected, note, down_state, stale_s)
        state = display_state(stats.get("state")) if stats and connected else down_state
        if state == "draining" and stats and not stats.get("requests_in_flight"):
            # Nothing left in flight or queued: stopping the daemon now loses no request.
            state = "drained: safe to stop"
        # (priority: lower is kept first, label, value, style)
        parts: list[tuple[int, str, str, str]] = [
            (0, "", url.removeprefix("http://").removeprefix("https://"), ""),
            (0, "", state, STATE_STYLE.get(state, "bold")),
        ]
        if stats and not connected and stale_s is not None:
            # The panels below keep the last numbers, dimmed: say how old they are.
            parts.append((0, "", f"STALE {fmt_duration(stale_s)}", "bold reverse yellow"))
        if stats and connected:
            word, lvl = header_slo(stats)
            if word:
                parts.append((1, "SLO", word, SEVERITY_STYLE[lvl] if lvl is not None else "bold"))
        if stats:
            pilot = stats.get("autopilot")
            if pilot:
                missed = (stats.get("slo") or {}).get("met") is False and pilot["state"] != "off"
                # Never green while the target is missed: holding then means "cannot help".
                style = "bold red" if missed else AUTOPILOT_STYLE.get(pilot["state"], "")
                parts.append((1, "autopilot", pilot["state"] + (" ✗" if missed else ""), style))
            quant = (stats.get("memory") or {}).get("quantization")
            model = str(stats.get("model") or "–")
            parts.append((2, "", model + (f" {quant}" if quant and quant != "none" else ""), ""))
            parts.append((3, "up", fmt_duration(stats.get("uptime_s")), ""))
            if connected and note:
                parts.append((1, "", note, "yellow"))
        width = (self.size.width or self.app.size.width) - 15
        keep: set[int] = set()
        used = 0
        for i in sorted(range(len(parts)), key=lambda i: parts[i][0]):
            n = len(parts[i][1]) + len(parts[i][2]) + 3
            if used + n <= width or parts[i][0] == 0:
                keep.add(i)
                used += n
        t = Text()
        t.append(" controlplane ", style="bold reverse")
        for i, (_, label, value, style) in enumerate(parts):
            if i in keep:
                t.append(f"  {label} " if label else "  ", style="dim")
                t.append(value, style=style)
        if note and not connected:  # its own line: the reason must fit at 80 columns
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
            f"queue {paint(fmt_value(stats.get('queue_length')), metric_level(stats, 'queue_fill', queue_fill(stats)))}"
            f" / {fmt_value(stats.get('max_queue_len'))}  "
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
        lvl = metric_level(stats, "kv_usage_perc")
        self.query_one("#kv-label", Static).update(
            f"blocks {paint(fmt_value(used), lvl)} / {fmt_value(total)}"
        )
        perc = stats.get("kv_usage_perc")
        self.query_one("#kv-bar", ProgressBar).update(
            progress=float(perc) if isinstance(perc, (int, float)) else 0.0
        )
        hit = stats.get("prefix_cache_hit_rate")
        # Also the map's legend: its cyan cells are mostly cached, unused blocks.
        self.query_one("#kv-cache", Static).update(
            f"hit [b]{fmt_pct(hit)}[/]  [cyan]█[/] cached "
            f"{fmt_value(stats.get('kv_blocks_cached'))}\n"
            f"  ({fmt_value(stats.get('kv_blocks_evictable'))} idle, reusable)"
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
            f"weights [b]{fmt_bytes(mem.get('weights_bytes'))}[/]\n"
            f"KV [b]{fmt_bytes(mem.get('kv_cache_bytes'))}[/]"
            + (f" {mem['kv_cache_dtype']}" if mem.get("kv_cache_dtype") else "")
        )


class LatencyPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static(id="latency-body")

    def show(self, stats: dict[str, Any]) -> None:
        lines = []
        if "ttft_p50_ms" in stats or "itl_p50_ms" in stats:
            for name, key in (("TTFT", "ttft"), ("ITL ", "itl")):
                p99 = stats.get(f"{key}_p99_ms")
                lines.append(
                    f"{name} p50 [b]{fmt_ms(stats.get(f'{key}_p50_ms'))}[/] "
                    f"p99 {paint(fmt_ms(p99), metric_level(stats, f'{key}_p99_ms'))}"
                )
        lines.append(
            f"step p50 [b]{fmt_ms(stats.get('step_time_p50_ms'))}[/] "
            f"p99 [b]{fmt_ms(stats.get('step_time_p99_ms'))}[/]"
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
    utilization over the last hour."""

    def compose(self) -> ComposeResult:
        yield Static(id="cost-body")

    def show(
        self,
        costs: dict[str, Any] | None,
        util: dict[str, Any] | None,
        spend: dict[str, Any] | None = None,
        window: str = "1h",
        scope: str = "instance",
    ) -> None:
        if costs is None and util is None and not spend:
            self.query_one("#cost-body", Static).update("[dim]loading reports…[/]")
            return
        lines = []
        by_key = (spend or {}).get("api_key")
        col = spend_column(by_key)
        total = _report_total(by_key, col) if col else None
        lines.append(f"spend {window} [dim]({scope})[/] [b]{fmt_usd(total)}[/]")
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
        self.query_one("#cost-body", Static).update("\n".join(lines))


REQUEST_COLUMNS = (
    ("id", "id"),
    ("state", "state"),
    ("api_key_name", "key"),
    ("end_user", "user"),
    ("age_s", "age s"),
    ("prompt_tokens", "prompt"),
    ("output_tokens", "output"),
)
# Grouped view: one row per key or end user (`v` cycles none -> key -> user).
GROUPS = (None, "api_key_name", "end_user")
GROUP_COLUMNS = (
    ("name", "name"),
    ("requests", "reqs"),
    ("running", "run"),
    ("waiting", "wait"),
    ("prompt_tokens", "prompt"),
    ("output_tokens", "output"),
    ("share", "share"),
    ("spend", "spend"),
)
NUMERIC = {"age_s", "prompt_tokens", "output_tokens", "requests", "running", "waiting", "share"}
# Filter words `field:value` name these row fields; a bare word matches any of them.
FILTER_FIELDS = {
    "key": "api_key_name",
    "user": "end_user",
    "state": "state",
    "id": "id",
    "endpoint": "endpoint",
    "model": "model",
}


def short_id(rid: Any) -> str:
    """The distinctive tail of a request id (they share a prefix like chatcmpl-): 8 characters
    leave room for the state at 80 columns; the filter matches the whole id."""
    text = str(rid)
    return text if len(text) <= 9 else "…" + text[-8:]


def matches(row: dict[str, Any], query: str) -> bool:
    """`key:alice state:waiting`: every word must match (case-insensitive substring)."""
    for word in query.lower().split():
        name, _, value = word.partition(":")
        if value and name in FILTER_FIELDS:
            if value not in str(row.get(FILTER_FIELDS[name]) or "").lower():
                return False
        elif not any(word in str(row.get(f) or "").lower() for f in FILTER_FIELDS.values()):
            return False
    return True


def group_rows(
    rows: list[dict[str, Any]], by: str, spend: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """One row per `by` value: request count, running / waiting, tokens, their share of all
    live tokens, and the spend over the cost panel's window (None where unknown)."""
    total = sum((r.get("prompt_tokens") or 0) + (r.get("output_tokens") or 0) for r in rows)
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        name = str(r.get(by) or "–")
        g = groups.setdefault(
            name,
            {"name": name, "requests": 0, "running": 0, "waiting": 0, "prompt_tokens": 0,
             "output_tokens": 0},
        )  # fmt: skip
        g["requests"] += 1
        g["running"] += r.get("state") == "running"
        g["waiting"] += r.get("state") in ("waiting", "swapped")
        g["prompt_tokens"] += r.get("prompt_tokens") or 0
        g["output_tokens"] += r.get("output_tokens") or 0
    for g in groups.values():
        g["share"] = (g["prompt_tokens"] + g["output_tokens"]) / total if total else 0.0
        g["spend"] = (spend or {}).get(g["name"])
    return list(groups.values())


class MeasuredTable(DataTable):
    """A DataTable whose columns widen on screen as soon as its new rows are measured.

    Textual measures new rows when the table is next idle, and its render caches are not keyed
    on the column widths: a paint in between (a loaded machine) cached the rows cut at the
    header labels' widths ("engin" for engine.max_num_seqs), and they stayed so until the next
    change. Textual calls this handler before DataTable's own: it measures first, then drops
    the caches and repaints when anything was measured."""

    async def _on_idle(self, event: events.Idle) -> None:
        measuring = self._require_update_dimensions or bool(self._updated_cells)
        await DataTable._on_idle(self, event)  # the base's own call then finds nothing to do
        if measuring:
            self._clear_caches()
            self.refresh()


class RequestsTable(MeasuredTable):
    """Live requests: sortable (click a header or `o`), filtered (`/`), grouped by key or end
    user (`v`). A refresh or a re-sort keeps the cursor on the request it was on; when that
    request is gone, the cursor goes to the top row, never silently onto another request."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("j", "cursor_down", "Down", show=False),
        Binding("k", "cursor_up", "Up", show=False),
        Binding("g", "scroll_top", "Top", show=False),
        Binding("G", "scroll_bottom", "Bottom", show=False),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.sort_key: str = "age_s"
        self.sort_reverse: bool = True
        self.rows_data: list[dict[str, Any]] = []
        self.query_text = ""
        self.group_by: str | None = None
        self.spend: dict[str, dict[str, float]] = {}  # group field -> name -> USD
        self.spend_window = ""
        self.model = ""  # the daemon's model: every live row's

    def columns_for_mode(self) -> tuple[tuple[str, str], ...]:
        return REQUEST_COLUMNS if self.group_by is None else GROUP_COLUMNS

    def _set_columns(self) -> None:
        wanted = [k for k, _ in self.columns_for_mode()]
        if [c.value for c in self.columns] != wanted:
            self.clear(columns=True)
            for key, label in self.columns_for_mode():
                self.add_column(label, key=key)

    def on_mount(self) -> None:
        self._set_columns()

    def visible_rows(self) -> list[dict[str, Any]]:
        rows = [{**r, "model": self.model} for r in self.rows_data]
        return [r for r in rows if matches(r, self.query_text)] if self.query_text else rows

    def show(self, live: list[dict[str, Any]] | None = None) -> None:
        if live is not None:
            self.rows_data = list(live)
        selected = self.selected_id()
        self._set_columns()
        self.clear()
        rows = self.visible_rows()
        if self.group_by is None:
            for r in self._sorted(rows):
                self.add_row(
                    short_id(r.get("id")),
                    str(r.get("state")),
                    str(r.get("api_key_name") or "–"),
                    str(r.get("end_user") or "–"),
                    fmt_num(r.get("age_s")),
                    fmt_value(r.get("prompt_tokens")),
                    fmt_value(r.get("output_tokens")),
                    key=str(r.get("id")),
                )
        else:
            spend = self.spend.get(self.group_by)
            for g in self._sorted(group_rows(rows, self.group_by, spend)):
                self.add_row(
                    g["name"],
                    str(g["requests"]),
                    str(g["running"]),
                    str(g["waiting"]),
                    str(g["prompt_tokens"]),
                    str(g["output_tokens"]),
                    fmt_pct(g["share"]),
                    fmt_usd(g["spend"]),
                    key=f"group:{g['name']}",
                )
        if selected is not None:
            try:
                index = self.get_row_index(selected)
            except Exception:  # that request finished or is filtered out: back to the top
                index = 0
            self.move_cursor(row=index, animate=False)
        mode = {"api_key_name": " by key", "end_user": " by user"}.get(self.group_by or "", "")
        title = f"Live requests ({len(rows)}/{len(self.rows_data)}){mode}"
        if self.query_text:
            title += f"  filter: {self.query_text}"
        if self.group_by and self.spend_window:
            title += f"  spend: {self.spend_window}"
        self.border_title = (
            title + f"  sort: {self.sort_key}" + (" ↓" if self.sort_reverse else " ↑")
        )

    def _sorted(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        key_name = self.sort_key
        if key_name not in {k for k, _ in self.columns_for_mode()}:
            key_name = "requests" if self.group_by else "age_s"

        def key(r: dict[str, Any]) -> tuple:
            v = r.get(key_name)
            return (v is None, v if isinstance(v, (int, float)) else str(v or ""))

        return sorted(rows, key=key, reverse=self.sort_reverse)

    def sort_by(self, key: str) -> None:
        if key == self.sort_key:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_key, self.sort_reverse = key, key in NUMERIC
        self.show()

    def cycle_sort(self) -> None:
        keys = [k for k, _ in self.columns_for_mode()]
        i = keys.index(self.sort_key) if self.sort_key in keys else -1
        self.sort_key = keys[(i + 1) % len(keys)]
        self.sort_reverse = self.sort_key in NUMERIC
        self.show()

    def set_filter(self, text: str) -> None:
        self.query_text = text.strip()
        self.show()

    def cycle_group(self) -> str | None:
        self.group_by = GROUPS[(GROUPS.index(self.group_by) + 1) % len(GROUPS)]
        self.sort_key, self.sort_reverse = ("requests", True) if self.group_by else ("age_s", True)
        self.show()
        return self.group_by

    def selected_key(self) -> str | None:
        """The row key under the cursor: a request id, or `group:<name>` in a grouped view."""
        if not self.row_count:
            return None
        try:
            return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except Exception:
            return None

    def selected_id(self) -> str | None:
        """The selected request's id; None in a grouped view."""
        key = self.selected_key()
        return None if key is None or key.startswith("group:") else key

    def selected_row(self) -> dict[str, Any] | None:
        key = self.selected_key()
        return next((r for r in self.rows_data if str(r.get("id")) == key), None)

    def selected_group(self, field: str) -> str | None:
        """The key (field api_key_name) or user (end_user) of the selected row or group."""
        key = self.selected_key()
        if key is None:
            return None
        if key.startswith("group:"):
            return key.removeprefix("group:") if self.group_by == field else None
        row = self.selected_row()
        return (row or {}).get(field)


class ChangesTable(MeasuredTable):
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
