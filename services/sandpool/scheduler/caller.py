"""Who is calling: the workspace and its policy, from the proxy's injected headers.

Multi-tenant mode fails closed: without the internal credential, without a
valid workspace, or without the header of any limit the catalogue
(`contract/limits.py`) says the scheduler enforces, the request is refused; it
is never given a placeholder tenant or "no limit". The one list among them,
the egress allow-list, is comma-separated (empty: no egress). Standalone mode
has exactly one workspace, no policy headers (any `X-Sandpool-*` a standalone
client sends is ignored) and no egress allow-list of its own.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.datastructures import Headers

from sandpool.contract import limits as catalogue
from sandpool.contract import tenancy
from sandpool.contract.reasons import Reason
from sandpool.core.errors import Forbidden, Unauthorized
from sandpool.scheduler.limits import NO_POLICY, WorkspacePolicy


class TenancyMissing(Forbidden):
    reason = Reason.TENANCY_MISSING


class TenancyInvalid(Forbidden):
    reason = Reason.TENANCY_INVALID


@dataclass(frozen=True)
class Caller:
    workspace: str
    policy: WorkspacePolicy
    egress_allow: tuple[str, ...] = ()
    """The workspace's egress allow-list (bound to a new session's sandbox by the lease); empty: none."""


STANDALONE = Caller(workspace=tenancy.STANDALONE_WORKSPACE, policy=NO_POLICY)

def _required(headers: Headers, name: str) -> str:
    raw = headers.get(name)
    if raw is None:
        raise TenancyMissing(f"{name} is required (the proxy sends every limit it forwards; 0 or empty: none)")
    return raw


def _policy_value(headers: Headers, name: str) -> int:
    raw = _required(headers, name).strip()
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
        raise TenancyInvalid(f"{name} must be a non-negative integer")
    return int(raw)


class CallerResolver:
    """Turns a request's headers into a `Caller`, or refuses it."""

    def __init__(self, internal_token: str | None) -> None:
        self._expected = None if internal_token is None else f"Bearer {internal_token}".encode()
        self._counts = tuple((limit.name, limit.header) for limit in catalogue.counts(catalogue.forwarded())
                             if limit.header is not None)
        """(name, header) of each count the proxy injects: the header named once, not on every call."""

    @property
    def standalone(self) -> bool:
        return self._expected is None

    def __call__(self, headers: Headers) -> Caller:
        if self._expected is None:
            return STANDALONE
        given = headers.get("authorization")
        if given is None:
            raise Unauthorized("the internal credential is required")
        if not hmac.compare_digest(given.encode("latin-1", "replace"), self._expected):
            raise Unauthorized("the internal credential was rejected")
        workspace = headers.get(tenancy.WORKSPACE)
        if workspace is None:
            raise TenancyMissing(f"{tenancy.WORKSPACE} is required")
        if not tenancy.is_valid_workspace(workspace):
            raise TenancyInvalid(f"{tenancy.WORKSPACE} is not a valid workspace name")
        values = {name: _policy_value(headers, header) for name, header in self._counts}
        egress = _egress_allow(headers)
        return Caller(workspace=workspace, policy=WorkspacePolicy(values), egress_allow=egress)


_EGRESS = catalogue.by_name()["egress_allow"]


def _egress_allow(headers: Headers) -> tuple[str, ...]:
    """The egress allow-list header: entries as the proxy validated them (the egress proxy parses them
    again on every connection; here only their shape is checked)."""
    assert _EGRESS.header is not None
    entries = catalogue.decode_list(_required(headers, _EGRESS.header))
    if entries is None:
        raise TenancyInvalid(f"{_EGRESS.header} must be a comma-separated list of at most "
                             f"{catalogue.MAX_LIST_ENTRIES} destinations")
    return entries
