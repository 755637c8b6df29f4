"""Acting on the fleet through each instance's own admin API: one config change everywhere
(two phases, all or nothing on validation), drain and resume. Torch-free: `controlplane fleet`
and a daemon coordinating `PATCH /admin/config?scope=fleet` both use it.

A fleet change
  1. takes the live instances from SQL (serving and draining: a drained one resumes with the
     fleet's settings); unreachable and loading ones are reported, never silently skipped;
  2. asks every target to validate the change (`PATCH ?dry_run=true`); if any refuses it or
     cannot be asked, none applies;
  3. applies it on every target with one change id, which each instance writes on its own
     audit rows (source "fleet").
A target that fails between 2 and 3 (it died, or a concurrent change made this one invalid)
is reported as failed: the others keep the change, as an operator would want in a fleet that
must converge, and the exit status says it is partial.

No request carries the admin token: each is signed for the instance its row names, and an
answer counts only if that instance signed it (controlplane.http.signing). A row whose URL is
not a plain http(s) URL (a query, a fragment, another scheme) is never asked: it fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from controlplane.client.admin import AdminClient, APIError, ClientError, Unreachable
from controlplane.common import check_url
from controlplane.errors import FieldError
from controlplane.fleet.registry import DRAINING, LOADING, SERVING, UNREACHABLE, Member
from controlplane.http.signing import Signer, fleet_key

TARGET_STATES = (SERVING, DRAINING)
# Outcomes, per instance.
APPLIED, NOT_APPLIED, INVALID, FAILED, SKIPPED = (
    "applied",
    "not_applied",
    "invalid",
    "failed",
    "skipped",
)


@dataclass(slots=True)
class Outcome:
    instance: str
    url: str
    outcome: str  # one of the outcomes above, or "unreachable"
    detail: str | None = None  # why, for anything but applied
    param: str | None = None  # the field an instance refused
    changed: list[dict[str, Any]] | None = None  # [{"field", "old", "new"}] where applied


@dataclass(slots=True)
class FleetChange:
    change_id: str
    applied: bool  # on every target
    instances: list[Outcome] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        """Some instance does not have the change: unreachable, skipped or failed."""
        return any(o.outcome != APPLIED for o in self.instances)

    def to_dict(self) -> dict[str, Any]:
        return {
            "change_id": self.change_id,
            "applied": self.applied,
            "instances": [dataclasses.asdict(o) for o in self.instances],
        }


def _not_targeted(m: Member) -> Outcome:
    if m.state == UNREACHABLE:
        since = m.unreachable_since.isoformat() if m.unreachable_since else "?"
        return Outcome(
            m.id, m.advertise_url, UNREACHABLE, f"no heartbeat; unreachable since {since}"
        )
    return Outcome(m.id, m.advertise_url, SKIPPED, f"state {m.state}: not serving yet")


def _failure(m: Member, exc: Exception, refused: str) -> Outcome:
    if isinstance(exc, APIError) and 400 <= exc.status < 500 and exc.status != 401:
        return Outcome(m.id, m.advertise_url, refused, exc.message, exc.param)
    kind = UNREACHABLE if isinstance(exc, Unreachable) else FAILED
    return Outcome(m.id, m.advertise_url, kind, str(exc))


class _Refused(ClientError):
    """A target that is not asked at all: its URL, or no token to sign with."""


def fleet_client(member: Member, token: str | None, *, timeout: float = 10.0) -> AdminClient:
    """A client for one instance that signs for `member.id` and sends no token; _Refused
    (a ClientError) where its URL is no plain http(s) URL or there is no token."""
    try:
        url = check_url(member.advertise_url)
    except ValueError as exc:
        raise _Refused(f"not asked: {exc}") from None
    if not token:
        raise _Refused("not asked: no admin token to sign the request with")
    signer = Signer(fleet_key(token), member.id)
    return AdminClient(url, None, timeout=timeout, source="fleet", signer=signer)


async def _ask(client: AdminClient | ClientError, call: Any) -> Any:
    if isinstance(client, ClientError):
        raise client
    return await call(client)


async def apply_change(
    members: Sequence[Member],
    changes: dict[str, Any],
    token: str | None,
    *,
    change_id: str | None = None,
    timeout: float = 10.0,
) -> FleetChange:
    """Apply `changes` (dotted or nested fields) to every live instance, all or nothing on
    validation; see the module docstring."""
    change_id = change_id or uuid.uuid4().hex
    targets = [m for m in members if m.state in TARGET_STATES]
    others = [_not_targeted(m) for m in members if m.state in (UNREACHABLE, LOADING)]
    if not targets:
        return FleetChange(change_id, False, others)
    if token:
        await asyncio.to_thread(fleet_key, token)  # PBKDF2 (cached): off the event loop
    clients: list[AdminClient | ClientError] = []
    for m in targets:
        try:
            clients.append(fleet_client(m, token, timeout=timeout))
        except ClientError as exc:
            clients.append(exc)

    def dry(c: AdminClient) -> Any:
        return c.patch_config(changes, dry_run=True)

    def real(c: AdminClient) -> Any:
        return c.patch_config(changes, change_id=change_id)

    try:
        checked = await asyncio.gather(*(_ask(c, dry) for c in clients), return_exceptions=True)
        if any(isinstance(r, BaseException) for r in checked):
            outcomes = [
                _failure(m, r, INVALID)
                if isinstance(r, Exception)
                else Outcome(m.id, m.advertise_url, NOT_APPLIED, "another instance refused it")
                for m, r in zip(targets, checked, strict=True)
            ]
            return FleetChange(change_id, False, outcomes + others)
        done = await asyncio.gather(*(_ask(c, real) for c in clients), return_exceptions=True)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients if isinstance(c, AdminClient)))
    outcomes = [
        _failure(m, r, FAILED)
        if isinstance(r, Exception)
        else Outcome(m.id, m.advertise_url, APPLIED, changed=r.get("changed"))
        for m, r in zip(targets, done, strict=True)
    ]
    applied = all(o.outcome == APPLIED for o in outcomes)
    return FleetChange(change_id, applied, outcomes + others)


def fleet_status(result: FleetChange) -> int:
    """The HTTP status of a fleet change: 200 applied on every live instance (unreachable ones
    listed in the body), 422 an instance refused it (none applied), 503 an instance could not
    be asked or none is serving (none applied), 502 applied on only some."""
    if result.applied:
        return 200
    if any(o.outcome == INVALID for o in result.instances):
        return 422
    if any(o.outcome == APPLIED for o in result.instances):
        return 502
    return 503


def fleet_summary(result: FleetChange) -> str:
    """One line for an operator: what happened and, where it did not apply, why."""
    if not result.instances:
        return "no instances in the fleet: nothing applied"
    applied = sum(o.outcome == APPLIED for o in result.instances)
    if result.applied:
        head = f"change {result.change_id} applied on {applied} instance(s)"
    elif applied:
        head = f"change {result.change_id} applied on only {applied} instance(s)"
    elif all(o.outcome in (UNREACHABLE, SKIPPED) for o in result.instances):
        head = "no instance is serving: nothing applied"
    else:
        head = f"change {result.change_id} applied on no instance"
    bad = [o for o in result.instances if o.outcome not in (APPLIED, NOT_APPLIED)]
    why = "; ".join(
        f"{o.instance} {o.outcome} ({o.param + ': ' if o.param else ''}{o.detail})" for o in bad
    )
    return f"{head}; {why}" if why else head


def find_member(members: Sequence[Member], name: str) -> Member:
    """The instance `name` is the id of (or an unambiguous prefix of an id, or its URL);
    LookupError naming the candidates otherwise."""
    exact = [m for m in members if name in (m.id, m.advertise_url.rstrip("/"))]
    if exact:
        return exact[0]
    found = [m for m in members if m.id.startswith(name)]
    if len(found) == 1:
        return found[0]
    ids = ", ".join(m.id for m in (found or members)) or "none"
    what = "matches several instances" if found else "is no instance in the fleet"
    raise LookupError(f"instance: {name!r} {what} (instances: {ids})")


async def set_admission(member: Member, token: str | None, action: str) -> dict[str, Any]:
    """POST /admin/drain or /admin/resume on one instance; its answer ({"state": ...})."""
    if action not in ("drain", "resume"):
        raise FieldError("action", f"must be drain or resume, got {action!r}")
    client = fleet_client(member, token)
    try:
        return await (client.drain() if action == "drain" else client.resume())
    finally:
        await client.aclose()
