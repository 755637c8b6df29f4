"""The one-line prompt above the footer: `/` filters the requests table as you type, `:` runs a
command on Enter (completing command names as you type); Escape closes it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.reactive import var
from textual.suggester import SuggestFromList
from textual.widgets import Input, Static

PLACEHOLDERS = {
    "filter": "filter: key:NAME user:NAME state:waiting or any word (enter keeps, esc undoes)",
    "command": "drain, resume, tune, abort-key KEY, suspend KEY, cost 10m, save, help (enter)",
}


class PromptInput(Input):
    """What is typed. Escape posts `Cancelled` (its screen undoes a filter edit)."""

    # Shown in the footer while the prompt is open: the way out, not the dashboard's keys.
    BINDINGS: ClassVar[list[Binding]] = [Binding("escape", "cancel", "Close")]

    class Cancelled(Message):
        """Escape in the prompt."""

    def action_cancel(self) -> None:
        self.post_message(self.Cancelled())

    def check_consume_key(self, key: str, character: str | None) -> bool:
        # Textual finds no character for the key named "slash", so the footer went on offering
        # `/ Filter` while `/` was being typed into the prompt.
        return key == "slash" or super().check_consume_key(key, character)


class PromptBar(Horizontal):
    """The prompt's row: the mode (`:` or `/`), then what is typed, as in vi or less. `mode`
    is "" while closed (the row is hidden), else "filter" or "command"."""

    mode: var[str] = var("")

    def __init__(self, commands: Iterable[str], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.mark = Static(id="prompt-mode")
        self.input = PromptInput(id="prompt")
        # `:d` shows `rain` ahead of the cursor; the right arrow takes it.
        self.command_names = SuggestFromList(list(commands), case_sensitive=False)

    def compose(self) -> ComposeResult:
        yield self.mark
        yield self.input

    def open(self, mode: str, value: str = "") -> None:
        self.input.placeholder = PLACEHOLDERS[mode]
        self.input.suggester = self.command_names if mode == "command" else None
        self.input.value = value
        self.mode = mode
        self.input.focus()

    def close(self) -> None:
        self.mode = ""

    def watch_mode(self, mode: str) -> None:
        self.set_class(not mode, "-hidden")
        self.mark.update("/" if mode == "filter" else ":" if mode else "")
