"""Reused network namespaces: nothing of a previous sandbox survives into the next.

The zygote hands each sandbox a network namespace from a pool and takes it back
once the sandbox's PID-namespace init is reaped (isolation/netns.py). These
tests drive the real kernel: the pool directly (the test thread enters a
namespace with setns and leaves sockets, TIME_WAIT, traffic or a downed
loopback in it), and real zygote sandboxes whose hostile code tries to leave
something for the next one. docs/isolation.md has the argument they check.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from sandpool.providers.local.isolation.netns import NetNamespace, NetnsPool, read_fingerprint

from .harness import Harness

pytestmark = pytest.mark.isolation

SO_NETNS_COOKIE = getattr(socket, "SO_NETNS_COOKIE", 71)  # Linux 5.14


@pytest.fixture
def pool() -> Iterator[NetnsPool]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    made = NetnsPool(spares=4)
    yield made
    made.close()


@contextmanager
def inside(pool: NetnsPool, ns: NetNamespace) -> Iterator[None]:
    pool.enter(ns)
    try:
        yield
    finally:
        pool.leave()


def cookie(pool: NetnsPool, ns: NetNamespace) -> int:
    """The namespace's 64-bit cookie: never reused, unlike descriptor numbers and inodes."""
    with inside(pool, ns), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        return struct.unpack("Q", s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8))[0]


def time_wait_in(pool: NetnsPool, ns: NetNamespace) -> int:
    """A loopback TCP connection closed by the client first: its TIME_WAIT outlives both sockets."""
    with inside(pool, ns):
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        server, _ = listener.accept()
        client.sendall(b"x")
        server.recv(1)
        client.close()
        server.recv(1)  # the client's FIN
        server.close()
        listener.close()
        tcp = open("/proc/self/net/tcp").read()
    assert f":{port:04X} 06" in tcp, tcp  # state 06 is TIME_WAIT: there is something to find
    return port


def test_an_untouched_namespace_is_reused_and_looks_new(pool: NetnsPool) -> None:
    ns = pool.take()
    first = cookie(pool, ns)
    assert pool.give_back(ns) == "idle"
    again = pool.take()
    assert cookie(pool, again) == first
    assert pool.stats()["reused"] == 1 and pool.stats()["created"] == 1
    fresh = pool.take()
    with inside(pool, again):
        reused_view = read_fingerprint()
    with inside(pool, fresh):
        fresh_view = read_fingerprint()
    assert reused_view.differences(fresh_view) == []


def test_time_wait_makes_a_namespace_unusable(pool: NetnsPool) -> None:
    ns = pool.take()
    used = cookie(pool, ns)
    time_wait_in(pool, ns)
    assert pool.give_back(ns) == "closed:traffic"
    assert pool.idle == [] and pool.quarantine == []
    assert cookie(pool, pool.take()) != used
    assert pool.stats()["closed_traffic"] == 1


def test_any_packet_makes_a_namespace_unusable(pool: NetnsPool) -> None:
    ns = pool.take()
    with inside(pool, ns), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"x", ("127.0.0.1", 9))  # nobody listens: gone, but counted on lo and in Udp/Icmp
    time.sleep(0.05)
    assert pool.give_back(ns) == "closed:traffic"


def test_a_socket_still_alive_holds_the_namespace_back_until_it_is_gone(pool: NetnsPool) -> None:
    ns = pool.take()
    held = cookie(pool, ns)
    with inside(pool, ns):
        # An abstract socket kept alive from outside (as an agent's accepted socket is by its
        # peer in the scheduler until that closes).
        kept = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        kept.bind(b"\0sandpool-test-kept")
    assert pool.give_back(ns) == "quarantine"
    other = pool.take()  # never the quarantined one
    assert cookie(pool, other) != held
    pool.recheck()
    assert len(pool.quarantine) == 1
    kept.close()
    pool.recheck()
    assert pool.quarantine == [] and len(pool.idle) == 1
    again = pool.take()
    assert cookie(pool, again) == held
    with inside(pool, again), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        with pytest.raises(ConnectionRefusedError):
            probe.connect(b"\0sandpool-test-kept")


def test_a_socket_that_never_goes_is_closed_after_the_quarantine(pool: NetnsPool) -> None:
    pool.quarantine_checks = 3
    ns = pool.take()
    with inside(pool, ns):
        kept = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        assert pool.give_back(ns) == "quarantine"
        for _ in range(3):
            pool.recheck()
        assert pool.quarantine == [] and pool.idle == []
        assert pool.stats()["closed_sockets"] == 1
    finally:
        kept.close()


def test_a_changed_loopback_makes_a_namespace_unusable(pool: NetnsPool) -> None:
    import fcntl

    ns = pool.take()
    with inside(pool, ns), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        # Root can (a sandbox cannot: see the sandbox test below); the check must notice.
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14x", b"lo", 0))  # SIOCSIFFLAGS: down
    assert pool.give_back(ns) == "closed:loopback"


