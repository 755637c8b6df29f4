"""`:` command mode: the dashboard's actions by name, for an operator who would rather type
than remember a key (and for the ones with an argument: a key name, a cost window)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# name -> (argument, what it does); the help screen lists them in this order.
COMMANDS: dict[str, tuple[str, str]] = {
    "drain": ("", "stop admitting new requests (running ones finish)"),
    "resume": ("", "admit new requests again"),
    "tune": ("", "open the tuning form"),
    "abort-key": ("KEY", "abort every live request of API key KEY"),
    "suspend": ("KEY", "suspend API key KEY: its new requests get 403 (audited)"),
    "unsuspend": ("KEY", "serve API key KEY again"),
    "filter": ("[TEXT]", "filter the requests table (key:NAME user:NAME state:S); none clears"),
    "group": ("key|user|none", "group the requests table by API key or end user"),
    "cost": ("WINDOW", "the cost panel's window: 5m to 24h (e.g. 10m, 1h, 6h)"),
    "scope": ("instance|fleet", "cost panel: this daemon's requests or the whole fleet's"),
    "save": ("", "write the live values to the daemon's config file (survive a restart)"),
    "autopilot": ("", "the autopilot's decisions, holds and pins"),
    "keys": ("", "the tenants: API keys' live usage, worst first; create, rotate, revoke, change"),
    "fleet": ("", "the fleet screen"),
    "help": ("", "keys, colours and what each number means"),
    "quit": ("", "leave the dashboard"),
}
WINDOW = re.compile(r"^(\d+)([mh])$")
MIN_WINDOW_S, MAX_WINDOW_S = 5 * 60, 24 * 3600


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""


class CommandError(ValueError):
    pass


def window_seconds(text: str) -> int:
    """`10m` / `6h` -> seconds, within 5 minutes and 24 hours; an error says the limits."""
    m = WINDOW.match(text.strip().lower())
    if not m:
        raise CommandError(f"cost window {text!r}: write minutes or hours, e.g. 10m or 6h")
    seconds = int(m.group(1)) * (60 if m.group(2) == "m" else 3600)
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise CommandError(f"cost window {text!r}: must be between 5m and 24h")
    return seconds


def parse(text: str) -> Command:
    """`abort-key bad-tenant` -> Command("abort-key", "bad-tenant"); errors name the problem
    and what would be right."""
    name, _, arg = text.strip().partition(" ")
    name, arg = name.lower(), arg.strip()
    if name not in COMMANDS:
        near = [c for c in COMMANDS if c.startswith(name[:2])] if name else []
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise CommandError(f"unknown command {name!r}{hint}; ? lists them")
    spec = COMMANDS[name][0]
    if spec and not spec.startswith("[") and not arg:
        raise CommandError(f":{name} needs {spec}")
    if not spec and arg:
        raise CommandError(f":{name} takes no argument")
    if name == "cost":
        window_seconds(arg)
    if name == "group" and arg not in ("key", "user", "none"):
        raise CommandError(":group takes key, user or none")
    if name == "scope" and arg not in ("instance", "fleet"):
        raise CommandError(":scope takes instance or fleet")
    return Command(name, arg)
