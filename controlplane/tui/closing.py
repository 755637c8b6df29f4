"""Screens that stop their own work the moment they close.

Textual removes a closed screen's widgets first and cancels the screen's workers only at its
unmount, after them: a worker resuming in between (an HTTP answer arriving) queries a widget
already gone, and the app fails with NoMatches (the tuning form's simulator, CI at stop 66).
A closing screen is told before its removal (ScreenSuspend, queued ahead of it): its workers
are cancelled there, while its widgets are whole. A screen merely covered by another (help on
top of it) is still on the stack and keeps them."""

from __future__ import annotations

from typing import Any

from textual.screen import Screen


class StopsWorkersOnClose:
    """Mix into a Screen (first among its bases) whose workers write to its widgets."""

    def _on_screen_suspend(self: Screen[Any]) -> None:
        if self not in self.app.screen_stack:
            self.workers.cancel_node(self)
