"""The runner template: a pre-imported runner that forks runners into sandboxes (stdlib only).

Starting a runner as a new interpreter costs ~25 ms of CPU per sandbox: the interpreter's own
start, the runner's imports, compiling its source. The zygote instead keeps one template per
sandbox Python (`python -I -S -u -c <runner.py + this file> --template FD`), started once,
outside every sandbox, holding nothing of any sandbox. For a runner it forks once, into the
sandbox's PID namespace: it points its own namespace for children (`pid_for_children`) at the
sandbox's through the sandbox's PID file descriptor, forks, and points it back at its own at once
(if that fails, it exits: the zygote starts a new template). The child enters the agent's other
namespaces (mount, network, IPC, UTS) through the same descriptor, keeps only the descriptors it
needs, joins the agent's cgroups and the cgroup namespace, and is the runner. The template waits
for nothing of it: nothing in a sandbox can hold it up for everyone (and it takes only pipes and
/dev/null from an agent, nothing whose close could block).

The runner then confines itself exactly as the agent is confined (the agent's capability sets
and bounding set, no_new_privs, the agent's seccomp filter: what any child of the agent
inherits), whatever the agent asks; then it tells the agent its pid, and only once the agent has
moved it into the code cgroup does it read its set-up (environment, directory, `--harden` spec)
from its request pipe and run runner.py's `main`, which hardens it as an exec'd runner hardens
itself. The agent verifies the result in /proc as it does for that one. What the agent sends
never passes through the template's memory, so no sandbox's environment can reach another's
runner; the template knows only pids, descriptors and the fixed confinement.

The template is the runners' parent (a process forked into a PID namespace from outside is
parented outside it) and their subreaper (so it was when a first child forked them and exited;
nothing of its own is forked below them now): it reaps them and reports each exit
status to the agent on that sandbox's channel. It never blocks on an agent: channels are
non-blocking, a report that does not fit is dropped, and a sandbox has at most `_MAX_RUNNERS`.

Protocol (SOCK_SEQPACKET): the zygote first sends `C<json>` (its pid, the agent's capabilities
and seccomp program), then per sandbox `A<flags>,<n>` with the channel, the sandbox's PID
descriptor and the n `cgroup.procs` descriptors of its agent; the agent sends `S` with stdin,
stdout, stderr, the request pipe's read end and the event pipe's write end; the template sends
the agent `X<pid> <wait status>` when a runner it forked exits.
"""

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandpool.agent.runner import _flush_all, _install_filter, _prctl, _recv, _send, _warm, main

import atexit  # noqa: E402 - after the runner's source, whose names this file uses
import builtins  # noqa: E402
import ctypes  # noqa: E402
import fcntl  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import stat  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

_CONFIGURE, _ADD, _SPAWN, _EXITED = b"C", b"A", b"S", b"X"
_SPAWN_FDS = 5  # stdin, stdout, stderr, the request pipe's read end, the event pipe's write end
_MAX_RUNNERS = 4  # live runners of one sandbox (the runner, its spare, one of each starting)
_FAILED = 70
_DRAIN_SECONDS = 10.0  # the longest it outlives the zygote, reaping its runners
_CLONE_NEWCGROUP, _CLONE_NEWPID = 0x02000000, 0x20000000
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 24, 38, 36


class _Sandbox:
    """What the template holds of one sandbox: descriptors, namespace flags, its runners' pids."""

    def __init__(self, channel: int, pidfd: int, procs: list[int], flags: int) -> None:
        self.channel, self.pidfd, self.procs, self.flags = channel, pidfd, procs, flags
        self.runners: set[int] = set()  # host pids, until reaped

    def close(self) -> None:
        for fd in (self.channel, self.pidfd, *self.procs):
            os.close(fd)


