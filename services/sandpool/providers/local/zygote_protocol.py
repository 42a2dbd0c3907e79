"""Messages between the controller and its zygote: JSON over a SOCK_SEQPACKET socketpair.

A socketpair is private by construction (no path, no port, nothing another
process or a sandbox could connect to), SEQPACKET keeps message boundaries, and
SCM_RIGHTS carries the one file descriptor a launch needs: a memfd holding the
agent's secret, so the secret never passes through the zygote's own memory (a
zygote remembering one sandbox's secret would hand it to every later fork).

Requests carry an `id`; the reply to a request carries the same `id`. The zygote
also sends unsolicited `{"event": "exit", ...}` when a sandbox dies on its own,
and one `{"event": "hello", ...}` with its isolation report when it is ready.
"""

from __future__ import annotations

import array
import json
import os
import socket

MAX_MESSAGE = 256 * 1024
MAX_FDS = 4


class ProtocolError(Exception):
    """A malformed or oversized message: the channel can no longer be trusted."""


def encode(message: dict[str, object]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ProtocolError("message too large")
    return data


def decode(data: bytes) -> dict[str, object]:
    try:
        message = json.loads(data)
    except ValueError:
        raise ProtocolError("message is not JSON") from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not an object")
    return message


def send(sock: socket.socket, message: dict[str, object], fds: list[int] | tuple[int, ...] = ()) -> None:
    send_raw(sock, encode(message), fds)


def send_raw(sock: socket.socket, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def recv(sock: socket.socket) -> tuple[dict[str, object] | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) at end of stream."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    received: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            chunk = array.array("i")
            chunk.frombytes(payload[: len(payload) - (len(payload) % chunk.itemsize)])
            received.extend(chunk)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in received:
            os.close(fd)
        raise ProtocolError("message truncated")
    if not data:
        for fd in received:
            os.close(fd)
        return None, []
    try:
        return decode(data), received
    except ProtocolError:
        for fd in received:
            os.close(fd)
        raise


def secret_fd(secret: str) -> int:
    """A sealed-in-practice memfd holding the secret, read once by the sandbox's agent."""
    fd = os.memfd_create("sandpool-agent-secret", os.MFD_CLOEXEC)
    os.write(fd, secret.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def read_secret_fd(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(fd)
