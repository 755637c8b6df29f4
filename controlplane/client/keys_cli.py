"""`controlplane keys list|create|update|rotate|revoke`: a running daemon's API keys table,
through its admin API (/admin/keys). A secret is printed once, on create and rotate: the daemon
keeps only its hash. Torch-free."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from controlplane.tenants.usage import SORTS  # stdlib only: the CLI stays light

DEFAULT_URL = "http://127.0.0.1:8000"
# Options that set a key's fields (create and update), as the admin API names them.
INT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "max_tokens_per_request",
    "priority_class",
)


def _fields(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name in (*INT_FIELDS, "budget_usd", "budget_period", "budget_action", "owner"):
        value = getattr(args, name, None)
        if value is not None:
            body[name] = value
    if args.expires_at is not None:
        body["expires_at"] = None if args.expires_at == "never" else args.expires_at
    if args.allowed_models is not None:
        models = [m for m in args.allowed_models.split(",") if m]
        body["allowed_models"] = models or None  # "": every model
    return body


def _call(args: argparse.Namespace, method: str, *call_args: Any) -> dict[str, Any] | None:
    import asyncio

    from controlplane.client.admin import AdminClient, ClientError
    from controlplane.client.token import resolve_token

    async def call() -> dict[str, Any]:
        client = AdminClient(args.url, resolve_token(args.token), source="api")
        try:
            return await getattr(client, method)(*call_args)
        finally:
            await client.aclose()

    try:
        return asyncio.run(call())
    except ClientError as exc:
        print(f"controlplane keys {args.keys_command}: {args.url}: {exc}", file=sys.stderr)
        return None


def _show(key: dict[str, Any]) -> str:
    limits = {k: v for k, v in (key.get("limits") or {}).items() if v is not None}
    budget = key.get("budget") or {}
    parts = [
        f"{key['name']:<24}",
        f"{key.get('prefix') or '-':<9}",
        f"{key.get('state') or key.get('source'):<8}",
        f"owner={key.get('owner') or '-'}",
    ]
    if key.get("suspended"):
        parts.append("suspended")
    if key.get("expires_at"):
        parts.append(f"expires={key['expires_at']}")
    if key.get("allowed_models") is not None:
        parts.append("models=" + ",".join(key["allowed_models"]))
    parts += [f"{k}={v}" for k, v in limits.items()]
    if budget.get("budget_usd") is not None:
        parts.append(
            f"budget=${budget['budget_usd']:g}/{budget.get('budget_period') or 'month'}"
            f" ({budget.get('budget_action') or 'reject'})"
        )
    if budget.get("spend_usd") is not None:  # GET /admin/keys: this period's spend
        use = budget.get("use")
        shown = "" if use is None else f" ({use:.0%})"
        parts.append(f"spent=${budget['spend_usd']:.6g}{shown} {budget.get('state')}")
    if key.get("priority_class"):
        parts.append(f"priority_class={key['priority_class']}")
    usage = key.get("usage")
    if usage is not None:  # GET /admin/keys: this daemon's live figures
        share = usage.get("share")
        parts.append(
            f"rpm={usage['requests_per_minute']} tpm={usage['tokens_per_minute']} "
            f"share={'-' if share is None else f'{share:.0%}'} in_flight={usage['in_flight']} "
            f"throttled={usage['throttled_total']} ({usage['throttled_last_minute']} last min)"
        )
        by_reason = usage.get("throttled") or {}
        if by_reason:
            parts.append(",".join(f"{r}:{n}" for r, n in sorted(by_reason.items())))
    return "  ".join(parts)


def _list(args: argparse.Namespace) -> int:
    answer = _call(args, "keys", args.sort)
    if answer is None:
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    for key in answer.get("keys", []):
        print(_show(key))
    return 0


def _secret(answer: dict[str, Any], what: str) -> int:
    print(_show(answer))
    print(f"secret ({what}; shown this once, only its hash is kept): {answer['secret']}")
    return 0


def _create(args: argparse.Namespace) -> int:
    answer = _call(args, "create_key", {"name": args.name, **_fields(args)})
    return 1 if answer is None else _secret(answer, "new key")


def _update(args: argparse.Namespace) -> int:
    body = _fields(args)
    if not body:
        print("controlplane keys update: nothing to change (see --help)", file=sys.stderr)
        return 2
    answer = _call(args, "update_key", args.name, body)
    if answer is None:
        return 1
    print(_show(answer))
    return 0


def _rotate(args: argparse.Namespace) -> int:
    answer = _call(args, "rotate_key", args.name)
    return 1 if answer is None else _secret(answer, "rotated: the old secret no longer works")


def _revoke(args: argparse.Namespace) -> int:
    answer = _call(args, "revoke_key", args.name)
    if answer is None:
        return 1
    print(_show(answer) + ("" if answer.get("changed") else "  (was revoked already)"))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"daemon URL (default {DEFAULT_URL})")
    p.add_argument(
        "--token",
        help="admin token (default: CONTROLPLANE_ADMIN_TOKEN, else <data_dir>/admin_token with "
        "data_dir from CONTROLPLANE_DATA_DIR, default data)",
    )


def _key_fields(p: argparse.ArgumentParser) -> None:
    for name in INT_FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, metavar="N")
    p.add_argument("--budget-usd", dest="budget_usd", type=float, metavar="USD")
    p.add_argument("--budget-period", dest="budget_period", choices=("day", "month"))
    p.add_argument("--budget-action", dest="budget_action", choices=("reject", "deprioritize"))
    p.add_argument("--owner")
    p.add_argument(
        "--expires-at",
        dest="expires_at",
        metavar="TIME",
        help="ISO date or date-time (UTC unless it has an offset); never: no expiry",
    )
    p.add_argument(
        "--allowed-models",
        dest="allowed_models",
        metavar="M1,M2",
        help="comma-separated model names; an empty string: every model",
    )


def add_keys_parser(subparsers: Any) -> None:
    """Register `controlplane keys` and its subcommands."""
    keys = subparsers.add_parser(
        "keys", help="a running daemon's API keys table: list, create, update, rotate, revoke"
    )
    sub = keys.add_subparsers(dest="keys_command", required=True)
    p = sub.add_parser("list", help="every API key (never a secret)")
    p.add_argument("--json", action="store_true", help="the admin API's answer as JSON")
    p.add_argument(
        "--sort",
        choices=SORTS,
        default="worst",
        help="order (highest first; name: A to Z). worst: most refused in the last minute, "
        "then the largest share of the engine's tokens, then the most of its budget used",
    )
    _common(p)
    p.set_defaults(func=_list)
    p = sub.add_parser("create", help="create a key; prints its secret once")
    p.add_argument("name")
    _key_fields(p)
    _common(p)
    p.set_defaults(func=_create)
    p = sub.add_parser("update", help="change a key's limits, budget, expiry, models, owner")
    p.add_argument("name")
    _key_fields(p)
    _common(p)
    p.set_defaults(func=_update)
    p = sub.add_parser("rotate", help="a new secret, printed once; the old one stops")
    p.add_argument("name")
    _common(p)
    p.set_defaults(func=_rotate)
    p = sub.add_parser("revoke", help="revoke a key on every daemon sharing the database")
    p.add_argument("name")
    _common(p)
    p.set_defaults(func=_revoke)
