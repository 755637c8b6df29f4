"""The yes / no question every action that changes something asks first, and how the action's
call to the daemon reports a failure (one way on every screen)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Static

from controlplane.client.admin import APIError, ClientError


def ask_first(screen: Screen, question: str, call: Callable[[], None]) -> None:
    """Push the confirmation over `screen`; `call` on yes."""

    def answered(yes: bool | None) -> None:
        if yes:
            call()

    screen.app.push_screen(ConfirmScreen(question), answered)


async def call_daemon(
    screen: Screen, fn: Callable[..., Awaitable[Any]], *args: Any
) -> tuple[bool, Any]:
    """(True, `await fn(*args)`), or (False, None) with the API's refusal or the unreachable
    daemon shown as an error notification on `screen`."""
    try:
        return True, await fn(*args)
    except APIError as exc:
        screen.notify(f"{exc.status}: {exc.message}", severity="error", timeout=6)
    except ClientError as exc:
        screen.notify(f"daemon unreachable: {exc}", severity="error", timeout=6)
    return False, None


class ConfirmScreen(ModalScreen[bool]):
    """Yes / no. Dismisses with True on yes."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box", classes="modal-box"):
            yield Static(self.question, id="confirm-question")
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)
