"""Fleet traffic without the admin token on the wire (torch-free: the CLI imports it).

The `instances` table says where each fleet member listens, but the database is no trust
boundary: anyone who can write a row could point it at a listener. So a fleet request (a fleet
change fanned out by a daemon, `controlplane fleet apply | drain | resume`) never carries the
admin token. It is signed instead:

  * the key is derived from the token (PBKDF2-HMAC-SHA256, fixed salt, KEY_ITERATIONS): a
    signature reveals neither the token nor the key, and guessing a weak token offline from
    one costs KEY_ITERATIONS hashes per guess;
  * the signature (HMAC-SHA256) covers the target instance id, method, path and query, the
    body's SHA-256, the time, a random nonce, the audit source and the change id;
  * the receiver checks it against each of its own tokens in constant time, checks that it
    is the instance named, that the time is within MAX_SKEW_S of its own and that the nonce
    is new (a replay cache), and accepts it only for the few routes fleet actions use, never
    for another fleet operation (no nesting);
  * it signs its answer over its own instance id, the request's nonce, the status and the
    body's SHA-256: the caller accepts an answer only from the instance the row names.

A listener at a forged row's URL gets a request bound to the forged id, usable nowhere else
and once only; its answer has no valid signature, so that instance is reported failed.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import quote, unquote

INSTANCE_HEADER = "X-Controlplane-Fleet-Instance"
TIME_HEADER = "X-Controlplane-Fleet-Time"
NONCE_HEADER = "X-Controlplane-Fleet-Nonce"
SIGNATURE_HEADER = "X-Controlplane-Fleet-Signature"
SOURCE_HEADER = "X-Controlplane-Source"  # the audit source a write says it came from
# The change id a fleet change carries to every instance (one id in every audit log).
CHANGE_ID_HEADER = "X-Controlplane-Change-Id"
KEY_SALT = b"controlplane-fleet"
KEY_ITERATIONS = 100_000
MAX_SKEW_S = 30.0
# Routes a signed request may reach: what fleet actions do on one instance, nothing else
# (not reads, not PATCH ?scope=fleet: a fleet operation never starts another).
SIGNED_ROUTES = frozenset(
    {("PATCH", "/admin/config"), ("POST", "/admin/drain"), ("POST", "/admin/resume")}
)
_NONCE_RE = re.compile(r"[0-9a-f]{32}")
_SIG_RE = re.compile(r"[0-9a-f]{64}")
_ID_RE = re.compile(r"[\x21-\x7e]{1,255}")  # printable ASCII, no spaces: a header value


@lru_cache(maxsize=16)
def fleet_key(token: str) -> bytes:
    """The signing key a token stands for (the token itself never leaves the process)."""
    return hashlib.pbkdf2_hmac("sha256", token.encode(), KEY_SALT, KEY_ITERATIONS)


def _sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def request_message(
    *,
    instance: str,
    method: str,
    path: str,
    body: bytes,
    at: str,
    nonce: str,
    source: str,
    change_id: str,
) -> bytes:
    parts = ("controlplane-fleet-request-v1", instance, method.upper(), path, _sha256(body))
    return "\n".join((*parts, at, nonce, source, change_id)).encode()


def response_message(*, instance: str, nonce: str, status: int, body: bytes) -> bytes:
    parts = ("controlplane-fleet-response-v1", instance, nonce, str(status), _sha256(body))
    return "\n".join(parts).encode()


def _mac(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Signer:
    """Signs requests to one instance and checks that its answers come from it."""

    key: bytes
    instance: str

    def headers(
        self, method: str, path: str, body: bytes, *, source: str = "", change_id: str = ""
    ) -> dict[str, str]:
        at, nonce = f"{time.time():.3f}", secrets.token_hex(16)
        message = request_message(
            instance=self.instance, method=method, path=path, body=body, at=at, nonce=nonce,
            source=source, change_id=change_id,
        )  # fmt: skip
        return {
            INSTANCE_HEADER: quote(self.instance, safe=""),
            TIME_HEADER: at,
            NONCE_HEADER: nonce,
            SIGNATURE_HEADER: _mac(self.key, message),
        }

    def answered_by_instance(self, nonce: str, status: int, headers, body: bytes) -> bool:
        """Whether an answer is signed by this instance for the request with `nonce`."""
        if unquote(str(headers.get(INSTANCE_HEADER, ""))) != self.instance:
            return False
        want = _mac(
            self.key,
            response_message(instance=self.instance, nonce=nonce, status=status, body=body),
        )
        return hmac.compare_digest(want, str(headers.get(SIGNATURE_HEADER, "")))


@dataclass(frozen=True, slots=True)
class Verified:
    """A signed request that checked out: which token signed it, the key to answer with."""

    index: int  # of the token that signed it
    key: bytes
    instance: str
    nonce: str


class Verifier:
    """The receiving side: one per daemon (its own tokens and instance id)."""

    def __init__(self, tokens: Sequence[str], instance: str, *, max_skew_s: float = MAX_SKEW_S):
        self._tokens = list(tokens)
        self._keys: list[bytes] | None = None  # derived on first use (PBKDF2 is slow on purpose)
        self.instance = instance
        self.max_skew_s = max_skew_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    @property
    def keys(self) -> list[bytes]:
        if self._keys is None:
            self._keys = [fleet_key(t) for t in self._tokens]
        return self._keys

    def check_headers(self, method: str, path: str, headers) -> str | None:
        """Why the request is refused by what needs no body (route, header shapes, time,
        instance), or None: checked before the body is read, so a made-up signature is
        refused without reading anything (the guard: controlplane.http.auth)."""
        if (method.upper(), path.split("?", 1)[0]) not in SIGNED_ROUTES:
            return f"{method} {path} does not take fleet signatures"
        instance = unquote(str(headers.get(INSTANCE_HEADER, "")))
        at, nonce = str(headers.get(TIME_HEADER, "")), str(headers.get(NONCE_HEADER, ""))
        given = str(headers.get(SIGNATURE_HEADER, ""))
        if not (_NONCE_RE.fullmatch(nonce) and _SIG_RE.fullmatch(given)):
            return "malformed fleet signature headers"
        try:
            when = float(at)
        except ValueError:
            return "malformed fleet time"
        if not math.isfinite(when) or abs(time.time() - when) > self.max_skew_s:
            return f"fleet time {at} is more than {self.max_skew_s:g} s from this clock"
        if not hmac.compare_digest(instance.encode(), self.instance.encode()):
            return f"signed for instance {instance!r}, this is {self.instance!r}"
        return None

    def verify(self, method: str, path: str, headers, body: bytes) -> Verified | str:
        """The signer, or why the request is refused (for the log, never the answer)."""
        early = self.check_headers(method, path, headers)
        if early is not None:
            return early
        instance = unquote(str(headers.get(INSTANCE_HEADER, "")))
        at, nonce = str(headers.get(TIME_HEADER, "")), str(headers.get(NONCE_HEADER, ""))
        given = str(headers.get(SIGNATURE_HEADER, ""))
        now = time.time()
        message = request_message(
            instance=instance, method=method, path=path, body=body, at=at, nonce=nonce,
            source=str(headers.get(SOURCE_HEADER, "")),
            change_id=str(headers.get(CHANGE_ID_HEADER, "")),
        )  # fmt: skip
        found = None
        for i, key in enumerate(self.keys):  # every key, so timing says nothing about which
            if hmac.compare_digest(_mac(key, message), given):
                found = i
        if found is None:
            return "fleet signature matches no admin token"
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "fleet nonce already used (a replay)"
            self._seen[nonce] = now + 2 * self.max_skew_s
        return Verified(found, self.keys[found], self.instance, nonce)


def sign_response(verified: Verified, status: int, body: bytes) -> list[tuple[bytes, bytes]]:
    """The headers that prove an answer comes from this instance, for this request."""
    mac = _mac(
        verified.key,
        response_message(
            instance=verified.instance, nonce=verified.nonce, status=status, body=body
        ),
    )
    return [
        (INSTANCE_HEADER.lower().encode(), quote(verified.instance, safe="").encode()),
        (SIGNATURE_HEADER.lower().encode(), mac.encode()),
    ]


def is_signed(headers) -> bool:
    """Whether a request claims a fleet signature (then it is judged by that alone)."""
    return headers.get(SIGNATURE_HEADER) is not None