class _Confinement:
    """The agent's own confinement, fixed by the zygote, the descriptor limit it had, and the
    template's own PID namespace (where its namespace for children goes back to after each fork)."""

    def __init__(self, keep_caps: set[int], last_cap: int, program: bytes, nofile: tuple[int, int]) -> None:
        self.keep_caps, self.last_cap, self.program, self.nofile = keep_caps, last_cap, program, nofile
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)


def _recv_fds(fd: int, max_fds: int) -> tuple[bytes, list[int], bool]:
    """One message, its descriptors, and whether any were cut off (MSG_CTRUNC). A socket object
    only for the call: none stays in memory that a forked runner could close by accident."""
    sock = socket.socket(fileno=fd)
    try:
        message, fds, flags, _addr = socket.recv_fds(sock, 4096, max_fds)
    finally:
        sock.detach()
    return message, fds, bool(flags & socket.MSG_CTRUNC)


def _capset(libc: ctypes.CDLL, keep: set[int]) -> None:
    """Effective and permitted to `keep`, inheritable empty (capset(2), version 3)."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    mask = sum(1 << cap for cap in keep)
    data = (Data * 2)(Data(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0), Data(mask >> 32, mask >> 32, 0))
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _confine(libc: ctypes.CDLL, confinement: _Confinement) -> None:
    """Become exactly as confined as a child of the agent: its bounding set, capabilities,
    no_new_privs and seccomp filter (zygote_child.prepare did the same to the agent)."""
    prctl = _prctl(libc)
    for cap in range(confinement.last_cap + 1):
        if cap not in confinement.keep_caps and prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP failed")
    _capset(libc, confinement.keep_caps)
    if prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if confinement.program:
        _install_filter(libc, confinement.program)


class _Serving:
    started = False  # the runner reached `main`: only then are atexit handlers the session's own


def _runner(flags: int, procs: int, confinement: _Confinement) -> int:
    """In the sandbox, on fds 0-4 (5: the PID descriptor, 6-: the agent's cgroup.procs): join the
    agent's cgroups and cgroup namespace, confine, say its pid, wait for the set-up, serve."""
    libc = ctypes.CDLL(None, use_errno=True)
    for fd in range(6, 6 + procs):
        os.write(fd, b"0")
    if flags & _CLONE_NEWCGROUP and libc.setns(5, _CLONE_NEWCGROUP) != 0:
        raise OSError(ctypes.get_errno(), "setns of the cgroup namespace failed")
    os.closerange(5, 6 + procs)
    os.setsid()
    _confine(libc, confinement)
    _send(4, {"event": "spawned", "pid": os.getpid()})
    setup = _recv(3)  # written by the agent once it has moved this process into the code cgroup
    if setup is None:
        return 0
    env, cwd, argv = setup["env"], setup["cwd"], setup["argv"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _Serving.started = True
    return main(["", *argv, "3", "4"])


def _enter(sandbox: _Sandbox, fds: list[int], confinement: _Confinement, tables: tuple[dict, ...]) -> None:
    """The runner, just forked into the sandbox's PID namespace: into its other namespaces but the
    cgroup one, keep only its descriptors, then `_runner`; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = _FAILED
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, confinement.nofile)  # the zygote's, as an agent has
        libc = confinement.libc
        # The PID namespace is its own already (it was forked into it): this one only sets its children's.
        if libc.setns(sandbox.pidfd, sandbox.flags & ~_CLONE_NEWCGROUP) != 0:
            raise OSError(ctypes.get_errno(), "setns failed")
        # The agent's five descriptors become 0-4, the PID descriptor 5, the cgroup files 6 on;
        # nothing else of the template's.
        keep = (*fds, sandbox.pidfd, *sandbox.procs)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64 + len(keep)) for fd in keep]
        for number, fd in enumerate(high):
            os.dup2(fd, number)
        os.closerange(len(keep), 2**31 - 1)
        for table in tables:  # the other sandboxes' descriptors (now closed) and their runners' pids
            table.clear()
        code = _runner(sandbox.flags, len(sandbox.procs), confinement)
    except BaseException as exc:  # noqa: BLE001 - never serve half-confined; say why on stderr
        try:
            os.write(2, f"sandpool runner: cannot start from the template: {exc}\n".encode())
        except OSError:
            pass
    try:
        if _Serving.started:
            atexit._run_exitfuncs()  # what `sys.exit` would have run for the session's code
    finally:
        _flush_all()
        os._exit(code)


def _ns_pid(host_pid: int) -> int:
    """The pid of `host_pid` in its innermost PID namespace (the sandbox's); 0 if unknown."""
    try:
        fd = os.open(f"/proc/{host_pid}/status", os.O_RDONLY)
    except OSError:
        return 0
    try:
        status = os.read(fd, 4096)
    finally:
        os.close(fd)
    for line in status.split(b"\n"):
        if line.startswith(b"NSpid:"):
            last = line.split()[-1]
            return int(last) if last.isdigit() else 0
    return 0


def _spawn(sandbox: _Sandbox, fds: list[int], runners: dict[int, tuple[_Sandbox, int]],
           confinement: _Confinement, sandboxes: dict[int, _Sandbox]) -> None:
    """Fork a runner straight into the sandbox's PID namespace: only the template's namespace for
    children moves there, for this one fork; the template itself stays where it is."""
    libc = confinement.libc
    moved = bool(sandbox.flags & _CLONE_NEWPID)
    if moved and libc.setns(sandbox.pidfd, _CLONE_NEWPID) != 0:
        return  # its agent is gone (the agent, were it alive, would see its event pipe close)
    try:
        pid = os.fork()
    except OSError:
        pid = -1  # the agent sees its event pipe close and starts a runner itself
    if pid == 0:
        try:
            _enter(sandbox, fds, confinement, (sandboxes, runners))
        finally:
            os._exit(_FAILED)
    if moved and libc.setns(confinement.own_pid_ns, _CLONE_NEWPID) != 0:
        # Its next fork would land in this sandbox: never again. The zygote starts a new template.
        os.write(2, b"sandpool runner template: cannot return to its own PID namespace\n")
        os._exit(_FAILED)
    if pid > 0:
        host_pid = pid  # the runner: this template's child, alive or a zombie till reaped
        sandbox.runners.add(host_pid)
        runners[host_pid] = (sandbox, _ns_pid(host_pid))


def _reap_runners(runners: dict[int, tuple[_Sandbox, int]], sandboxes: dict[int, _Sandbox]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sandbox, ns_pid = runners.pop(pid, (None, 0))
        if sandbox is None:
            continue
        sandbox.runners.discard(pid)
        if ns_pid and sandboxes.get(sandbox.channel) is sandbox:  # still its channel, not a successor's
            try:
                os.write(sandbox.channel, _EXITED + b"%d %d" % (ns_pid, status))
            except OSError:
                pass  # full or gone: the agent learns of the exit from its pidfd instead


def _on_control(control: int, sandboxes: dict[int, _Sandbox], poller: select.poll) -> bool:
    """One message of the zygote's; False at its end of stream."""
    message, fds, truncated = _recv_fds(control, 16)
    if not message:
        return False
    head, _, count = message[1:].partition(b",")
    if message[:1] == _ADD and not truncated and head.isdigit() and count.isdigit() \
            and len(fds) == 2 + int(count):
        os.set_blocking(fds[0], False)
        sandbox = _Sandbox(fds[0], fds[1], fds[2:], int(head))
        sandboxes[sandbox.channel] = sandbox
        poller.register(sandbox.channel, select.POLLIN)
    else:  # a sandbox whose cgroup files did not all arrive gets no runner from here
        for fd in fds:
            os.close(fd)
    return True


def _usable(fd: int) -> bool:
    """Whether a descriptor an agent sent may become a runner's stdin, stdout, stderr or control
    pipe: a pipe or a character device (/dev/null), nothing a close could block on."""
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def _close_received(fd: int) -> None:
    """Close a descriptor an agent sent without waiting on it: a socket with SO_LINGER set could
    hold a blocking close(2) (and so the template) for as long as it says."""
    try:
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            sock = socket.socket(fileno=fd)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 0, 0))
            finally:
                sock.detach()
    except OSError:
        pass
    os.close(fd)


def _on_channel(fd: int, events: int, sandboxes: dict[int, _Sandbox], runners: dict[int, tuple[_Sandbox, int]],
                confinement: _Confinement, poller: select.poll) -> None:
    sandbox = sandboxes[fd]
    message, fds, truncated = b"", list[int](), False
    try:
        if events & select.POLLIN:
            message, fds, truncated = _recv_fds(fd, _SPAWN_FDS)
        if message == _SPAWN and len(fds) == _SPAWN_FDS and not truncated \
                and len(sandbox.runners) < _MAX_RUNNERS and all(_usable(received) for received in fds):
            _spawn(sandbox, fds, runners, confinement, sandboxes)
    except BlockingIOError:
        return
    except ConnectionError:  # an agent that died with reports unread resets its channel: it is gone
        message = b""
    finally:
        for extra in fds:
            _close_received(extra)
    if not message:  # the agent is gone (its sandbox with it)
        poller.unregister(fd)
        del sandboxes[fd]
        sandbox.close()


def _template(argv: list[str]) -> int:
    """`--template FD`: serve the zygote on FD (its first message configures the template)."""
    control = int(dict(zip(argv[1::2], argv[2::2], strict=True))["--template"])
    # No PDEATHSIG: its runners' sandboxes cannot finish dying until their runners are reaped,
    # and only their parent, this template, reaps them. It outlives the zygote until it has.
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = _prctl(libc)
    message, fds, _truncated = _recv_fds(control, 1)
    for fd in fds:
        os.close(fd)
    if message[:1] != _CONFIGURE:
        return 1
    config = json.loads(message[1:])
    if os.getppid() != config["parent"]:  # the zygote is gone already
        return 1
    prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)  # one channel, pidfd and cgroup files per sandbox
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile[1], nofile[1]))
    with open("/proc/sys/kernel/cap_last_cap") as last:
        last_cap = int(last.read())
    confinement = _Confinement(set(config["keep_caps"]), last_cap, bytes.fromhex(config["seccomp"]), nofile)
    del config, message
    _warm({"__name__": "__main__", "__builtins__": builtins})
    # What exists now is never collected, so no runner's collector walks (and so copies) these pages.
    gc.collect()
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    poller = select.poll()
    poller.register(control, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    sandboxes: dict[int, _Sandbox] = {}  # by channel descriptor
    runners: dict[int, tuple[_Sandbox, int]] = {}  # host pid -> (its sandbox, its pid there)
    draining_until = 0.0
    while True:
        if draining_until and (not runners or time.monotonic() > draining_until):
            return 0
        for fd, events in poller.poll(500 if draining_until else None):
            try:
                if fd == wake_r:
                    while True:
                        try:
                            if not os.read(wake_r, 512):
                                break
                        except BlockingIOError:
                            break
                    _reap_runners(runners, sandboxes)
                elif fd == control:
                    if not _on_control(control, sandboxes, poller):
                        # The zygote is gone, and with it every agent: their runners die with their
                        # PID namespaces. Reap them (a bounded while), then go.
                        poller.unregister(control)
                        draining_until = time.monotonic() + _DRAIN_SECONDS
                elif fd in sandboxes and not draining_until:
                    _on_channel(fd, events, sandboxes, runners, confinement, poller)
            except Exception as exc:  # noqa: BLE001 - one message must not take every sandbox's template down
                try:
                    os.write(2, f"sandpool runner template: {type(exc).__name__}: {exc}\n".encode())
                except OSError:
                    pass


if __name__ == "__main__" and sys.argv[1:2] == ["--template"]:
    sys.exit(_template(sys.argv))
