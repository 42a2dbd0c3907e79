"""What a freshly forked sandbox does before it becomes the agent.

Runs in the child the zygote forked, as PID 1 of a new PID namespace (when the
namespaces layer is active). The order matters:

1. leave the zygote's session, die with the zygote (PDEATHSIG), forget its fds;
2. join the sandbox's cgroups first, so everything after, and every process the
   sandbox ever makes, is counted against its limits;
3. read the secret from its memfd (it never passed through the zygote's memory);
4. join the zygote's template mount namespace (the read-only part of every root, built once:
   isolation/mounts.py), then unshare mount, IPC, UTS and cgroup namespaces (the network namespace is one the
   zygote forked it into, from its pool of pristine ones; see isolation/netns.py,
   or a new one when it has none); open the agent's
   descriptor of the code's process-capped cgroup (from a cgroup mount of the
   sandbox's own namespace, detached at once); mount its own parts of the root and pivot;
5. drop every capability the agent does not need (it keeps only what it takes to
   start children as the sandbox uid, chown workspace files and kill its
   children), for good, via the bounding set;
6. install the seccomp filter on the agent itself (its children inherit it);
7. clear the environment, report "ok" to the zygote, and serve (the agent tells the
   provider itself, on a pipe the provider passed through, once it accepts connections).

Any failure is written to the status pipe and the child exits: a sandbox is
never served half-isolated.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, NoReturn

from sandpool.agent import seccomp
from sandpool.core.logs import configure_logging

from . import zygote_protocol
from .isolation import linux, mounts
from .isolation.cgroups import SandboxCgroup

# Capabilities the agent keeps (linux/capability.h): CHOWN, DAC_OVERRIDE,
# DAC_READ_SEARCH, FOWNER, FSETID, KILL, SETGID, SETUID. Not SYS_ADMIN (no more
# mounts or namespaces), not SYS_PTRACE, NET_*, SYS_MODULE, MKNOD, SYS_CHROOT...
AGENT_CAPS = {0, 1, 2, 3, 4, 5, 6, 7}

CHILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FAILED = 70


@dataclass(frozen=True)
class ChildSpec:
    """Everything the child needs, resolved by the zygote before the fork."""

    sandbox_id: str
    layers: frozenset[str]
    uid: int | None
    plan: mounts.RootPlan | None
    fs: mounts.SandboxFs | None
    new_root: str
    host_workspace: str | None
    host_socket: str
    agent: dict[str, Any]
    log_path: str | None = None
    network_ready: bool = False
    """The zygote forked the child inside a network namespace of its own, loopback up."""
    template_fd: int | None = None
    """The agent's end of its channel to the zygote's runner template (runner_templates.py)."""
    ready_fd: int | None = None
    """The provider's pipe, passed through: the agent says `ok` on it once it serves (agent/server.py)."""
    root_template: int | None = None
    """The zygote's template mount namespace (isolation/mounts.py: prepare_template): the sandbox's
    root is a copy of it plus its own mounts. None: the root is built from scratch (`build_root`)."""


def _reset_signals() -> None:
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _redirect_stdio(log_path: str | None) -> None:
    """stdin from /dev/null; stdout and stderr to the sandbox's own log (0600, host side),
    opened before the root changes, so 64 agents do not write into the controller's stderr."""
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


