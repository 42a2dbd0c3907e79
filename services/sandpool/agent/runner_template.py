"""The runner template: a pre-imported runner that forks runners into sandboxes (stdlib only).

Starting a runner as a new interpreter costs ~25 ms of CPU per sandbox: the interpreter's own
start, the runner's imports, compiling its source. The zygote instead keeps one template per
sandbox Python (`python -I -S -u -c <runner.py + this file> --template ...`), started once,
outside every sandbox, holding nothing of any sandbox. For a runner it forks twice: the first
child joins the sandbox's agent cgroup and, through the sandbox's PID file descriptor, every
namespace of its agent (mount, PID, network, IPC, UTS, cgroup), keeps only the five descriptors
the agent sent, and forks the runner, which is then inside the sandbox's PID namespace.

The runner first confines itself exactly as the agent is confined (the agent's capability sets
and bounding set, no_new_privs, the agent's seccomp filter: what any child of the agent
inherits), whatever the agent asks; then it tells the agent its pid, and only once the agent has
moved it into the code cgroup does it read its set-up (environment, directory, `--harden` spec)
from its request pipe and run runner.py's `main`, which hardens it as an exec'd runner hardens
itself. The agent verifies the result in /proc as it does for that one. What the agent sends
never passes through the template's memory, so no sandbox's environment can reach another's
runner; the template knows only pids, descriptors and the fixed confinement.

The template is the runners' subreaper (their first parent exits at once, and a process entered
into a PID namespace from outside is parented outside it): it reaps them and reports each exit
status to the agent on that sandbox's channel.

Protocol (SOCK_SEQPACKET): the zygote sends `A<flags>` with the channel, the sandbox's PID
descriptor and its agent cgroup's `cgroup.procs` descriptors; the agent sends `S` with stdin,
stdout, stderr, the request pipe's read end and the event pipe's write end; the template sends
the agent `X<pid> <wait status>` when a runner it forked exits.
"""

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandpool.agent.runner import _flush_all, _install_filter, _prctl, _recv, _send, _warm, main

import builtins  # noqa: E402 - after the runner's source, whose names this file uses
import ctypes  # noqa: E402
import fcntl  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

_ADD, _SPAWN, _EXITED = b"A", b"S", b"X"
_SPAWN_FDS = 5  # stdin, stdout, stderr, the request pipe's read end, the event pipe's write end
_FAILED = 70
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 1, 24, 38, 36


class _Sandbox:
    """What the template holds of one sandbox: descriptors and namespace flags, nothing else."""

    def __init__(self, channel: int, pidfd: int, procs: list[int], flags: int) -> None:
        self.channel, self.pidfd, self.procs, self.flags = channel, pidfd, procs, flags

    def close(self) -> None:
        for fd in (self.channel, self.pidfd, *self.procs):
            os.close(fd)


class _Confinement:
    """The agent's own confinement, fixed by the zygote when it starts the template."""

    def __init__(self, keep_caps: set[int], last_cap: int, program: bytes) -> None:
        self.keep_caps, self.last_cap, self.program = keep_caps, last_cap, program


def _recv_fds(fd: int, max_fds: int) -> tuple[bytes, list[int]]:
    """One message and its descriptors; a socket object only for the call (none stays in memory
    that a forked runner could close by accident)."""
    sock = socket.socket(fileno=fd)
    try:
        message, fds, _flags, _addr = socket.recv_fds(sock, 64, max_fds)
    finally:
        sock.detach()
    return message, fds


