"""`controlplane config save`: write a running daemon's live values into its config file,
through its admin API (POST /admin/config/save). Torch-free."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


def _save(args: argparse.Namespace) -> int:
    import asyncio

    from controlplane.client.admin import AdminClient, ClientError
    from controlplane.client.token import resolve_token

    async def call() -> dict[str, Any]:
        client = AdminClient(args.url, resolve_token(args.token), source="api")
        try:
            return await client.save_config()
        finally:
            await client.aclose()

    try:
        answer = asyncio.run(call())
    except ClientError as exc:
        print(f"controlplane config save: {args.url}: {exc}", file=sys.stderr)
        return 1
    saved = answer.get("saved") or []
    if not saved:
        print(f"{answer.get('path')}: already has every live value, nothing to save")
        return 0
    print(f"{answer.get('path')}: saved {len(saved)} live value{'s' if len(saved) > 1 else ''}")
    for item in saved:
        print(f"  {item['field']} = {json.dumps(item['value'])}")
    return 0


def add_config_parser(subparsers: Any) -> None:
    """Register `controlplane config` (its one subcommand: `save`)."""
    config = subparsers.add_parser("config", help="a running daemon's config file")
    sub = config.add_subparsers(dest="config_command", required=True)
    save = sub.add_parser(
        "save",
        help="write the daemon's live values into the config file it was started with "
        "(comments kept; audited), so that a restart keeps them",
    )
    save.add_argument("--url", default=DEFAULT_URL, help=f"daemon URL (default {DEFAULT_URL})")
    save.add_argument(
        "--token",
        help="admin token (default: CONTROLPLANE_ADMIN_TOKEN, else <data_dir>/admin_token with "
        "data_dir from CONTROLPLANE_DATA_DIR, default data)",
    )
    save.set_defaults(func=_save)
