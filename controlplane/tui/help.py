"""`?`: the keys, built from the bindings themselves (each binding's tooltip says what it does),
then what the colours and numbers mean."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

# After the keys on the dashboard's help (Rich markup).
DASHBOARD_NOTES = """[b]Navigation[/]
  The diagnosis line, the signals and the live requests come first; scroll (or tab) for the
  detail panels and the change history. At 140 columns and more everything fits one screen.

[b]Colours[/]
  [green]green[/] within its threshold, [bold yellow]yellow[/] past the warning level,
  [bold reverse red]red[/] past the critical one. The daemon sends its thresholds: the
  [b]\\[alerts][/] section of its config, or, for TTFT / ITL p99, warn at 80% and crit at 100%
  of the autopilot's target when one is set. Dimmed panels and STALE in the header: the
  daemon is not answering and the numbers are the last it sent, as old as the header says.

[b]What the numbers mean[/]
  in / out        requests arriving / finishing per second over the last 10 s; best: the
                  highest completion rate of the last 15 min (in above it: overloaded)
  rej / fail      answered 429 (queue full, limits) or 503 (draining, loading) / ended in an
                  error, per second over 10 s
  queue a/b       requests waiting for the engine / server.max_queue_len (429 beyond it);
                  oldest: how long the oldest of them has waited
  prefill/decode  median step time of steps carrying prompt tokens / of decode-only steps
  TTFT / ITL p99  time to first token and between tokens, 99th percentile over 60 s, and
                  over 10 s in brackets (a fix shows there within seconds)
  SLO             share of the last 60 s's requests that met every target; red: a p99 misses
  trends          the last 15 min, one cell per interval, its highest value
  KV              share of KV-cache blocks in use; spend: list price over the cost window

[b]Fleet order[/]
  worst first: unreachable, then missing their SLO, then the most waiting requests and the
  oldest wait, then the fullest KV cache.

"""


def help_rows(
    bindings: Iterable[Binding], display: Callable[[Binding], str]
) -> list[tuple[str, str]]:
    """(keys, what they do), one row per binding that has a tooltip, in the bindings' order;
    neighbours sharing a tooltip share a row: `s / u`, `j k g G`, `1 .. 8`. `display` names a
    key as the footer does (App.get_key_display)."""
    rows: list[tuple[list[str], str]] = []
    for binding in bindings:
        if not binding.tooltip:
            continue
        keys = [
            binding.key_display or display(Binding(key.strip(), binding.action))
            for key in binding.key.split(",")
        ]
        if rows and rows[-1][1] == binding.tooltip:
            rows[-1][0].extend(keys)
        else:
            rows.append((keys, binding.tooltip))
    return [(_join(keys), text) for keys, text in rows]


def _join(keys: list[str]) -> str:
    if len(keys) <= 2:
        return " / ".join(keys)
    if all(k.isdigit() for k in keys):
        return f"{keys[0]} .. {keys[-1]}"
    return " ".join(keys)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, keys: list[tuple[str, str]], more: str = "") -> None:
        super().__init__()
        self.keys = keys
        self.more = more  # further sections (Rich markup), after the keys

    def compose(self) -> ComposeResult:
        lines = "\n".join(f"  [b]{k:<10}[/] {d}" for k, d in self.keys)
        with VerticalScroll(id="help-box", classes="modal-box"):
            yield Static(f"[b]Keys[/]\n{lines}\n\n{self.more}[dim]escape closes[/]", id="help-text")

    def action_close(self) -> None:
        self.dismiss(None)
