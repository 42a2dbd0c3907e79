"""Network namespaces made once and reused while nothing of their last sandbox is left in them.

Why: making a network namespace and having the kernel tear it down again costs
about 25 ms of CPU (most of it in the kernel's cleanup worker), more than the
whole budget of a sandbox's start and teardown. Most sandboxes never use their
loopback at all, so their namespace ends exactly as it began.

The rule (docs/isolation.md, "Network namespaces are reused only when
pristine"): a namespace goes to at most one live sandbox; it comes back only
once that sandbox's PID-namespace init has been reaped (the kernel has killed
and released every process of the sandbox by then); and it is handed out again
only if everything of it a process can observe equals what it was when the
namespace was made (`Fingerprint`): no socket of any family left (orphaned TCP,
TIME_WAIT, a Unix socket kept alive by its peer or by descriptors in flight),
not one packet or error counted on loopback or in the IP, ICMP, TCP and UDP
counters, and loopback's flags and MTU as set. Anything else is closed: the
kernel frees it off the request path. What a sandbox could change without
moving any of these needs capabilities it does not have (CAP_NET_ADMIN,
CAP_NET_RAW, CAP_SYS_ADMIN) or a writable /proc/sys, which it lacks.

All of it runs in the zygote, which is single-threaded: it enters a namespace
with setns(2), reads or forks, and returns to its own namespace at once.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field

from . import linux

log = logging.getLogger("sandpool.isolation.netns")

# Per-namespace fields of /proc/net/sockstat (the others there, such as TCP's orphan, alloc and
# mem, are totals of the whole host and move with every other namespace's traffic).
_SOCKSTAT_FIELDS = {("sockets:", "used"), ("TCP:", "inuse"), ("TCP:", "tw"), ("UDP:", "inuse"),
                    ("UDPLITE:", "inuse"), ("RAW:", "inuse"), ("FRAG:", "inuse"), ("FRAG:", "memory")}
# Read whole: every line is the namespace's own (counters, the interface table).
_WHOLE_FILES = ("sockstat6", "dev", "snmp", "snmp6", "netstat")
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _SIOCGIFMTU = 0x8913, 0x8914, 0x8921
_IFF_UP = 0x1


@dataclass(frozen=True)
class Fingerprint:
    """What a process in the namespace can see of its past use, as compared before reuse."""

    sockets: tuple[tuple[str, str, int], ...]
    files: tuple[tuple[str, bytes], ...]
    loopback: tuple[int, int]

    def live_sockets(self) -> int:
        return sum(value for head, name, value in self.sockets if name in ("used", "inuse", "tw"))

    def differences(self, other: Fingerprint) -> list[str]:
        """Names of what differs (empty: the same)."""
        out = []
        if self.sockets != other.sockets:
            out.append("sockets")
        out += [name for (name, mine), (_, theirs) in zip(self.files, other.files, strict=True) if mine != theirs]
        if self.loopback != other.loopback:
            out.append("loopback")
        return out


def read_fingerprint(proc_net: str = "/proc/self/net") -> Fingerprint:
    """The fingerprint of the namespace the calling thread is in (/proc/self/net is looked up
    afresh on every open, so it shows the namespace entered last)."""
    sockets = []
    with open(f"{proc_net}/sockstat", "rb") as f:
        for line in f.read().decode().splitlines():
            words = line.split()
            if not words:
                continue
            head = words[0]
            for name, value in zip(words[1::2], words[2::2], strict=False):
                if (head, name) in _SOCKSTAT_FIELDS:
                    sockets.append((head, name, int(value)))
    files = []
    for name in _WHOLE_FILES:
        try:
            with open(f"{proc_net}/{name}", "rb") as f:
                files.append((name, f.read()))
        except FileNotFoundError:  # no IPv6 in this kernel: absent for every namespace alike
            files.append((name, b""))
    return Fingerprint(tuple(sockets), tuple(files), _loopback_state())


def _loopback_state() -> tuple[int, int]:
    """Flags and MTU of `lo`, read through an AF_UNIX socket: its release is synchronous and
    leaves nothing behind (an AF_INET one would be freed after an RCU grace period)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0)))[1]
        mtu = struct.unpack("16si12x", fcntl.ioctl(s.fileno(), _SIOCGIFMTU, struct.pack("16si12x", b"lo", 0)))[1]
    return flags, mtu


@dataclass
class NetNamespace:
    """One namespace, held by its descriptor (which keeps it alive with no process in it)."""

    fd: int
    baseline: Fingerprint
    uses: int = 0


