"""The `:` commands in Textual's command palette (ctrl+p): each command with what it does,
found by fuzzy search. A command typed whole with its argument (`cost 10m`) runs as typed; one
that needs an argument and has none opens the `:` prompt with its name, for the argument."""

from __future__ import annotations

from functools import partial
from typing import Any

from textual.command import DiscoveryHit, Hit, Hits, Provider

from controlplane.tui.commands import COMMANDS, CommandError, parse


def needs_argument(name: str) -> bool:
    spec = COMMANDS[name][0]
    return bool(spec) and not spec.startswith("[")


class DashboardCommands(Provider):
    """Registered on the dashboard screen (`COMMANDS`): the palette lists these while the
    dashboard is the screen it was opened from."""

    def _run(self, text: str) -> None:
        screen: Any = self.screen
        screen.run_command(text)

    def _ask(self, name: str) -> None:
        screen: Any = self.screen
        screen.open_prompt("command", f"{name} ")

    def _hit_for(self, name: str) -> Any:
        """What choosing `name` does: run it, or ask for its argument."""
        return partial(self._ask, name) if needs_argument(name) else partial(self._run, name)

    async def discover(self) -> Hits:
        for name, (arg, about) in COMMANDS.items():
            yield DiscoveryHit(f":{name} {arg}".rstrip(), self._hit_for(name), help=about)

    async def search(self, query: str) -> Hits:
        typed = query.strip().removeprefix(":").strip()
        try:
            command = parse(typed)
        except CommandError:
            command = None
        if command is not None and command.arg:  # whole, with its argument: run as typed
            about = COMMANDS[command.name][1]
            yield Hit(1.0, f":{typed}", partial(self._run, typed), help=about)
        matcher = self.matcher(query.strip())
        for name, (arg, about) in COMMANDS.items():
            shown = f":{name} {arg}".rstrip()
            score = matcher.match(shown)
            if score > 0:
                yield Hit(score, matcher.highlight(shown), self._hit_for(name), help=about)
