"""Who is calling the session layer: a workspace and the limits in force for it.

The edge builds one from a verified token and the workspace's stored policy and
hands it over in process; `--no-auth` (standalone) has exactly one workspace,
no policy of its own and no egress allow-list. Nothing here is read from a
request header: tenancy never travels in anything a client can set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandpool.contract import tenancy
from sandpool.sessions.limits import NO_POLICY, WorkspacePolicy
from sandpool.state.sessions import CallSpec, Target


@dataclass(frozen=True)
class ExecBody:
    """An Execute's body, parsed and checked before its call is admitted (so its record names its tool):
    its bytes, the JSON document, the tool kind, the client's timeout hint, and the longest timeout it can run
    with under the operator's ceilings (a workspace's policy may only lower it)."""

    raw: bytes
    doc: dict[str, Any]
    tool: str
    timeout_hint: int | None
    bound: int


@dataclass(frozen=True)
class Admitted:
    """The call the edge admitted in its one round trip: the spec its record was written with, its
    session's target (None: unknown, or another workspace's: nothing was touched or recorded) and, for
    an Execute, the body it read and checked first. The session layer asks Redis no more before the agent."""

    spec: CallSpec
    target: Target | None
    body: ExecBody | None = None


@dataclass(frozen=True)
class Caller:
    workspace: str
    policy: WorkspacePolicy
    egress_allow: tuple[str, ...] = ()
    """The workspace's egress allow-list (bound to a new session's sandbox by the lease); empty: none."""
    admitted: Admitted | None = None
    """Set when the edge already admitted this call to a session (touched, recorded) in its round trip."""

    @classmethod
    def of(cls, workspace: str, limits: Mapping[str, int], egress_allow: tuple[str, ...] = ()) -> Caller:
        return cls(workspace=workspace, policy=WorkspacePolicy(limits), egress_allow=egress_allow)


STANDALONE = Caller(workspace=tenancy.STANDALONE_WORKSPACE, policy=NO_POLICY)
