"""The zygote's runner templates: one per sandbox Python, started on its first sandbox.

A template (agent/runner_template.py) forks pre-imported runners into sandboxes, so a sandbox
does not pay a whole interpreter start for its runner (~25 ms of CPU). The zygote gives each
sandbox's agent one end of a socket pair and the template the other, with the sandbox's PID
descriptor and its agent cgroup: a channel can only ever make runners in that one sandbox,
whatever the agent sends on it. An agent whose channel is dead or missing starts its runner
with exec, as before, so a template is a speed-up and never a dependency.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sandpool.agent import seccomp
from sandpool.agent.hardening import is_binary
from sandpool.agent.interpreter import template_source

log = logging.getLogger("sandpool.zygote")

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
MAX_DEATHS = 3
"""A template that died this often is not started again (its sandboxes start runners with exec)."""


@dataclass
class _Template:
    process: subprocess.Popen[bytes]
    control: socket.socket


class RunnerTemplates:
    """The running templates by interpreter path, and the channels the zygote hands out."""

    def __init__(self, *, flags: int, keep_caps: set[int]) -> None:
        self._flags = flags
        self._keep_caps = keep_caps
        self._templates: dict[str, _Template] = {}
        self._failed: set[str] = set()
        self._deaths: dict[str, int] = {}
        arch = seccomp.native_arch()
        self._program = seccomp.program_bytes(arch) if arch is not None else b""

    def channel(self, python: str) -> tuple[socket.socket, socket.socket] | None:
        """(the agent's end, the template's end) of a new channel, or None without a template."""
        if self._start(python) is None:
            return None
        try:
            return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as exc:
            log.warning("no channel to the runner template: %s", exc)
            return None

    def attach(self, python: str, theirs: socket.socket, pid: int, procs_files: list[Path]) -> None:
        """Hand the template its end of a channel for the sandbox whose agent is `pid` (just forked
        by the zygote, so not reaped and not reused). Closes `theirs` whatever happens; on any
        failure the agent's sends fail and it starts its runners with exec."""
        template = self._templates.get(python)
        fds: list[int] = []
        try:
            if template is None:
                return
            fds.append(os.pidfd_open(pid))
            fds.extend(os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in procs_files)
            message = b"A%d,%d" % (self._flags, len(fds) - 1)
            socket.send_fds(template.control, [message], [theirs.fileno(), *fds])
        except OSError as exc:
            log.warning("could not hand a sandbox to its runner template: %s", exc)
        finally:
            theirs.close()
            for fd in fds:
                os.close(fd)

    def reaped(self, pid: int, status: int) -> bool:
        """Whether `pid`, reaped by the zygote, was a template (then started again on next use)."""
        for python, template in list(self._templates.items()):
            if template.process.pid == pid:
                template.process.returncode = os.waitstatus_to_exitcode(status)
                self._forget(python, template)
                return True
        return False

    def fds(self) -> list[int]:
        """Descriptors a forked sandbox must close."""
        return [t.control.fileno() for t in self._templates.values()]

    def close(self) -> None:
        for template in self._templates.values():
            template.control.close()  # end of stream: the template exits
        self._templates.clear()

    def _start(self, python: str) -> _Template | None:
        template = self._templates.get(python)
        if template is not None and template.process.poll() is not None:  # exited; reaped just now
            self._forget(python, template)
            template = None
        if template is not None or python in self._failed:
            return template
        if not is_binary(python):
            self._failed.add(python)
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        source = template_source()
        # Its configuration in its first message, not in argv, which every runner's /proc shows.
        argv = [python, "-I", "-S", "-u", "-c", source, "--template", str(theirs.fileno())]
        config = {"parent": os.getpid(), "keep_caps": sorted(self._keep_caps), "seccomp": self._program.hex()}
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), env=ENV,
                                       cwd="/")
        except OSError as exc:
            log.warning("cannot start a runner template for %s: %s", python, exc)
            self._failed.add(python)
            ours.close()
            return None
        finally:
            theirs.close()
        ours.send(b"C" + json.dumps(config).encode())
        ours.setblocking(False)
        template = self._templates[python] = _Template(process, ours)
        return template

    def _forget(self, python: str, template: _Template) -> None:
        template.control.close()
        self._templates.pop(python, None)
        self._deaths[python] = self._deaths.get(python, 0) + 1
        if self._deaths[python] >= MAX_DEATHS:
            self._failed.add(python)
        log.warning("the runner template for %s exited (%s)%s", python, template.process.returncode,
                    "; runners start with exec from now on" if python in self._failed else "")

    def cpu_seconds(self) -> float:
        """The live templates' own CPU (the runners' own is their sandboxes')."""
        total = 0.0
        for template in self._templates.values():
            try:
                with open(f"/proc/{template.process.pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total