def _send_on(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:
        pass  # the agent is gone; its channel is dropped when the template sees the hang-up


def _ns_pid(host_pid: int) -> int | None:
    """The pid of `host_pid` in its innermost PID namespace (the sandbox's)."""
    try:
        with open(f"/proc/{host_pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


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


def _confine(confinement: _Confinement) -> None:
    """Become exactly as confined as a child of the agent: its bounding set, capabilities,
    no_new_privs and seccomp filter (zygote_child.prepare did the same to the agent)."""
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = _prctl(libc)
    for cap in range(confinement.last_cap + 1):
        if cap not in confinement.keep_caps and prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP failed")
    _capset(libc, confinement.keep_caps)
    if prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if confinement.program:
        _install_filter(libc, confinement.program)


def _runner(confinement: _Confinement) -> int:
    """In the sandbox, on fds 0-4: confine, say which pid this is, wait for the set-up, serve."""
    os.setsid()
    _confine(confinement)
    _send(4, {"event": "spawned", "pid": os.getpid()})
    setup = _recv(3)  # written by the agent once it has moved this process into the code cgroup
    if setup is None:
        return 0
    env, cwd, argv = setup["env"], setup["cwd"], setup["argv"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    return main(["", *argv, "3", "4"])


def _enter(sandbox: _Sandbox, fds: list[int], report: int, confinement: _Confinement) -> None:
    """The first child: into the sandbox's cgroup and namespaces, then fork the runner; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for procs in sandbox.procs:  # before the cgroup namespace changes, from the host's view
        os.write(procs, b"0")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(sandbox.pidfd, sandbox.flags) != 0:
        raise OSError(ctypes.get_errno(), "setns failed")
    # The agent's five descriptors become 0-4 and the report pipe 5; nothing else of the template's.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 16) for fd in (*fds, report)]
    for number, fd in enumerate(high):
        os.dup2(fd, number)
    os.closerange(6, 1 << 20)
    pid = os.fork()
    if pid == 0:
        os.close(5)
        code = _FAILED
        try:
            code = _runner(confinement)
        except BaseException as exc:  # noqa: BLE001 - never serve half-confined; say why on stderr
            try:
                os.write(2, f"sandpool runner: cannot start from the template: {exc}\n".encode())
            except OSError:
                pass
        _flush_all()
        os._exit(code)
    os.write(5, str(pid).encode())
    os._exit(0)


def _spawn(sandbox: _Sandbox, fds: list[int], runners: dict[int, tuple[int, int]],
           confinement: _Confinement) -> None:
    report_r, report_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(report_r)
        os.close(report_w)
        return  # the agent sees its event pipe close and starts a runner itself
    if pid == 0:
        try:
            _enter(sandbox, fds, report_w, confinement)
        finally:
            os._exit(_FAILED)
    os.close(report_w)
    try:
        reported = os.read(report_r, 32)
    finally:
        os.close(report_r)
    os.waitpid(pid, 0)
    if reported:
        host_pid = int(reported)
        ns_pid = _ns_pid(host_pid)
        if ns_pid is not None:
            runners[host_pid] = (sandbox.channel, ns_pid)


def _reap_runners(runners: dict[int, tuple[int, int]], sandboxes: dict[int, _Sandbox]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        channel, ns_pid = runners.pop(pid, (-1, 0))
        if channel in sandboxes:
            _send_on(channel, _EXITED + f"{ns_pid} {status}".encode())


def _template(argv: list[str]) -> int:
    """`--template FD --parent PID --keep-caps 0,1,.. --seccomp HEX`: serve the zygote on FD."""
    options = dict(zip(argv[1::2], argv[2::2], strict=True))
    control, parent = int(options["--template"]), int(options["--parent"])
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = _prctl(libc)
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        return 1
    prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    with open("/proc/sys/kernel/cap_last_cap") as last:
        last_cap = int(last.read())
    confinement = _Confinement({int(c) for c in options["--keep-caps"].split(",") if c}, last_cap,
                               bytes.fromhex(options.get("--seccomp", "")))
    _warm({"__name__": "__main__", "__builtins__": builtins})
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    poller = select.poll()
    poller.register(control, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    sandboxes: dict[int, _Sandbox] = {}  # by channel descriptor
    runners: dict[int, tuple[int, int]] = {}  # host pid -> (channel, pid in the sandbox)
    while True:
        for fd, events in poller.poll():
            if fd == wake_r:
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                _reap_runners(runners, sandboxes)
            elif fd == control:
                message, fds = _recv_fds(control, 8)
                if not message:
                    return 0  # the zygote is gone
                if message[:1] == _ADD and len(fds) >= 2 and message[1:].isdigit():
                    sandbox = _Sandbox(fds[0], fds[1], fds[2:], int(message[1:]))
                    sandboxes[sandbox.channel] = sandbox
                    poller.register(sandbox.channel, select.POLLIN)
                else:
                    for extra in fds:
                        os.close(extra)
            elif fd in sandboxes:
                sandbox = sandboxes[fd]
                try:
                    message, fds = _recv_fds(fd, _SPAWN_FDS) if events & select.POLLIN else (b"", [])
                except OSError:
                    message, fds = b"", []
                if message == _SPAWN and len(fds) == _SPAWN_FDS:
                    _spawn(sandbox, fds, runners, confinement)
                for extra in fds:
                    os.close(extra)
                if not message:  # the agent is gone (its sandbox with it)
                    poller.unregister(fd)
                    del sandboxes[fd]
                    sandbox.close()


if __name__ == "__main__" and sys.argv[1:2] == ["--template"]:
    sys.exit(_template(sys.argv))
