"""The template's handling of one sandbox's channel, run in this process (the template is stdlib
only: its source loads as a module that does not serve)."""

from __future__ import annotations

import os
import select
import socket
from typing import Any

from sandpool.agent.interpreter import template_source


def template() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "runner_template_under_test"}
    exec(compile(template_source(), "runner_template", "exec"), namespace)
    return namespace


def test_an_agent_that_died_with_reports_unread_is_dropped_not_raised() -> None:
    """A Unix socket closed with messages unread resets its peer (ECONNRESET, not EOF): the agent
    is gone all the same, and its channel must go with it rather than fail the template's loop."""
    t = template()
    ours, agents = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.send(b"X2 0")  # an exit report the agent never read
    agents.close()
    channel = ours.detach()
    os.set_blocking(channel, False)
    pidfd_stand_in, procs_stand_in = os.pipe()
    poller = select.poll()
    poller.register(channel, select.POLLIN)
    sandboxes = {channel: t["_Sandbox"](channel, pidfd_stand_in, [procs_stand_in], 0)}
    events = dict(poller.poll(0))[channel]

    t["_on_channel"](channel, events, sandboxes, {}, None, poller)

    assert sandboxes == {}
    assert poller.poll(0) == []  # unregistered
    for fd in (channel, pidfd_stand_in, procs_stand_in):  # closed with the sandbox
        try:
            os.fstat(fd)
        except OSError:
            continue
        raise AssertionError(f"descriptor {fd} left open")
