"""The dashboard's detail panels: throughput, batch (with the kernels), KV cache, latency.

Each panel holds what it shows in reactives that the dashboard screen binds to its own
(`data_bind`), and redraws in their watchers: the screen never calls into a panel. A panel
keeps references to its parts rather than querying for them: while the app shuts down, the
parts are removed before their panel, and an answer arriving then must not find a panel
without its parts (NoMatches)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import var
from textual.widgets import ProgressBar, Sparkline, Static

from controlplane.tui.history import (
    StatsHistory,
    fmt_bytes,
    fmt_ms,
    fmt_num,
    fmt_pct,
    fmt_value,
)
from controlplane.tui.kernels import kernels_line
from controlplane.tui.severity import metric_level, paint, queue_fill


class Panel(Vertical):
    """A bordered box with a title."""

    def __init__(self, title: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = title


class ThroughputPanel(Panel):
    """Prefill and decode tokens/s with their trends, and requests/s over the last minutes."""

    stats: var[dict[str, Any] | None] = var(None)

    def __init__(self, title: str, history: StatsHistory, **kwargs: Any) -> None:
        super().__init__(title, **kwargs)
        self.history = history
        self.prefill_label = Static(id="prefill-label", classes="line")
        self.prefill_spark = Sparkline([], id="prefill-spark", summary_function=max)
        self.decode_label = Static(id="decode-label", classes="line")
        self.decode_spark = Sparkline([], id="decode-spark", summary_function=max)
        self.rps_label = Static(id="rps-label", classes="line")

    def compose(self) -> ComposeResult:
        yield self.prefill_label
        yield self.prefill_spark
        yield self.decode_label
        yield self.decode_spark
        yield self.rps_label

    def watch_stats(self, stats: dict[str, Any] | None) -> None:
        stats, hist = stats or {}, self.history
        rps = hist.rate("num_finished", 60.0)
        self.prefill_label.update(
            f"prefill [b]{fmt_num(stats.get('prefill_tokens_per_s'), 0)}[/] tok/s"
        )
        self.decode_label.update(
            f"decode  [b]{fmt_num(stats.get('decode_tokens_per_s'), 0)}[/] tok/s"
        )
        self.rps_label.update(f"req/s [b]{fmt_num(rps, 2)}[/]  [dim](last 5 min)[/]")
        self.prefill_spark.data = hist.series("prefill_tokens_per_s")
        self.decode_spark.data = hist.series("decode_tokens_per_s")


class BatchPanel(Panel):
    """Running against max_num_seqs, the token budget's use, the queue against its cap,
    speculation, structured outputs, and whether the kernels and the compiled step run."""

    stats: var[dict[str, Any] | None] = var(None)

    def __init__(self, title: str, **kwargs: Any) -> None:
        super().__init__(title, **kwargs)
        self.body = Static(id="batch-body")

    def compose(self) -> ComposeResult:
        yield self.body

    def watch_stats(self, stats: dict[str, Any] | None) -> None:
        stats = stats or {}
        running, max_seqs = stats.get("num_running"), stats.get("max_num_seqs")
        queue = paint(
            fmt_value(stats.get("queue_length")),
            metric_level(stats, "queue_fill", queue_fill(stats)),
        )
        lines = [
            f"running [b]{fmt_value(running)}[/] / [b]{fmt_value(max_seqs)}[/] max_num_seqs",
            f"tokens/step [b]{fmt_pct(stats.get('batch_fill_tokens'))}[/] of "
            f"{fmt_value(stats.get('max_num_batched_tokens'))}",
            f"queue {queue} / {fmt_value(stats.get('max_queue_len'))}  "
            f"swapped {fmt_value(stats.get('num_swapped'))}",
            speculation_line(stats),
            structured_line(stats),
        ]
        engine = kernels_line(stats)
        if engine:  # a daemon that reports neither (an older one) gets no line
            lines.append(engine)
        self.body.update("\n".join(lines))


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
    """Blocks in use with a bar, the block map, the prefix cache, preemptions and memory."""

    stats: var[dict[str, Any] | None] = var(None)
    # (share of each range of block ids in use, share cached and unused), from the block map.
    block_map: var[tuple[list[float], list[float]]] = var(lambda: ([], []))

    def __init__(self, title: str, history: StatsHistory, **kwargs: Any) -> None:
        super().__init__(title, **kwargs)
        self.history = history
        self.label = Static(id="kv-label")
        self.bar = ProgressBar(total=100, show_eta=False, id="kv-bar")
        self.map = Static(id="kv-map")
        self.cache = Static(id="kv-cache")
        self.preempt = Static(id="kv-preempt")
        self.memory = Static(id="kv-memory")

    def compose(self) -> ComposeResult:
        yield from (self.label, self.bar, self.map, self.cache, self.preempt, self.memory)

    def watch_block_map(self, block_map: tuple[list[float], list[float]]) -> None:
        """One character per range of block ids, from empty (space) to full (█): its height is
        the share of blocks in use plus cached; cyan where cached blocks (unused, reusable
        prefixes) outnumber the ones in use. Drawn on a slightly lighter strip (the theme's
        $boost) so that empty ranges show, not in reverse video: that would paint the free
        share of a cell, in cyan for a mostly cached one."""
        occupancy, cached = block_map
        levels = " ▁▂▃▄▅▆▇█"
        cached = cached if cached and len(cached) == len(occupancy) else [0.0] * len(occupancy)
        cells = []
        for used, idle in zip(occupancy, cached, strict=True):
            f = used + idle
            # Any block in use shows at least the lowest level: a big cache stays visible.
            glyph = levels[0 if f <= 0 else max(1, min(8, round(f * 8)))]
            cells.append(f"[cyan]{glyph}[/]" if idle > used else glyph)
        text = "".join(cells)
        self.map.update(f"map [on $boost]{text}[/]" if cells else "")

    def watch_stats(self, stats: dict[str, Any] | None) -> None:
        stats = stats or {}
        used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
        lvl = metric_level(stats, "kv_usage_perc")
        self.label.update(f"blocks {paint(fmt_value(used), lvl)} / {fmt_value(total)}")
        perc = stats.get("kv_usage_perc")
        self.bar.update(progress=float(perc) if isinstance(perc, (int, float)) else 0.0)
        hit = stats.get("prefix_cache_hit_rate")
        # Also the map's legend: its cyan cells are mostly cached, unused blocks.
        self.cache.update(
            f"hit [b]{fmt_pct(hit)}[/]  [cyan]█[/] cached "
            f"{fmt_value(stats.get('kv_blocks_cached'))}\n"
            f"  ({fmt_value(stats.get('kv_blocks_evictable'))} idle, reusable)"
            if stats.get("enable_prefix_caching", True)
            else "[dim]prefix caching off[/]"
        )
        per_min = self.history.rate("num_preemptions", 60.0)
        if per_min is None:  # one snapshot so far: the 10 s window's count, scaled
            per_min = float(stats.get("preemptions_in_window") or 0) * 6
        else:
            per_min *= 60
        self.preempt.update(
            f"preempt/min [b]{fmt_num(per_min)}[/] (Σ {fmt_value(stats.get('num_preemptions'))})"
        )
        mem = stats.get("memory") or {}
        self.memory.update(
            f"weights [b]{fmt_bytes(mem.get('weights_bytes'))}[/]\n"
            f"KV [b]{fmt_bytes(mem.get('kv_cache_bytes'))}[/]"
            + (f" {mem['kv_cache_dtype']}" if mem.get("kv_cache_dtype") else "")
            + tensor_parallel_lines(stats)
        )


def tensor_parallel_lines(stats: dict[str, Any]) -> str:
    """One line a tensor-parallel rank (memory, recent step time and the all-reduce share of
    it), under the memory lines; nothing at one rank."""
    tp = stats.get("tensor_parallel")
    if not tp:
        return ""
    lines = [f"\nTP [b]{tp['size']}[/] ranks"]
    for r in tp["ranks"]:
        lines.append(
            f"r{r['rank']} {fmt_bytes(r['weights_bytes'])}+{fmt_bytes(r['kv_cache_bytes'])} "
            f"step [b]{fmt_num(r['step_ms'])}[/] ms, all-reduce [b]{fmt_pct(r['all_reduce_share'])}[/]"
        )
    return "\n".join(lines)


class LatencyPanel(Panel):
    """TTFT and ITL p50 / p99 (coloured against their thresholds) and step time."""

    stats: var[dict[str, Any] | None] = var(None)

    def __init__(self, title: str, **kwargs: Any) -> None:
        super().__init__(title, **kwargs)
        self.body = Static(id="latency-body")

    def compose(self) -> ComposeResult:
        yield self.body

    def watch_stats(self, stats: dict[str, Any] | None) -> None:
        stats = stats or {}
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
        self.body.update("\n".join(lines))
