"""The Redis key schema: every key sandpool writes is named here and nowhere else.

All keys carry one hash tag (`{<prefix>}`), so every atomic script touches a
single cluster slot and runs unchanged on Redis Cluster. Scripts may build
sandbox keys from `sandbox_prefix` inside Lua for that reason.

Lifetimes:
- call records do not expire: each ends with its call's `done`, or the controller settles it once
  its deadline passed (metered as an unconfirmed call);
- session, sandbox, leadership and lock keys expire (a safety net behind the session reaper
  and the reconciler; they are deleted explicitly in the normal path), and so do
  egress credential bindings, with their session;
- usage totals are kept; per-day usage hashes expire after `USAGE_DAY_RETENTION_DAYS`;
- the usage event stream is trimmed to about `USAGE_STREAM_MAXLEN` entries, which a
  billing consumer (a consumer group) must keep ahead of.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

USAGE_DAY_RETENTION_DAYS = 400
USAGE_STREAM_MAXLEN = 1_000_000


def utc_day(now: float) -> str:
    """The UTC day (`YYYY-MM-DD`) a usage figure at `now` counts towards."""
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def egress_digest(credential: str) -> str:
    """What a sandbox's egress credential is known by in Redis (SHA-256, hex): never the credential itself."""
    return hashlib.sha256(credential.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Keys:
    prefix: str = "sandpool"

    @property
    def base(self) -> str:
        return "{" + self.prefix + "}:"

    # --- sandboxes and pools ---------------------------------------------------------------
    def sandbox(self, sandbox_id: str) -> str:
        """Hash: pool, address, secret, state (starting|ready|leased|doomed), session, timestamps, and
        `egress`: the digest of its egress credential, when it has one (the lease binds it)."""
        return f"{self.base}sandbox:{sandbox_id}"

    @property
    def sandbox_prefix(self) -> str:
        return f"{self.base}sandbox:"

    def pool_ready(self, pool: str) -> str:
        """List of ready sandbox ids, oldest first: the lease pops from its head."""
        return f"{self.base}pool:{pool}:ready"

    def pool_members(self, pool: str) -> str:
        """Set of every sandbox id the pool owns, whatever its state (the ceiling counts these)."""
        return f"{self.base}pool:{pool}:members"

    def pool_starting(self, pool: str) -> str:
        """Set of the pool's sandbox ids registered and not yet published (counted for /metrics, never
        by reading every member)."""
        return f"{self.base}pool:{pool}:starting"

    def pool_leased(self, pool: str) -> str:
        """Set of the pool's leased sandbox ids (what its ceiling has promised away)."""
        return f"{self.base}pool:{pool}:leased"

    # --- waiting for a sandbox (a CreateSession below the ceiling with none ready) --------------
    def pool_waiters(self, pool: str) -> str:
        """Set of the pool's waiter ids, queued or promised a sandbox (the ceiling counts these)."""
        return f"{self.base}pool:{pool}:waiters"

    def pool_queued(self, pool: str) -> str:
        """Set of the pool's waiter ids no sandbox is promised to yet (the controller starts one each)."""
        return f"{self.base}pool:{pool}:queued"

    def pool_wait_ring(self, pool: str) -> str:
        """List of the workspaces with queued waiters, served round-robin."""
        return f"{self.base}pool:{pool}:wait:ring"

    def pool_wait_queue(self, pool: str, workspace: str) -> str:
        """List of one workspace's queued waiter ids, oldest first."""
        return f"{self.pool_wait_queue_prefix(pool)}{workspace}"

    def pool_wait_queue_prefix(self, pool: str) -> str:
        return f"{self.base}pool:{pool}:wait:ws:"

    def waiter(self, waiter_id: str) -> str:
        """Hash: session, workspace, pool, state (queued|promised), sandbox, the lease asked for."""
        return f"{self.waiter_prefix}{waiter_id}"

    @property
    def waiter_prefix(self) -> str:
        return f"{self.base}waiter:"

    def workspace_waiters(self, workspace: str) -> str:
        """Set of the workspace's waiter ids (its concurrency counts them with its sessions)."""
        return f"{self.base}ws:{workspace}:waiting"

    @property
    def promised(self) -> str:
        """Pub/sub channel of waiter ids just promised a sandbox (their api replica claims it)."""
        return f"{self.base}waiters:promised"

    def pool_rate_prefix(self, pool: str, what: str) -> str:
        """Counters of `what` (leases, releases) per 10-second bucket: `<prefix><bucket>`."""
        return f"{self.base}pool:{pool}:{what}:"

    def pool_last_error(self, pool: str) -> str:
        """String with expiry: the provider's last error starting a sandbox of the pool."""
        return f"{self.base}pool:{pool}:last_error"

    @property
    def doomed(self) -> str:
        """Set of sandbox ids to destroy (released, reaped, dead); the controller drains it."""
        return f"{self.base}doomed"

    # --- sessions --------------------------------------------------------------------------
    def session(self, session_id: str) -> str:
        """Hash: sandbox, pool, image, workspace, address, secret, created_at, last_activity_at, timeouts."""
        return f"{self.base}session:{session_id}"

    @property
    def session_prefix(self) -> str:
        return f"{self.base}session:"

    @property
    def deadlines(self) -> str:
        """Sorted set: session id scored by the time it must be reaped (idle or max lifetime)."""
        return f"{self.base}deadlines"

    def call(self, call_id: str) -> str:
        """Hash: one call to a session's agent (session, workspace, tool, started, deadline), from the round
        trip that admitted it to its `done` or the controller's settling of it. No expiry of its own."""
        return f"{self.base}call:{call_id}"

    @property
    def call_prefix(self) -> str:
        return f"{self.base}call:"

    @property
    def call_deadlines(self) -> str:
        """Sorted set: call id scored by the time past which its `done` is overdue (its api crashed)."""
        return f"{self.base}call-deadlines"

    def workspace_sessions(self, workspace: str) -> str:
        """Set of the workspace's live session ids (its concurrency counts these)."""
        return f"{self.base}ws:{workspace}:sessions"

    @property
    def workspace_sessions_prefix(self) -> str:
        return f"{self.base}ws:"

    # --- policy, tokens, rate ---------------------------------------------------------------
    def workspace_policy(self, workspace: str) -> str:
        """String: the workspace's policy as JSON, written by the admin API."""
        return f"{self.base}policy:{workspace}"

    def revoked(self, jti: str) -> str:
        """String with expiry: a revoked token id, kept until the token would have expired."""
        return f"{self.base}revoked:{jti}"

    def rate(self, workspace: str, minute: int) -> str:
        """Counter of the workspace's requests in one UTC minute (fixed window)."""
        return f"{self.base}rate:{workspace}:{minute}"

    # --- usage ------------------------------------------------------------------------------
    def usage_total(self, workspace: str) -> str:
        """Hash of counters since the beginning, kept forever."""
        return f"{self.base}usage:{workspace}:total"

    def usage_day(self, workspace: str, day: str) -> str:
        """Hash of counters for one UTC day (`YYYY-MM-DD`), expiring after the retention."""
        return f"{self.base}usage:{workspace}:day:{day}"

    def usage_day_prefix(self, workspace: str) -> str:
        return f"{self.base}usage:{workspace}:day:"

    @property
    def usage_workspaces(self) -> str:
        """Set of workspaces that have any usage recorded."""
        return f"{self.base}usage:workspaces"

    @property
    def usage_events(self) -> str:
        """Stream of usage events (append-only, trimmed to about USAGE_STREAM_MAXLEN)."""
        return f"{self.base}usage:events"

    # --- egress -----------------------------------------------------------------------------
    def egress_binding(self, credential: str) -> str:
        """Hash: session, workspace, allow (JSON list) bound to a sandbox's egress credential while its
        session lives; keyed by `egress_digest(credential)`, expiring with the session."""
        return self.egress_binding_prefix + egress_digest(credential)

    @property
    def egress_binding_prefix(self) -> str:
        """For scripts: a binding's key is this prefix and the credential's digest."""
        return f"{self.base}egress:"

    @property
    def egress_ceiling(self) -> str:
        """String (JSON list): the egress proxy's allow-list ceiling, for the admin API's policy checks."""
        return f"{self.base}limits:egress_ceiling"

    # --- control ----------------------------------------------------------------------------
    @property
    def controller_leader(self) -> str:
        """String with expiry: the id of the leading controller replica (whose pool controller is active)."""
        return f"{self.base}controller:leader"

    @property
    def pool_events(self) -> str:
        """Pub/sub channel nudging the controller when a sandbox is leased, released or lost, or a caller waits."""
        return f"{self.base}controller:nudge"

    @property
    def released_sessions(self) -> str:
        """Pub/sub channel of released session ids (a message names one, or several space-separated: a
        reaper call's): every api replica ends their calls in flight."""
        return f"{self.base}sessions:released"

    # --- MCP (the api's /mcp endpoint, previous protocol revision) ----------------------------
    def mcp_session(self, mcp_session_id: str) -> str:
        """Hash with expiry: `workspace` that opened the MCP session, `session`: the sandpool session its
        calls without a `session_id` use (absent until the first such call leases one)."""
        return f"{self.base}mcp:{mcp_session_id}"

    def mcp_call(self, mcp_session_id: str, request_id: str) -> str:
        """String with expiry: the sandpool session a running MCP tool call (by JSON-RPC request id) runs
        in, so a cancel notification that reaches any replica stops it."""
        return f"{self.base}mcp:{mcp_session_id}:call:{request_id}"