def test_spares_are_bounded(pool: NetnsPool) -> None:
    taken = [pool.take() for _ in range(6)]
    verdicts = [pool.give_back(ns) for ns in taken]
    assert verdicts == ["idle"] * 4 + ["closed:surplus"] * 2
    assert len(pool.fds()) == 1 + 4  # the host's descriptor and the spares


# --- real sandboxes -----------------------------------------------------------------------------

_COOKIE = ("import socket, struct\n"
           "with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as _s:\n"
           f"    print(struct.unpack('Q', _s.getsockopt(socket.SOL_SOCKET, {SO_NETNS_COOKIE}, 8))[0])\n")

_VIEW = r"""
import json, socket
def table(name):
    return [l.split() for l in open('/proc/net/' + name).read().splitlines()[1:]]
def counters(name):
    lines = open('/proc/net/' + name).read().splitlines()
    out = {}
    for head, values in zip(lines[::2], lines[1::2]):
        out.update({head.split(':')[0] + '.' + k: int(v) for k, v in zip(head.split()[1:], values.split()[1:])})
    return out
view = {'tcp': table('tcp') + table('tcp6'), 'udp': table('udp') + table('udp6'), 'raw': table('raw') + table('raw6'),
        'abstract': [r[-1] for r in table('unix') if len(r) > 7 and r[-1].startswith('@')],
        'lo': open('/proc/net/dev').read().splitlines()[2].split()[1:], 'snmp': counters('snmp')}
s = socket.socket()
try:
    s.bind(('127.0.0.1', 5555)); view['bind_5555'] = 'ok'
except OSError as e:
    view['bind_5555'] = type(e).__name__
finally:
    s.close()
u = socket.socket(socket.AF_UNIX)
try:
    u.connect(b'\0sandpool-a'); view['abstract_a'] = 'connected'
except OSError as e:
    view['abstract_a'] = type(e).__name__
finally:
    u.close()
print(json.dumps(view))
"""

_HOSTILE = r"""
import errno, fcntl, json, os, socket, struct
res = {}
listener = socket.create_server(('127.0.0.1', 5555))
client = socket.create_connection(('127.0.0.1', 5555))
server, _ = listener.accept()
client.close(); server.recv(1); server.close()            # TIME_WAIT on the client's side
held = socket.socket(socket.AF_INET); held.connect(('127.0.0.1', 5555)); held.close()   # more states
listener.close()
abstract = socket.socket(socket.AF_UNIX); abstract.bind(b'\0sandpool-a'); abstract.listen()
globals()['kept'] = abstract                                 # alive until the sandbox dies
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u: u.sendto(b'x', ('127.0.0.1', 9))
def attempt(name, call):
    try:
        call(); res[name] = 'done'
    except OSError as e:
        res[name] = errno.errorcode.get(e.errno, type(e).__name__)
ifreq = struct.pack('16sH14x', b'lo', 0)
ctl = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
attempt('lo_down', lambda: fcntl.ioctl(ctl.fileno(), 0x8914, ifreq))
attempt('lo_mtu', lambda: fcntl.ioctl(ctl.fileno(), 0x8922,
                                      struct.pack('16si12x', b'lo', 1280)))
attempt('sysctl', lambda: open('/proc/sys/net/ipv4/tcp_max_tw_buckets', 'w').write('7'))
attempt('raw', lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
attempt('packet', lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
attempt('ping', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP))
address = struct.pack('16sH2s4s8x', b'lo', socket.AF_INET, b'', socket.inet_aton('127.9.9.9'))
attempt('ip_addr', lambda: fcntl.ioctl(ctl.fileno(), 0x8916, address))
res['sys_mount'] = [l.split()[5].split(',')[0] for l in open('/proc/self/mountinfo') if l.split()[4] == '/proc/sys']
res['tcp'] = open('/proc/net/tcp').read()
print(json.dumps(res))
"""


