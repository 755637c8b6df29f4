"""The dashboard's tables: the live requests (sortable, filtered, grouped by key or end user)
and the recent config changes. What they show comes through reactives bound to the dashboard
screen's (`live`, `spend_reports`, `entries`); sorting, filtering and grouping are the table's
own."""

from __future__ import annotations

from typing import Any, ClassVar

from textual import events
from textual.binding import Binding
from textual.reactive import var
from textual.widgets import DataTable

from controlplane.tui.cost_panel import spend_by
from controlplane.tui.history import fmt_num, fmt_pct, fmt_time, fmt_usd, fmt_value

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

    # One help line for the four (the help screen joins bindings that share a tooltip).
    MOVES = "down, up, top, bottom in a table (also arrows, Home, End)"
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("j", "cursor_down", "Down", show=False, tooltip=MOVES),
        Binding("k", "cursor_up", "Up", show=False, tooltip=MOVES),
        Binding("g", "scroll_top", "Top", show=False, tooltip=MOVES),
        Binding("G", "scroll_bottom", "Bottom", show=False, tooltip=MOVES),
    ]
    live: var[list[dict[str, Any]]] = var(list, init=False)  # GET /admin/requests' live
    # group_by -> the cost report over the cost panel's window (the grouped view's spend).
    spend_reports: var[dict[str, Any]] = var(dict, init=False)
    spend_window: var[str] = var("")
    model: var[str] = var("")  # the daemon's model: every live row's

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.sort_key: str = "age_s"
        self.sort_reverse: bool = True
        self.rows_data: list[dict[str, Any]] = []
        self.query_text = ""
        self.group_by: str | None = None
        self.spend: dict[str, dict[str, float]] = {}  # group field -> name -> USD

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
        self.show([])

    def watch_live(self, live: list[dict[str, Any]]) -> None:
        self.show(live)

    def watch_spend_reports(self, reports: dict[str, Any]) -> None:
        self.spend = {
            "api_key_name": spend_by(reports.get("api_key"), "api_key"),
            "end_user": spend_by(reports.get("end_user"), "end_user"),
        }
        self.show()

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
    # Newest first: {time, source, actor, field, old, new, reason}.
    entries: var[list[dict[str, Any]]] = var(list)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.border_title = "Config changes"

    def on_mount(self) -> None:
        for label in ("time", "source", "actor", "field", "old → new"):
            self.add_column(label, key=label)

    def watch_entries(self, entries: list[dict[str, Any]]) -> None:
        self.show(entries)

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
