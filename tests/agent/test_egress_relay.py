"""The agent's egress: the proxy URL in sandboxed code's environment, and the relay from 127.0.0.1 to a Unix socket.

A real agent process; a stand-in for the egress proxy on a Unix socket that
records what it receives and answers with what a test tells it (the real proxy
behind the relay is in tests/e2e/test_egress_sandboxes.py). Without egress
settings the agent sets no variable and listens on no port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import content, start_agent
from testkit import eventually

from sandpool.agent.egress import BACKLOG, MAX_RELAYED, Egress, Relay
from sandpool.agent.settings import AgentSettings

CREDENTIAL = "c" + secrets.token_urlsafe(32)


class StandIn:
    """A Unix socket server: echoes what it reads, upper-cased, after a fixed greeting; closes on EOF.

    `accepting=False` leaves connections in its listen queue until `accept()` (a proxy too busy to
    accept); `fill()` then fills that queue, so the next connect meets a full one."""

    def __init__(self, path: Path, *, backlog: int = 16, accepting: bool = True) -> None:
        self.path = path
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(backlog)
        self.received: list[bytes] = []
        self.fillers: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        if accepting:
            self.accept()

    def accept(self) -> None:
        self.thread.start()

    def fill(self) -> None:
        """Connect until the listen queue is full (Linux: EAGAIN), without sending anything."""
        while len(self.fillers) < 64:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(str(self.path))
            except BlockingIOError:
                sock.close()
                return
            self.fillers.append(sock)
        raise AssertionError("the listen queue never filled")

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        got = b""
        with conn:
            try:
                conn.sendall(b"hello from the proxy\n")
                while True:
                    data = conn.recv(65536)
                    if not data:
                        break
                    got += data
                    conn.sendall(data.upper())
                self.received.append(got)  # before "bye": once the client has it, the test may look
                conn.sendall(b"bye\n")  # after the client's half-close: the relay must still carry it back
            except OSError:
                return  # the relay went away (the bound test closes what it held)

    def close(self) -> None:
        for sock in self.fillers:
            sock.close()
        self.server.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="spr", dir="/tmp"))
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@pytest.fixture
def stand_in(short_dir: Path) -> Iterator[StandIn]:
    server = StandIn(short_dir / "egress.sock")
    yield server
    server.close()


RELAY_CLIENT = r"""
import os, socket, sys
url = os.environ["https_proxy"]
port = int(url.rsplit(":", 1)[1])
s = socket.create_connection(("127.0.0.1", port), timeout=10)
f = s.makefile("rb")
print(f.readline().decode().strip())
s.sendall(b"x" * 200000)
s.shutdown(socket.SHUT_WR)
rest = f.read()
print(len(rest), rest[:5].decode(), rest[-4:].decode().strip())
"""


def test_code_gets_the_proxy_url_and_the_relay_carries_bytes_both_ways(
        tmp_path: Path, stand_in: StandIn) -> None:
    agent = start_agent(tmp_path, "--egress-socket", str(stand_in.path),
                        env={"SANDPOOL_EGRESS_CREDENTIAL": CREDENTIAL})
    try:
        shown = content(agent.sh("env | grep -i -e proxy -e PIP_ | sort"))["stdout"]
        variables = dict(line.split("=", 1) for line in shown.splitlines())
        url = variables["https_proxy"]
        assert re.fullmatch(rf"http://sandbox:{re.escape(CREDENTIAL)}@127\.0\.0\.1:\d+", url)
        assert {variables[name] for name in ("http_proxy", "HTTP_PROXY", "HTTPS_PROXY")} == {url}
        assert variables["no_proxy"] == variables["NO_PROXY"] == "localhost,127.0.0.1,::1"
        assert variables["PIP_RETRIES"] == "1"
        assert variables["SANDBOX_PIP_LAYER"] == str(agent.workspace / ".local")
        path = content(agent.sh("echo $PATH"))["stdout"].strip().split(":")
        assert path[-1] == str(agent.workspace / ".local" / "bin") and "/usr/bin" in path
        ran = content(agent.py(RELAY_CLIENT))
        assert ran["stderr"] == "" and ran["stdout"].splitlines() == [
            "hello from the proxy", "200004 XXXXX bye"]
        assert stand_in.received == [b"x" * 200000]
        assert CREDENTIAL not in agent.logs()
    finally:
        assert agent.stop() == 0


def test_an_unreachable_proxy_is_a_502_naming_it(tmp_path: Path, short_dir: Path) -> None:
    agent = start_agent(tmp_path, "--egress-socket", str(short_dir / "nobody.sock"),
                        env={"SANDPOOL_EGRESS_CREDENTIAL": CREDENTIAL})
    try:
        said = content(agent.sh('curl -sS -o /dev/null -w "%{http_code}" https://example.org/ 2>&1 || true'
                                if _has_curl() else 'python3 -c "import os,socket;'
                                'p=int(os.environ[\'http_proxy\'].rsplit(\':\',1)[1]);'
                                's=socket.create_connection((\'127.0.0.1\',p));'
                                's.sendall(b\'CONNECT example.org:443 HTTP/1.1\\r\\n\\r\\n\');'
                                'print(s.recv(200).decode())"'))["stdout"]
        assert "502" in said
    finally:
        agent.stop()


def _has_curl() -> bool:
    import shutil

    return shutil.which("curl") is not None


def test_without_egress_settings_there_is_no_variable_and_no_listener(tmp_path: Path) -> None:
    agent = start_agent(tmp_path)
    try:
        shown = content(agent.sh("env"))["stdout"]
        assert "proxy" not in shown.lower() and "PIP_" not in shown
        assert _tcp_listeners(agent.proc.pid) == set()
    finally:
        agent.stop()


def _tcp_listeners(pid: int) -> set[int]:
    """Inodes of listening TCP sockets among the process's descriptors."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                listening.add(int(fields[9]))
    return listening


