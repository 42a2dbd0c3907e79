"""A burst of connections waits in the egress proxy's listen queues; it is never turned away at them.

The process binds its sockets with the queue `bind` asks for (`core.serve.BACKLOG`); asyncio's and
uvloop's servers call listen(2) again on a socket they are given, with 100 unless told otherwise, so
each server must be told. Checked on the real process (uvloop when installed): a stopped proxy's Unix
socket queues a whole backlog of connections, `ss` shows each listener's queue, and 200 CONNECTs at once
from two sandboxes' relays all get the proxy's own answer.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess

import pytest
from testkit import eventually

from sandpool.agent.egress import Relay
from sandpool.core.serve import BACKLOG

from .conftest import Egress, Process, connect_head, read_answer


def test_a_stopped_proxy_queues_a_whole_backlog_on_its_unix_socket(process: Process) -> None:
    """Linux queues backlog + 1 connections on a Unix socket nobody accepts from, then says EAGAIN."""
    held: list[socket.socket] = []
    os.kill(process.proc.pid, signal.SIGSTOP)
    try:
        while len(held) <= BACKLOG + 8:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(str(process.unix_socket))
            except BlockingIOError:
                sock.close()
                break
            held.append(sock)
    finally:
        os.kill(process.proc.pid, signal.SIGCONT)
        for sock in held:
            sock.close()
    assert BACKLOG <= len(held) <= BACKLOG + 1


def listener(*filters: str, unix: bool = False) -> tuple[int, int]:
    """(connections waiting, queue length) of the one listening socket `ss` finds for `filters`: its Recv-Q
    and Send-Q columns."""
    shown = subprocess.run(["ss", "-xlnH" if unix else "-tlnH", *filters], capture_output=True, text=True,
                           check=True, timeout=30).stdout.split()
    assert shown.count("LISTEN") == 1, shown
    at = shown.index("LISTEN")
    return int(shown[at + 1]), int(shown[at + 2])


async def ask(relay: Relay, credential: str) -> str:
    """One CONNECT through a relay: the status and refusal word it gets, or how the connection ended."""
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    try:
        writer.write(connect_head("files.example.test:443", credential).encode() + b"\r\n\r\n")
        await writer.drain()
        answer = await read_answer(reader)
        return f"{answer.status} {answer.headers.get('x-sandpool-egress-refusal', '')}"
    except (asyncio.IncompleteReadError, ConnectionError):
        return "closed without an answer"
    finally:
        writer.close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) unavailable")
async def test_a_burst_from_two_sandboxes_waits_in_the_queue_for_the_proxys_own_answers(
        process: Process, egress: Egress) -> None:
    """Every listener has the backlog it was bound with; and the issue's burst: 200 CONNECTs at once, 100
    through each of two sandboxes' relays, each refused by its policy (nothing leaves the machine). The
    proxy is stopped while they arrive, so all 200 meet its queue at once; resumed, it answers every one
    itself (403), and the relays answered none."""
    assert listener("sport", "=", f":{process.port}")[1] == BACKLOG
    assert listener("sport", "=", f":{process.metrics_port}")[1] == BACKLOG
    assert listener("src", str(process.unix_socket), unix=True)[1] == BACKLOG

    relays = [Relay(str(process.unix_socket)) for _ in range(2)]
    bound = [await egress.bind_session([]) for _ in relays]
    for relay in relays:
        await relay.start()
    os.kill(process.proc.pid, signal.SIGSTOP)
    try:
        asked = [asyncio.ensure_future(ask(relay, one.credential))
                 for relay, one in zip(relays, bound, strict=True) for _ in range(100)]
        # until each is queued at the proxy's socket, or was answered by its relay
        await eventually(lambda: sum(task.done() for task in asked)
                         + listener("src", str(process.unix_socket), unix=True)[0] >= len(asked),
                         what="every CONNECT queued at the stopped proxy or answered by its relay")
    finally:
        os.kill(process.proc.pid, signal.SIGCONT)
    try:
        got = await asyncio.gather(*asked)
    finally:
        for relay in relays:
            await relay.aclose()
    assert {answer: got.count(answer) for answer in set(got)} == {"403 not_allowed": 200}

