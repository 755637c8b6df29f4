"""`controlplane tui`: a terminal dashboard for on-call operators (Textual, admin API only).

Importing this package is cheap: Textual and httpx are imported when the command runs."""

from __future__ import annotations

import argparse
from typing import Any

# Where the token comes from is the admin client's concern (the fleet CLI and `config save`
# resolve it the same way); kept importable from here.
from controlplane.client.token import resolve_token

DEFAULT_URL = "http://127.0.0.1:8000"


def _cmd_tui(args: argparse.Namespace) -> int:
    from controlplane.tui.dashboard_app import DashboardApp

    DashboardApp(args.url, resolve_token(args.token), fleet=args.fleet).run()
    return 0


def add_tui_parser(subparsers: Any) -> None:
    """Register the `tui` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "tui",
        help="terminal dashboard for on-call operators (talks to the admin API)",
        description="Live dashboard of a running daemon: throughput, batch, KV cache, latency, "
        "cost, live requests and config changes; tune, abort, drain and resume; the fleet of "
        "daemons on the same database (f, or --fleet). Token: --token, "
        "CONTROLPLANE_ADMIN_TOKEN, or <data_dir>/admin_token (one token for the whole fleet).",
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"daemon URL (default {DEFAULT_URL})")
    p.add_argument("--token", help="admin token (default: env or token file)")
    p.add_argument(
        "--fleet",
        action="store_true",
        help="open on the fleet screen: every daemon sharing this one's database, worst first",
    )
    p.set_defaults(func=_cmd_tui)