@dataclass
class NetnsPool:
    """Namespaces for the zygote's sandboxes: `take` one per sandbox, `give_back` after its reap.

    `spares` is how many idle namespaces are kept (0: none, every namespace is closed after its
    one sandbox, as without a pool). Returned namespaces whose only difference is a socket that
    is still being freed (a Unix socket whose peer outside the sandbox has not closed yet) wait in
    `quarantine` and are looked at again by `recheck`; once `quarantine_checks` looks have not
    found them clean they are closed.
    """

    spares: int = 32
    quarantine_checks: int = 10
    idle: list[NetNamespace] = field(default_factory=list)
    quarantine: list[tuple[NetNamespace, int]] = field(default_factory=list)
    in_use: dict[int, NetNamespace] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    host: int = -1

    def __post_init__(self) -> None:
        self.host = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    # -- handing out -----------------------------------------------------------------------------
    def take(self) -> NetNamespace:
        """An idle pristine namespace (the most recently returned), or a new one."""
        if self.idle:
            ns = self.idle.pop()
            self.counts["reused"] += 1
        else:
            ns = self._make()
            self.counts["created"] += 1
        ns.uses += 1
        self.in_use[ns.fd] = ns
        return ns

    def _make(self) -> NetNamespace:
        linux.unshare(linux.CLONE_NEWNET)
        fd = -1
        try:
            fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            linux.loopback_up()
            baseline = read_fingerprint()
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        finally:
            self.leave()
        return NetNamespace(fd, baseline)

    def enter(self, ns: NetNamespace) -> None:
        linux.setns(ns.fd, linux.CLONE_NEWNET)

    def leave(self) -> None:
        """Back to the zygote's own namespace; failing that, the zygote must not go on."""
        try:
            linux.setns(self.host, linux.CLONE_NEWNET)
        except OSError as exc:  # pragma: no cover - setns to a namespace we hold cannot fail
            log.critical("cannot return to the host network namespace: %s", exc)
            os._exit(70)

    # -- taking back -----------------------------------------------------------------------------
    def give_back(self, ns: NetNamespace) -> str:
        """Called once every process that was in `ns` is gone. Returns what became of it:
        "idle", "quarantine", or "closed:<reason>"."""
        self.in_use.pop(ns.fd, None)
        verdict = self._judge(ns)
        if verdict == "pristine":
            return self._keep(ns)
        if verdict == "sockets":
            self.quarantine.append((ns, 0))
            self.counts["quarantined"] += 1
            return "quarantine"
        return self._close(ns, verdict)

    def recheck(self) -> None:
        """Look at quarantined namespaces again: pristine ones become idle, the rest wait (or
        are closed after `quarantine_checks` looks)."""
        waiting, self.quarantine = self.quarantine, []
        for ns, looks in waiting:
            verdict = self._judge(ns)
            if verdict == "pristine":
                self._keep(ns)
            elif verdict == "sockets" and looks + 1 < self.quarantine_checks:
                self.quarantine.append((ns, looks + 1))
            else:
                self._close(ns, verdict)

    def _judge(self, ns: NetNamespace) -> str:
        """"pristine"; "sockets" when sockets are still being freed and nothing else moved; or the
        reason the namespace can never be reused ("traffic", "loopback", "unreadable")."""
        try:
            self.enter(ns)
            try:
                now = read_fingerprint()
            finally:
                self.leave()
        except OSError as exc:
            log.warning("cannot read a returned network namespace, closing it: %s", exc)
            return "unreadable"
        differences = now.differences(ns.baseline)
        if not differences:
            return "pristine"
        if differences == ["sockets"] and not any(name == "tw" and value for _, name, value in now.sockets):
            return "sockets"
        if "loopback" in differences:
            return "loopback"
        if differences == ["sockets"]:
            return "time_wait"
        return "traffic"

    def _keep(self, ns: NetNamespace) -> str:
        if len(self.idle) >= self.spares:
            return self._close(ns, "surplus")
        self.idle.append(ns)
        self.counts["returned_pristine"] += 1
        return "idle"

    def _close(self, ns: NetNamespace, reason: str) -> str:
        os.close(ns.fd)
        self.counts[f"closed_{reason}"] += 1
        if reason not in ("surplus",):
            log.debug("closed a used network namespace (%s) after %d uses", reason, ns.uses)
        return f"closed:{reason}"

    # -- bookkeeping -----------------------------------------------------------------------------
    def fds(self) -> list[int]:
        """Every descriptor the pool holds (a forked sandbox closes them all)."""
        return [self.host, *(ns.fd for ns in self.idle), *(ns.fd for ns, _ in self.quarantine), *self.in_use]

    def stats(self) -> dict[str, int]:
        return {**self.counts, "idle": len(self.idle), "quarantined_now": len(self.quarantine),
                "in_use": len(self.in_use)}

    def close(self) -> None:
        for ns in [*self.idle, *(ns for ns, _ in self.quarantine), *self.in_use.values()]:
            try:
                os.close(ns.fd)
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    raise
        self.idle, self.quarantine, self.in_use = [], [], {}
        if self.host >= 0:
            os.close(self.host)
            self.host = -1


__all__ = ["Fingerprint", "NetNamespace", "NetnsPool", "read_fingerprint"]
