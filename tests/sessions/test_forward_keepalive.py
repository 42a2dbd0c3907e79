"""Connections to agents at `http://` addresses probe a silent peer (keepalive, TCP_USER_TIMEOUT).

Read back with getsockopt from the socket of a real connection to a real loopback
server, the way the scheduler opens it, not from the arguments it was built with.
"""

from __future__ import annotations

import asyncio
import socket
from asyncio.trsock import TransportSocket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandpool.sessions.forward import AGENT_TCP_SOCKET_OPTIONS, AgentClients


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def tcp_agent() -> AsyncIterator[str]:
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.close()
    await server.wait_closed()


def options(sock: socket.socket | TransportSocket) -> dict[str, int]:
    out = {"SO_KEEPALIVE": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)}
    for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT"):
        if hasattr(socket, name):
            out[name] = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
    return out


async def test_a_real_connection_to_an_agent_probes_a_silent_peer(tcp_agent: str) -> None:
    clients = AgentClients(max_clients=4, connect_timeout=2)
    slot = clients.take(tcp_agent)
    try:
        response = await slot.pool.request("GET", "/healthz", timeout=5)
        assert response.status == 200 and await response.read() == b"ok"
        sock = response.transport_info("socket")
        assert isinstance(sock, (socket.socket, TransportSocket))
        assert sock.family == socket.AF_INET and sock.type == socket.SOCK_STREAM
        found = options(sock)
        await response.close()
    finally:
        clients.give_back(slot)
        await clients.aclose()
    assert found["SO_KEEPALIVE"] == 1
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: a dead peer is found in seconds, not minutes
        assert found == {"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 5, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3,
                         "TCP_USER_TIMEOUT": 11_000}
        # The kernel's own defaults (2 h idle, 9 probes 75 s apart) are what the constant replaces.
        with socket.socket() as fresh:
            assert fresh.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
    assert len(AGENT_TCP_SOCKET_OPTIONS) == len(found)


async def test_unix_socket_agents_get_no_tcp_options(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    server = await asyncio.start_unix_server(answer, str(path))
    clients = AgentClients(max_clients=4, connect_timeout=2)
    slot = clients.take(f"unix://{path}")
    try:
        response = await slot.pool.request("GET", "/healthz", timeout=5)
        assert response.status == 200 and await response.read() == b"ok"
        sock = response.transport_info("socket")
        assert isinstance(sock, (socket.socket, TransportSocket))
        assert sock.family == socket.AF_UNIX
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        await response.close()
    finally:
        clients.give_back(slot)
        await clients.aclose()
        server.close()
        await server.wait_closed()
