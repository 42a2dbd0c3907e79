"""Egress credentials bound to sessions, and the bytes the egress proxy meters, in Redis.

Each sandbox gets an egress credential when it starts (in its proxy URL). The
lease binds it to the session, the workspace and the workspace's allow-list
(`Keys.egress_binding`, a hash keyed by the credential's SHA-256, never the
credential itself); the release removes it. The egress proxy reads the binding
on every connection (`binding`: one script, which also refuses a binding whose
session no longer lives, and returns the workspace's connection cap the lease
recorded on the session) and meters each connection when it ends (`meter`:
usage counters and an `egress` event in one script, like the session layer's).

The proxy also publishes the operator's ceiling (`publish_ceiling`), so the
admin API can refuse a workspace list outside it without sharing the proxy's
settings. `bind`/`unbind` write and remove a binding as one step; the lease and release
scripts do the same inside their own steps (same key, same fields, same expiry),
so these are the reference for them and what the tests use.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from sandpool.contract.limits import MAX_EGRESS_CONNECTIONS
from sandpool.state import scripts
from sandpool.state.client import Client
from sandpool.state.errors import translated
from sandpool.state.keys import USAGE_DAY_RETENTION_DAYS, USAGE_STREAM_MAXLEN, Keys, utc_day

EGRESS_BYTES = "egress_bytes"
EGRESS_BYTES_IN = "egress_bytes_in"
EGRESS_BYTES_OUT = "egress_bytes_out"
EGRESS_CONNECTIONS = "egress_connections"
EVENT = "egress"
"""Usage counters (`egress_bytes` = in + out; in: received from the destination, out: sent to it) and the
usage event's type."""

BINDING_FIELDS = ("session", "workspace", "allow")
"""Fields of a binding hash: the session id, its workspace, its allow-list as a JSON list of entries."""

RETENTION_SECONDS = USAGE_DAY_RETENTION_DAYS * 86400

@dataclass(frozen=True)
class EgressBinding:
    """Whose connection this is: the live session a credential is bound to, its allow-list as stored, and
    its workspace's connection cap as the lease recorded it (0: none of its own, the egress proxy's ceiling)."""

    session: str
    workspace: str
    allow: str  # JSON list of allow-list entries, parsed (and cached) by the egress proxy
    max_egress_connections: int = 0


def _recorded_cap(raw: str) -> int:
    """`max_egress_connections` of a session's recorded lease limits; 0 when absent or unreadable (a session
    leased before the limit existed gets the egress proxy's ceiling, never no cap)."""
    try:
        value = json.loads(raw).get(MAX_EGRESS_CONNECTIONS, 0)
    except (ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


class EgressStore:
    def __init__(self, client: Client, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._binding = client.register_script(scripts.EGRESS_BINDING)
        self._meter = client.register_script(scripts.EGRESS_METER)

    @translated
    async def load_scripts(self) -> None:
        for script in (self._binding, self._meter):
            await self.redis.script_load(script.script)

    @translated
    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    @translated
    async def binding(self, credential: str) -> EgressBinding | None:
        """The live session `credential` is bound to; None when unknown, unbound, or its session ended."""
        found = await self._binding(keys=[self.keys.egress_binding(credential)],
                                    args=scripts.named(session_prefix=self.keys.session_prefix))
        if not found:
            return None
        session, workspace, allow, limits = found
        return EgressBinding(session=session, workspace=workspace, allow=allow,
                             max_egress_connections=_recorded_cap(limits))

    @translated
    async def meter(self, *, workspace: str, session: str, bytes_in: int, bytes_out: int, now: float,
                    host: str, port: int) -> None:
        """Meter one connection's bytes (in: received from the destination; out: sent to it) against the
        workspace."""
        k = self.keys
        await self._meter(
            keys=[k.usage_total(workspace), k.usage_day(workspace, utc_day(now)), k.usage_workspaces, k.usage_events],
            args=scripts.named(workspace=workspace, session=session, now=repr(now), retention=RETENTION_SECONDS,
                               maxlen=USAGE_STREAM_MAXLEN, bytes_in=int(bytes_in), bytes_out=int(bytes_out),
                               host=host, port=int(port)),
        )

    @translated
    async def publish_ceiling(self, entries: Sequence[str]) -> None:
        """The operator's egress ceiling as the egress proxy enforces it, for the admin API to refuse a
        workspace list outside it (every replica publishes the same value at start)."""
        await self.redis.set(self.keys.egress_ceiling, json.dumps(list(entries)))

    @translated
    async def ceiling(self) -> list[str] | None:
        """The published ceiling; None before any egress proxy published one."""
        raw = await self.redis.get(self.keys.egress_ceiling)
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            return None
        return [str(entry) for entry in data] if isinstance(data, list) else None

    @translated
    async def bind(self, credential: str, *, session: str, workspace: str, allow: Sequence[str],
                   ttl_seconds: int) -> None:
        """Bind `credential` to a session and its allow-list, expiring after `ttl_seconds` (the session's
        own key expiry: a safety net behind `unbind`)."""
        key = self.keys.egress_binding(credential)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping={"session": session, "workspace": workspace,
                                    "allow": json.dumps(list(allow), separators=(",", ":"))})
            pipe.expire(key, max(1, int(ttl_seconds)))
            await pipe.execute()

    @translated
    async def unbind(self, credential: str) -> bool:
        """Revoke a credential at once; whether it was bound."""
        return bool(await self.redis.delete(self.keys.egress_binding(credential)))