def test_egress_needs_a_credential_and_one_way_out() -> None:
    from sandpool.agent import egress
    from sandpool.core.settings import ConfigurationError

    with pytest.raises(ConfigurationError, match="credential"):
        egress.from_settings(AgentSettings(egress_socket=Path("/nowhere.sock")), "/w")
    with pytest.raises(ValueError, match="not both"):
        AgentSettings(egress_socket=Path("/x.sock"), egress_proxy="egress:3128")
    assert egress.from_settings(AgentSettings(), "/w") is None
    direct = egress.from_settings(AgentSettings(egress_proxy="sandpool-egress.sandpool.svc:3128",
                                                egress_credential=CREDENTIAL), "/workspace")
    assert isinstance(direct, Egress) and direct.relay is None
    assert direct.environment()["HTTPS_PROXY"] == f"http://sandbox:{CREDENTIAL}@sandpool-egress.sandpool.svc:3128"


async def test_the_relay_refuses_beyond_its_bound(short_dir: Path, stand_in: StandIn) -> None:
    relay = Relay(str(stand_in.path))
    await relay.start()
    held = []
    try:
        for _ in range(MAX_RELAYED):
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            assert await reader.readline() == b"hello from the proxy\n"
            held.append(writer)
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed at once, nothing relayed
        writer.close()
    finally:
        for writer in held:
            writer.close()
        await relay.aclose()


@pytest.fixture
def busy(short_dir: Path) -> Iterator[StandIn]:
    """A proxy whose listen queue is full: it accepts nothing until the test says so."""
    server = StandIn(short_dir / "busy.sock", backlog=1, accepting=False)
    server.fill()
    yield server
    server.close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) unavailable")
async def test_the_relay_listens_with_its_backlog(stand_in: StandIn) -> None:
    """asyncio's server calls listen(2) again on the socket it is given: with 100 unless told otherwise."""
    relay = Relay(str(stand_in.path))
    await relay.start()
    try:
        shown = (await asyncio.to_thread(subprocess.run, ["ss", "-tlnH", "sport", "=", f":{relay.port}"],
                                         capture_output=True, text=True, check=True, timeout=30)).stdout.split()
    finally:
        await relay.aclose()
    assert shown[shown.index("LISTEN") + 2] == str(BACKLOG)


async def test_a_full_proxy_queue_is_waited_out_not_answered_502(busy: StandIn,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The relay meets the proxy's full queue (EAGAIN), retries, and carries the connection once the proxy
    accepts again: the client gets the proxy's bytes, not the relay's 502."""
    caplog.set_level(logging.DEBUG, logger="sandpool.agent.egress")
    relay = Relay(str(busy.path))
    await relay.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            await eventually(lambda: any("queue is full" in record.getMessage() for record in caplog.records),
                             timeout=10, what="the relay meeting the full queue")
        finally:
            busy.accept()
        assert await asyncio.wait_for(reader.readline(), 10) == b"hello from the proxy\n"
        writer.close()
    finally:
        await relay.aclose()


def test_a_queue_that_stays_full_is_a_503_with_retry_after(tmp_path: Path, busy: StandIn) -> None:
    """A real agent (its loop is uvloop's when installed): after retrying for a while, a queue still full is
    a 503 saying so, with Retry-After; never the 502 that says the proxy cannot be reached."""
    agent = start_agent(tmp_path, "--egress-socket", str(busy.path), env={"SANDPOOL_EGRESS_CREDENTIAL": CREDENTIAL})
    try:
        said = content(agent.py(ASK_THROUGH_THE_RELAY))["stdout"]
    finally:
        agent.stop()
    head = said.split("\r\n")
    assert head[0].startswith("HTTP/1.1 503 sandpool egress: the egress proxy is busy"), said
    assert "Retry-After: 1" in head and "X-Sandpool-Egress-Refusal: proxy_busy" in head, said


ASK_THROUGH_THE_RELAY = r"""
import os, socket
port = int(os.environ["https_proxy"].rsplit(":", 1)[1])
s = socket.create_connection(("127.0.0.1", port), timeout=30)
s.sendall(b"CONNECT example.org:443 HTTP/1.1\r\nHost: example.org:443\r\n\r\n")
got = b""
while b"\r\n\r\n" not in got:
    data = s.recv(4096)
    if not data:
        break
    got += data
print(got.decode("latin-1"), end="")
"""