def prepare(spec: ChildSpec, cgroup: SandboxCgroup | None, secret_fd: int) -> dict[str, Any]:
    """Steps 1-7 but serving; returns the agent's settings keyword arguments."""
    os.setsid()
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    _reset_signals()
    _redirect_stdio(spec.log_path)
    if cgroup is not None:
        cgroup.join()
    secret = zygote_protocol.read_secret_fd(secret_fd)

    held = None
    if spec.root_template is not None and spec.plan is not None and spec.fs is not None \
            and {"filesystem", "namespaces"} <= spec.layers:
        held = mounts.hold_host_paths(spec.fs)  # in the host's namespace, where the provider mounted them
        mounts.enter_template(spec.root_template)  # the unshare below leaves it for a copy of our own
    if spec.root_template is not None:
        os.close(spec.root_template)

    flags = 0
    if "namespaces" in spec.layers:
        flags |= linux.CLONE_NEWNS | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS | linux.CLONE_NEWCGROUP
    if "network" in spec.layers and not spec.network_ready:
        flags |= linux.CLONE_NEWNET
    if flags:
        linux.unshare(flags)
    code_cgroup_fd = None
    if cgroup is not None and cgroup.code_dir is not None:
        cgroup.settle()
        code_cgroup_fd = cgroup.open_code_dir(
            private_mount_at=spec.new_root if "namespaces" in spec.layers else None)
    if "namespaces" in spec.layers:
        linux.sethostname("sandbox")
    if "network" in spec.layers and not spec.network_ready:
        linux.loopback_up()

    if "filesystem" in spec.layers and spec.plan is not None and spec.fs is not None:
        if held is not None:
            mounts.finish_root(spec.plan, spec.fs, spec.new_root, held)
        else:
            mounts.build_root(spec.plan, spec.fs, spec.new_root)
        workspace, uds = mounts.WORKSPACE, f"{mounts.AGENT_DIR}/{os.path.basename(spec.host_socket)}"
    else:
        if spec.host_workspace is None:
            raise RuntimeError("no workspace: the filesystem layer is off and none was given")
        workspace, uds = spec.host_workspace, spec.host_socket
        os.chdir(workspace)
        if spec.log_path:
            # No root of its own, so no /tmp of its own: the agent's temporary directories go in the
            # sandbox's directory, which the provider removes however the agent ends, not in the host's
            # /tmp (the zygote's cached `gettempdir()`), where a sandbox killed -9 left them.
            tmp = os.path.join(os.path.dirname(spec.log_path), "tmp")
            try:
                os.makedirs(tmp, exist_ok=True)
                os.chmod(tmp, 0o711)  # the sandbox uid only passes through (not left to the umask)
                tempfile.tempdir = tmp
            except OSError:
                pass  # best effort, as the directories it holds are: the agent does without them

    if "unprivileged_uid" in spec.layers and os.geteuid() == 0:
        linux.restrict_capabilities(AGENT_CAPS, linux.last_cap())
    if "seccomp" in spec.layers and not seccomp.install_filter():
        raise RuntimeError("seccomp filter could not be installed")

    os.environ.clear()
    os.environ.update({"PATH": CHILD_PATH, "LANG": "C.UTF-8", "HOME": workspace})
    settings = dict(spec.agent)
    settings.setdefault("python_executable", sys.executable)
    settings.update(agent_secret=secret, secret_file=None, uds=uds, workspace=workspace)
    if spec.uid is not None:
        settings.update(sandbox_uid=spec.uid, sandbox_gid=spec.uid)
    if spec.template_fd is not None:
        settings.update(runner_template_fd=spec.template_fd)
    if spec.ready_fd is not None:
        settings.update(ready_fd=spec.ready_fd)
    if code_cgroup_fd is not None and cgroup is not None:
        settings.update(code_cgroup_fd=code_cgroup_fd, code_cgroup_version=cgroup.version,
                        process_cap=cgroup.code_pids_max)
    return settings


def run(spec: ChildSpec, cgroup: SandboxCgroup | None, secret_fd: int, status_fd: int) -> NoReturn:
    """Become the sandbox's agent; never returns."""
    try:
        kwargs = prepare(spec, cgroup, secret_fd)
        from sandpool.agent.server import serve
        from sandpool.agent.settings import AgentSettings

        settings = AgentSettings.from_values(**kwargs)
        del kwargs
        configure_logging("agent", settings.log_level)
    except BaseException as exc:  # noqa: BLE001 - reported to the zygote, then exit
        try:
            os.write(status_fd, f"error: {type(exc).__name__}: {exc}"[:1000].encode(errors="replace"))
        finally:
            os._exit(FAILED)
    os.write(status_fd, b"ok")
    os.close(status_fd)
    code = 0
    try:
        serve(settings)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the agent crashed; its own logs say why
        code = 1
    sys.stderr.flush()
    os._exit(code)
