"""Connections to sandbox agents, and the header rules of a forwarded call.

One pool of keep-alive connections per agent address (`http://host:port` or
`unix:///path`, `core.hop`), kept in a bounded LRU. A pool in use is never
closed under a call: an evicted one is retired and closed when its last call
ends. Calls never ask for compressed bodies, so bytes pass through exactly as
the agent wrote them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from sandpool.contract import agent_protocol as protocol
from sandpool.core.hop import HopPool, Peer

log = logging.getLogger(__name__)

# Request headers a forwarded call keeps; everything else (the caller's credential,
# X-Sandpool-*, cookies, hop-by-hop headers) stays behind.
# `sandpool-cancel-on-disconnect` lets the agent cancel a streamed call should this api's own
# connection to it drop (the api itself cancels when its client leaves).
FORWARDED_REQUEST_HEADERS = ("content-type", "content-length", "accept", "x-request-id",
                             protocol.CANCEL_ON_DISCONNECT_HEADER.lower())
# Response headers passed back to the client; the agent's X-Sandpool-* are consumed here.
FORWARDED_RESPONSE_HEADERS = ("content-type", "content-length", "content-disposition", "content-encoding",
                              "last-modified", "etag")
CALL_ID = protocol.CALL_ID_HEADER.lower()
"""The header naming an Execute's call to its agent (set here, never taken from the client)."""
OUTCOME_HEADER = protocol.lower_name(protocol.OUTCOME_HEADER)
"""The agent's outcome header, as the hop's responses carry it (consumed here, never relayed)."""
FENCED = protocol.lower_name(protocol.FENCED_HEADER)
"""The agent's header on a call its session fence refused (the sandbox serves another session)."""

AGENT_TCP_SOCKET_OPTIONS: list[tuple[int, int, int]] = [
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    *((socket.IPPROTO_TCP, getattr(socket, name), value)
      for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 11_000))
      if hasattr(socket, name)),  # Linux names; elsewhere only SO_KEEPALIVE
]
"""Socket options of connections to agents at `http://` addresses (pods).

A pod whose node died or whose network was cut sends nothing, not even a reset:
without these a call waiting on its connection hangs for the exec timeout, and
an idle pooled connection stays ESTABLISHED for ever. Keepalive probes after
5 s of silence, every 2 s, 3 unanswered and the connection is dead; TCP_USER_TIMEOUT
(11 s, in ms) ends it as well when data we sent stays unacknowledged (keepalive
alone does not cover that). A live agent's kernel answers probes however busy
the sandbox is, so a long call is never cut by them. Unix-socket agents are local
processes: none of this applies to them.
"""


class BadAddress(ValueError):
    """An agent address that is neither `http://` nor `unix://`."""


def request_headers(incoming: list[tuple[bytes, bytes]], *, secret: str, request_id: str) -> list[tuple[str, str]]:
    """The headers sent to an agent: a small allow-list plus the agent's own credential
    (the body's framing is the client's: its content-length goes separately)."""
    out: list[tuple[str, str]] = []
    for raw_name, raw_value in incoming:
        name = raw_name.decode("latin-1").lower()
        if name in FORWARDED_REQUEST_HEADERS and name not in ("x-request-id", "content-length"):
            out.append((name, raw_value.decode("latin-1")))
    out += [("authorization", f"Bearer {secret}"), ("x-request-id", request_id), ("accept-encoding", "identity")]
    return out


def response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The agent's answer headers the client sees (`X-Sandpool-*` is consumed here)."""
    return [(name, value) for name, value in headers if name.decode("latin-1") in FORWARDED_RESPONSE_HEADERS]


def _pool_for(address: str, *, connect_timeout: float) -> HopPool:
    try:
        options = AGENT_TCP_SOCKET_OPTIONS if address.startswith("http://") else ()
        return HopPool(Peer.from_url(address, socket_options=options), max_connections=64,
                       connect_timeout=connect_timeout)
    except ValueError as exc:
        raise BadAddress(str(exc)) from None


@dataclass
class ClientSlot:
    """A pool checked out for one call; give it back with `AgentClients.give_back`."""

    address: str
    pool: HopPool
    users: int = 0
    retired: bool = False
    closed: bool = False


class AgentClients:
    def __init__(self, *, max_clients: int, connect_timeout: float) -> None:
        self.max_clients = max_clients
        self.connect_timeout = connect_timeout
        self._entries: OrderedDict[str, ClientSlot] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, address: str) -> ClientSlot:
        entry = self._entries.get(address)
        if entry is None:
            entry = ClientSlot(address=address, pool=_pool_for(address, connect_timeout=self.connect_timeout))
            self._entries[address] = entry
            self._evict()
        else:
            self._entries.move_to_end(address)
        entry.users += 1
        return entry

    def give_back(self, entry: ClientSlot) -> None:
        entry.users -= 1
        if entry.retired and entry.users <= 0:
            self._close(entry)

    def forget(self, address: str) -> None:
        """Drop an address whose sandbox is gone (released, reaped, dead)."""
        entry = self._entries.pop(address, None)
        if entry is not None:
            self._retire(entry)

    def _evict(self) -> None:
        while len(self._entries) > self.max_clients:
            _, oldest = self._entries.popitem(last=False)
            self._retire(oldest)

    def _retire(self, entry: ClientSlot) -> None:
        entry.retired = True
        if entry.users <= 0:
            self._close(entry)

    def _close(self, entry: ClientSlot) -> None:
        if entry.closed:
            return
        entry.closed = True
        task = asyncio.get_running_loop().create_task(entry.pool.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        entries = list(self._entries.values())
        self._entries.clear()
        for entry in entries:
            entry.closed = True
            await entry.pool.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
