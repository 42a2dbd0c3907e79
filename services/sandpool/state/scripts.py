"""Every Lua script sandpool runs: each state change is one atomic script, one round trip.

Each script is a file of its own under `state/lua/`, its KEYS and ARGV documented at its
top. One argument convention for all: KEYS are the keys the caller names, in the order
the header lists; ARGV[1] is one JSON object of named arguments (`named`), which the
script decodes as `a`. A script sharing Lua functions with others names them on its first line
(`-- uses: meter waiting`); they are taken from `state/lua/lib/` and put ahead of it
when it is loaded, so each script still reaches Redis as one text. Keys that depend on data read
inside the script (the workspace of a session being released, a sandbox's hash)
are built in Lua from prefixes computed by `state.keys`, so the key schema stays
in one module; every key carries the installation's hash tag, so a script still
touches a single cluster slot.

Times are the caller's clock (the api's or the controller's: POSIX seconds, passed in), never a figure from
inside a sandbox. Usage counters and the usage event are written by the same
script as the state change they meter, so a crash can neither lose nor
double-count them.

Sandbox states: starting -> ready -> leased -> doomed (-> gone). A `ready` sandbox
is in its pool's ready list; a `leased` one in its pool's leased set (which the
ceiling checks count); a `doomed` one in the doomed set the controller drains.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from redis.commands.core import AsyncScript

from sandpool.state.channels import LEASE_NUDGE_PREFIX

LUA = Path(__file__).with_name("lua")
USES = "-- uses:"
CONSTANTS = {"@LEASE_NUDGE_PREFIX@": LEASE_NUDGE_PREFIX}
"""Names a script's text holds for a value Python owns (the channel message prefix the controller parses)."""


def named(**arguments: Any) -> list[str]:
    """A script's ARGV: its arguments as one JSON object in ARGV[1] (every script's convention; the script
    reads them as `local a = cjson.decode(ARGV[1])`, by the names its header lists)."""
    return [json.dumps(arguments, separators=(",", ":"))]


async def scan_steps(script: AsyncScript, *, keys: list[str], arguments: dict[str, Any], count: int,
                     rest: float = 0.0) -> AsyncIterator[list[Any]]:
    """Run a script that reads a set one SSCAN step at a time (it takes `cursor` and `count` among its named
    arguments and answers {next cursor, what it read}) until the set has been looked at; yield each step's
    reading. With `rest`, wait that many times as long as a step took, its handling by the caller
    included, before the next: a background reader leaves Redis and the CPU mostly to the request path."""
    cursor = "0"
    while True:
        began = time.perf_counter()
        cursor, read = await script(keys=keys, args=named(**arguments, cursor=cursor, count=count))
        yield read
        if str(cursor) == "0":
            return
        if rest:
            await asyncio.sleep(rest * (time.perf_counter() - began))


def load(name: str) -> str:
    """The text of `state/lua/<name>.lua` as Redis runs it: the shared functions its first line names, then
    the script itself."""
    own = (LUA / f"{name}.lua").read_text()
    first = own.partition("\n")[0]
    uses = first.removeprefix(USES).split() if first.startswith(USES) else []
    text = "".join((LUA / "lib" / f"{lib}.lua").read_text() for lib in uses) + own
    for marker, value in CONSTANTS.items():
        text = text.replace(marker, value)
    return text


LEASE = load("lease")
ANSWERED = load("answered")
CLAIM = load("claim")
CANCEL_WAIT = load("cancel_wait")
TOUCH = load("touch")
DONE = load("done")
SETTLE_OVERDUE = load("settle_overdue")
RELEASE = load("release")
REAP = load("reap")
POOL_STATS = load("pool_stats")
REGISTER_STARTING = load("register_starting")
PUBLISH_READY = load("publish_ready")
FORGET = load("forget")
RETIRE_SURPLUS = load("retire_surplus")
SWEEP_WAITERS = load("sweep_waiters")
SURVEY = load("survey")
WORKSPACE_SESSIONS = load("workspace_sessions")
LOST = load("lost")
RENEW_LEADERSHIP = load("renew_leadership")
RELEASE_LEADERSHIP = load("release_leadership")
ADMIT = load("admit")
ADMIT_CALL = load("admit_call")
ADMIT_LEASE = load("admit_lease")
EGRESS_BINDING = load("egress_binding")
EGRESS_METER = load("egress_meter")