def _wait_settled(harness: Harness) -> dict[str, int]:
    deadline = time.monotonic() + 10
    while True:
        stats = harness.stats()["netns"]
        if not stats["quarantined_now"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_hostile_sandbox_leaves_nothing_for_the_next(harness: Harness) -> None:
    a = harness.start()
    a_cookie = int(a.python(_COOKIE)["stdout"])
    out = a.python(_HOSTILE)
    assert out["stderr"] == "", out["stderr"]
    res = json.loads(out["stdout"])
    # It has no capability to change the namespace, and /proc/sys is read-only.
    assert res["lo_down"] == "EPERM" and res["lo_mtu"] == "EPERM", res
    assert res["sysctl"] in ("EROFS", "EACCES"), res
    assert res["sys_mount"] == ["ro"], res
    assert res["raw"] == "EPERM" and res["packet"] == "EPERM", res
    assert res["ping"] == "EACCES", res  # ping sockets: the new namespace's ping_group_range admits no group
    assert res["ip_addr"] == "EPERM", res
    assert "0100007F:15B3 06" in res["tcp"], res["tcp"]  # it did leave a TIME_WAIT (port 5555)
    before = _wait_settled(harness)
    harness.kill(a)
    after = _wait_settled(harness)
    assert after.get("closed_traffic", 0) == before.get("closed_traffic", 0) + 1, (before, after)

    b = harness.start()
    try:
        assert int(b.python(_COOKIE)["stdout"]) != a_cookie
        view = json.loads(b.python(_VIEW)["stdout"])
        assert view["tcp"] == [] and view["udp"] == [] and view["raw"] == [], view
        assert view["abstract"] == [] and view["abstract_a"] == "ConnectionRefusedError", view
        assert view["bind_5555"] == "ok"
        assert view["lo"] == ["0"] * 16, view["lo"]
        assert view["snmp"]["Tcp.ActiveOpens"] == 0 and view["snmp"]["Udp.OutDatagrams"] == 0, view["snmp"]
    finally:
        harness.kill(b)


def test_a_quiet_sandbox_hands_its_namespace_on_pristine(harness: Harness) -> None:
    a = harness.start()
    a_cookie = int(a.python(_COOKIE)["stdout"])
    # No packet: a bound (not connected) TCP socket, a UDP one, and an abstract listener, all
    # gone with the sandbox's processes.
    a.python("import socket\n"
             "t = socket.socket(); t.bind(('127.0.0.1', 5555)); t.listen()\n"
             "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('127.0.0.1', 5555))\n"
             "x = socket.socket(socket.AF_UNIX); x.bind(b'\\0sandpool-a'); x.listen()\n"
             "print(open('/proc/net/tcp').read().count(':15B3'))")
    before = _wait_settled(harness)
    harness.kill(a)
    after = _wait_settled(harness)
    assert after.get("returned_pristine", 0) == before.get("returned_pristine", 0) + 1, (before, after)

    b = harness.start()
    try:
        assert int(b.python(_COOKIE)["stdout"]) == a_cookie  # the same namespace, reused
        view = json.loads(b.python(_VIEW)["stdout"])
        assert view["tcp"] == [] and view["udp"] == [] and view["raw"] == [], view
        assert view["abstract"] == [] and view["abstract_a"] == "ConnectionRefusedError", view
        assert view["bind_5555"] == "ok"
        assert view["lo"] == ["0"] * 16, view["lo"]
        assert all(v == 0 for k, v in view["snmp"].items()
                   if k.split(".")[0] in ("Tcp", "Udp", "Icmp") and not k.startswith("Tcp.Rto")
                   and k != "Tcp.MaxConn"), view["snmp"]
    finally:
        harness.kill(b)


def test_two_live_sandboxes_never_share_a_namespace(harness: Harness) -> None:
    a, b = harness.start(), harness.start()
    try:
        assert int(a.python(_COOKIE)["stdout"]) != int(b.python(_COOKIE)["stdout"])
        assert harness.stats()["netns"]["in_use"] >= 2
    finally:
        harness.kill(a)
        harness.kill(b)


def test_no_spares_means_a_new_namespace_for_every_sandbox() -> None:
    if os.geteuid() != 0:
        pytest.skip("isolation tests need root (namespaces, cgroups)")
    harness = Harness(netns_spares=0)
    try:
        cookies = []
        for _ in range(2):
            sandbox = harness.start()
            cookies.append(int(sandbox.python(_COOKIE)["stdout"]))
            harness.kill(sandbox)
        stats = _wait_settled(harness)
        assert cookies[0] != cookies[1]
        assert stats.get("reused", 0) == 0 and stats["idle"] == 0, stats
        assert stats.get("closed_surplus", 0) == 2, stats
    finally:
        harness.close()


def test_a_sandbox_holds_no_namespace_descriptor(harness: Harness) -> None:
    """The pool and the host's own namespace stay the zygote's: a forked sandbox closes
    every descriptor of them, so nothing in it could enter another namespace even with the rights."""
    a, b = harness.start(), harness.start()
    try:
        pids = [pid for pid in os.listdir("/proc") if pid.isdigit() and _in_sandbox(pid, a.sandbox_id)]
        assert pids, "found no process of the sandbox: the test could not fail"
        held = []
        for pid in pids:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(("net:[", "pid:[")):
                    held.append((pid, fd, target))
        assert held == [], held
        assert harness.stats()["netns"]["in_use"] >= 2  # the zygote does hold them
    finally:
        harness.kill(a)
        harness.kill(b)


def _in_sandbox(pid: str, sandbox_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/cgroup") as fh:
            groups = fh.read()
    except OSError:
        return False
    return any(line.endswith(f"/{sandbox_id}") or f"/{sandbox_id}/" in line for line in groups.splitlines())
