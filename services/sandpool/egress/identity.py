"""Who a connection comes from: the sandbox's credential, the session it is bound to, its share of connections.

The credential is the password of `Proxy-Authorization: Basic base64(user:credential)`,
which every common client sends for a proxy URL `http://user:credential@host:port`
(the user part is ignored). It is looked up in Redis (`EgressStore.binding`) and
forgotten: what stays in memory is its digest, under which the sandbox's open
connections are counted (and its workspace's, under the workspace's name).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

from sandpool.contract.limits import MAX_EGRESS_CONNECTIONS, combine
from sandpool.contract.reasons import EgressRefusal
from sandpool.egress.http import Refusal, RequestHead
from sandpool.state.egress import EgressBinding, EgressStore
from sandpool.state.errors import StateError
from sandpool.state.keys import egress_digest

CREDENTIAL = re.compile(r"^[\x21-\x7e]{16,256}$")
"""What a credential may look like (anything else is refused before Redis is asked)."""
CHALLENGE = {"Proxy-Authenticate": 'Basic realm="sandpool egress"'}


def refused(reason: EgressRefusal, what: str) -> Refusal:
    """A 407 with the challenge that makes clients send the credential."""
    return Refusal(reason, what, headers=CHALLENGE)


def credential_of(head: RequestHead) -> str:
    """The credential a request carries, or a 407 saying what is wrong with it."""
    values = head.values("proxy-authorization")
    if not values:
        raise refused(EgressRefusal.NO_CREDENTIAL, "no proxy credential (the sandbox's proxy URL carries it)")
    scheme, _, encoded = values[0].partition(" ")
    if len(values) > 1 or scheme.lower() != "basic":
        raise refused(EgressRefusal.BAD_CREDENTIAL, "malformed proxy credential (expected Basic)")
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise refused(EgressRefusal.BAD_CREDENTIAL, "malformed proxy credential (expected Basic)") from None
    credential = decoded.partition(":")[2]
    if not CREDENTIAL.match(credential):
        raise refused(EgressRefusal.BAD_CREDENTIAL, "malformed proxy credential")
    return credential


@dataclass(frozen=True)
class Caller:
    """Who is asking: the bound session, and the key its connections are counted under."""

    binding: EgressBinding
    slot: str


async def identify(store: EgressStore, head: RequestHead) -> Caller:
    """The live session the request's credential is bound to; 407 when none, 503 when Redis cannot say.
    `StateError` is re-raised as the 503 `Refusal` (the caller counts it)."""
    credential = credential_of(head)
    try:
        binding = await store.binding(credential)
    except StateError:
        raise Refusal(EgressRefusal.UNAVAILABLE, "cannot check the credential now, retry later",
                      headers={"Retry-After": "1"}) from None
    if binding is None:
        raise refused(EgressRefusal.UNKNOWN_CREDENTIAL, "proxy credential unknown, revoked, or its session has ended")
    return Caller(binding, egress_digest(credential))


class Shares:
    """Open connections per sandbox and per workspace, each bounded (429 above either): one sandbox cannot
    take its workspace's share, nor one workspace the proxy's. The workspace's bound is its policy's
    `max_egress_connections` (as its session's lease recorded it) within the operator's ceiling."""

    def __init__(self, per_sandbox: int, per_workspace: int) -> None:
        self.per_sandbox = per_sandbox
        self.per_workspace = per_workspace
        self.held: dict[str, int] = {}  # by credential digest
        self.by_workspace: dict[str, int] = {}

    @contextlib.contextmanager
    def take(self, caller: Caller) -> Iterator[Caller]:
        held = self.held.get(caller.slot, 0)
        if held >= self.per_sandbox:
            raise Refusal(EgressRefusal.TOO_MANY_CONNECTIONS,
                          f"this sandbox already holds {held} connections (the most allowed)", status=429,
                          headers={"Retry-After": "1"})
        workspace = caller.binding.workspace
        together = self.by_workspace.get(workspace, 0)
        if together >= combine(caller.binding.max_egress_connections, self.per_workspace):
            raise Refusal(EgressRefusal.TOO_MANY_WORKSPACE_CONNECTIONS,
                          f"this workspace's sandboxes already hold {together} connections, the most allowed "
                          f"(workspace policy {MAX_EGRESS_CONNECTIONS}, within the operator setting "
                          "max_connections_per_workspace)", headers={"Retry-After": "1"})
        _count(self.held, caller.slot, 1)
        _count(self.by_workspace, workspace, 1)
        try:
            yield caller
        finally:
            _count(self.held, caller.slot, -1)
            _count(self.by_workspace, workspace, -1)


def _count(counts: dict[str, int], key: str, step: int) -> None:
    """Add `step` to a count, dropping it at zero (the maps hold only what is open)."""
    left = counts.get(key, 0) + step
    if left:
        counts[key] = left
    else:
        del counts[key]
