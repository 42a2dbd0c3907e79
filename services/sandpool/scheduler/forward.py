"""HTTP clients to sandbox agents, and the header rules of a forwarded call.

One pooled httpx client per agent address (`http://host:port` or
`unix:///path`), kept in a bounded LRU. A client in use is never closed under a
call: an evicted one is retired and closed when its last call ends. Clients
never read proxy settings from the environment and never ask for compressed
bodies, so bytes pass through exactly as the agent wrote them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import OrderedDict
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

# Request headers a forwarded call keeps; everything else (the caller's credential,
# X-Sandpool-*, cookies, hop-by-hop headers) stays behind.
FORWARDED_REQUEST_HEADERS = ("content-type", "content-length", "accept", "x-request-id")
# Response headers passed back to the client; the agent's X-Sandpool-* are consumed here.
FORWARDED_RESPONSE_HEADERS = ("content-type", "content-length", "content-disposition", "content-encoding",
                              "last-modified", "etag")
OUTCOME_HEADER = "x-sandpool-outcome"

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


def request_headers(incoming: list[tuple[bytes, bytes]], *, secret: str, request_id: str) -> dict[str, str]:
    """The headers sent to an agent: a small allow-list plus the agent's own credential."""
    out: dict[str, str] = {}
    for raw_name, raw_value in incoming:
        name = raw_name.decode("latin-1").lower()
        if name in FORWARDED_REQUEST_HEADERS and name != "x-request-id":
            out[name] = raw_value.decode("latin-1")
    out["authorization"] = f"Bearer {secret}"
    out["x-request-id"] = request_id
    out["accept-encoding"] = "identity"
    return out


def response_headers(headers: httpx.Headers) -> dict[str, str]:
    return {name: headers[name] for name in FORWARDED_RESPONSE_HEADERS if name in headers}


def _build_client(address: str, *, connect_timeout: float) -> httpx.AsyncClient:
    # Agents speak plain HTTP (a Unix socket locally, a pod IP behind a NetworkPolicy on a
    # cluster), so no TLS context is built: httpx's default one loads the CA bundle, ~60 ms
    # of blocked event loop for every new sandbox address.
    timeout = httpx.Timeout(30.0, connect=connect_timeout)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=8, keepalive_expiry=30)
    if address.startswith("unix://"):
        path = address[len("unix://"):]
        if not path.startswith("/"):
            raise BadAddress("unix address must be absolute")
        transport = httpx.AsyncHTTPTransport(uds=path, retries=0, limits=limits, verify=False)
        return httpx.AsyncClient(transport=transport, base_url="http://sandbox", timeout=timeout, trust_env=False)
    if address.startswith("http://"):
        transport = httpx.AsyncHTTPTransport(retries=0, limits=limits, verify=False,
                                             socket_options=AGENT_TCP_SOCKET_OPTIONS)
        return httpx.AsyncClient(transport=transport, base_url=address.rstrip("/"), timeout=timeout,
                                 trust_env=False)
    raise BadAddress("unsupported agent address scheme")


@dataclass
class ClientSlot:
    """A client checked out for one call; give it back with `AgentClients.give_back`."""

    address: str
    client: httpx.AsyncClient
    users: int = 0
    retired: bool = False


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
            entry = ClientSlot(address=address, client=_build_client(address, connect_timeout=self.connect_timeout))
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
        task = asyncio.get_running_loop().create_task(entry.client.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        entries = list(self._entries.values())
        self._entries.clear()
        for entry in entries:
            await entry.client.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
