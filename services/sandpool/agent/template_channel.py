"""The agent's end of its channel to the zygote's runner template (agent/runner_template.py).

The zygote hands it over at the fork; the template at the other end can make runners only in
this sandbox. The agent asks for one with the five descriptors its runner gets, and learns here
the exit status of each runner the template forked (the template, not the agent, is their
parent). Once a runner fails to come from it the agent starts runners with exec for the rest of
its life, and still reads the exit statuses of the runners the template had made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from sandpool.agent import procs

log = logging.getLogger("sandpool.agent.template")

_SPAWN, _EXITED = b"S", b"X"


class TemplateChannel:
    def __init__(self, fd: int, child_reaper: procs.ChildReaper) -> None:
        self._sock = socket.socket(fileno=fd)
        self._sock.setblocking(False)
        self._child_reaper = child_reaper
        self._watching = False
        self.usable = True
        """Runners may be asked of it (False after a failure, or once its end is gone)."""

    def request(self, fds: list[int]) -> None:
        """Ask for a runner on stdin, stdout, stderr, the request pipe and the event pipe.
        Raises OSError when the template is gone or does not take it at once."""
        if not self.usable:
            raise OSError("the runner template channel is closed")
        if not self._watching:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._on_message)
            self._watching = True
        socket.send_fds(self._sock, [_SPAWN], fds)

    def _on_message(self) -> None:
        try:
            data = self._sock.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close()
            return
        if data[:1] == _EXITED:
            try:
                pid, status = (int(part) for part in data[1:].split())
            except ValueError:
                return
            self._child_reaper.record(pid, status)

    def stop_requests(self) -> None:
        """Ask it for no more runners; exit statuses of the ones it made still come in."""
        self.usable = False

    def _close(self) -> None:
        self.usable = False
        if self._watching:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._watching = False
        self._sock.close()
