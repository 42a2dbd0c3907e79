"""Reconciliation's decision, as a pure function: what Redis says each sandbox is, against what the
provider runs, to the actions that make them agree.

Kept apart from the controller so that every case (each record state against a sandbox running
healthy, running with its agent gone, or not running at all; stale `starting` records; another
replica's; orphans) is one row of a table test with no Redis and no provider
(`tests/controller/test_reconcile_plan.py`). The controller gathers the inputs, calls `plan`, and
executes the actions in order; an action whose sandbox failed an earlier one is skipped.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass

from sandpool.controller.provider import SandboxInfo
from sandpool.state.sandboxes import SandboxRecord, Settled

CLOCK_ROUNDING = 0.001
"""A record's `created_at` is written to the millisecond."""


@dataclass(frozen=True)
class Situation:
    """What the plan needs besides the records and the provider's list."""

    now: float  # wall clock, the records' timestamps' clock
    replica_id: str  # this leader: its own `starting` records get the whole start timeout
    start_timeout: float  # a `starting` record older than this will never be published
    term: float  # the leadership term (seconds): a former leader stops its creates within it
    led_for: float  # how long this replica has led
    busy: frozenset[str] = frozenset()  # this leader's own starts and destroys in flight: never judged
    busy_since: float | None = None
    """Wall time `busy` was read. A `starting` record of this replica made before it and not in `busy`
    belongs to a start that has ended without publishing it (its publish failed on a Redis outage,
    say): abandoned at once, rather than after the whole start timeout."""


# --- actions, executed in order ---------------------------------------------------------------

@dataclass(frozen=True)
class Destroy:
    """Destroy it through the provider, then forget its record (kept if the provider failed)."""

    sandbox_id: str
    pool: str
    kind: str


@dataclass(frozen=True)
class ReleaseDead:
    """End the session on it as `dead` (metered once, its sandbox doomed), if the session still names it."""

    session_id: str
    sandbox_id: str


@dataclass(frozen=True)
class Forget:
    """Drop every trace of a sandbox the provider does not run (`kind` None: nothing to count)."""

    sandbox_id: str
    pool: str
    kind: str | None


@dataclass(frozen=True)
class MarkLost:
    """The LOST script: out of the ready list now (atomically with leases), a waiter it was promised to
    queued again, doomed; the controller's drain then destroys and forgets it."""

    sandbox_id: str
    pool: str
    kind: str


@dataclass(frozen=True)
class DoomAgain:
    """A doomed sandbox still running whose destroy was dropped: put it back on the doomed set."""

    sandbox_id: str


@dataclass(frozen=True)
class DestroySessionless:
    """Leased to a session that no longer names it: destroy it, if it is still so when re-read (a
    release since the records were read is not a reason to destroy twice)."""

    sandbox_id: str
    pool: str
    session_id: str


Action = Destroy | ReleaseDead | Forget | MarkLost | DoomAgain | DestroySessionless


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    recheck_in: float | None = None
    """Seconds until another replica's `starting` records can be judged (None: nothing to look at again)."""


# --- the decision -----------------------------------------------------------------------------

def plan(records: Mapping[str, SandboxRecord], running: Mapping[str, SandboxInfo],
         sessions: Mapping[str, str], situation: Situation, settled: Iterable[Settled] = ()) -> Plan:
    """The actions that make Redis and the provider agree.

    `records`: members of the pools, by sandbox id, with its pool (`state` '' when the member's
    record is gone). `running`: what the provider runs, by sandbox id (`ready`: its agent is alive).
    `sessions`: session id -> the sandbox that session names ('' or absent: the session is gone).
    `settled`: the other members, read as ids (`Settled`); a member given this way is judged exactly as
    its record would be.
    The same as `orphans` and then `judge` of every record, merged: a caller may judge the records in
    slices (the controller does, pausing between them) and get the same plan.
    """
    first, values, named = prepare(records, running, sessions, situation, settled)
    return merge([first, judge(values, running, named, situation)])


def prepare(records: Mapping[str, SandboxRecord], running: Mapping[str, SandboxInfo], sessions: Mapping[str, str],
            situation: Situation, settled: Iterable[Settled] = ()) -> tuple[Plan, list[SandboxRecord],
                                                                            dict[str, str]]:
    """`plan` up to the judging: the orphans' plan, and the records `judge` must see (every one of
    `records`, and the settled members the provider does not run with a live agent: the other settled
    ones need nothing) with the sessions they name. A caller judges those whole or in slices."""
    settled = list(settled)
    steady, steady_sessions = unsettled(settled, running)
    # A member given both ways is judged once, by its record (`survey` gives a member read twice by
    # its later read only).
    values = list({**steady, **records}.values())
    return orphans(members(records, settled), running, situation), values, {**steady_sessions, **sessions}


def members(records: Mapping[str, SandboxRecord], settled: Iterable[Settled]) -> set[str]:
    """Every member's id, however it was read."""
    ids = set(records)
    for group in settled:
        ids.update(group.ready)
        ids.update(group.held)
    return ids


def unsettled(settled: Iterable[Settled], running: Mapping[str, SandboxInfo]) -> tuple[dict[str, SandboxRecord],
                                                                                       dict[str, str]]:
    """The settled members the provider does not run with a live agent, as records (and the sessions they
    hold). Rare: records are built only for those."""
    records: dict[str, SandboxRecord] = {}
    sessions: dict[str, str] = {}
    for group in settled:
        for sandbox_id in group.ready:
            info = running.get(sandbox_id)
            if info is None or not info.ready:
                records[sandbox_id] = SandboxRecord(sandbox_id, "ready", group.pool)
        for sandbox_id, session in zip(group.held, group.sessions, strict=True):
            info = running.get(sandbox_id)
            if info is None or not info.ready:
                records[sandbox_id] = SandboxRecord(sandbox_id, "leased", group.pool, session)
                sessions[session] = sandbox_id
    return records, sessions


def orphans(members: Container[str], running: Mapping[str, SandboxInfo], situation: Situation) -> Plan:
    """What the provider runs and no pool owns (`members`: every member's id, or the records by id): destroyed."""
    return Plan(tuple(Destroy(sandbox_id, info.pool, "orphan_sandbox") for sandbox_id, info in running.items()
                      if sandbox_id not in members and sandbox_id not in situation.busy))


def judge(records: Iterable[SandboxRecord], running: Mapping[str, SandboxInfo], sessions: Mapping[str, str],
          situation: Situation) -> Plan:
    """The actions for these members of the pools (any slice of `plan`'s records)."""
    actions: list[Action] = []
    recheck: float | None = None
    for record in records:
        if record.sandbox_id in situation.busy:
            continue
        if record.state == "starting":
            wait = _starting_wait(record, situation)
            if wait is not None:
                recheck = wait if recheck is None else min(recheck, wait)
                continue
        actions.extend(_judge(record, running.get(record.sandbox_id), sessions))
    return Plan(tuple(actions), recheck)


def merge(plans: Iterable[Plan]) -> Plan:
    """One plan: the actions in order, the soonest recheck."""
    plans = list(plans)
    rechecks = [p.recheck_in for p in plans if p.recheck_in is not None]
    return Plan(tuple(action for p in plans for action in p.actions), min(rechecks) if rechecks else None)


def _starting_wait(record: SandboxRecord, situation: Situation) -> float | None:
    """None when a `starting` record is abandoned (past the start timeout, or made by another replica
    while it led, once this one has led a whole term: a leader stops its creates within a term of
    losing leadership); else how long until it may be."""
    age = situation.now - record.created_at
    if age > situation.start_timeout:
        return None
    if record.owner == situation.replica_id and situation.busy_since is not None \
            and record.created_at < situation.busy_since - CLOCK_ROUNDING:
        return None  # our own start, over (it is not in `busy`): nobody will publish it
    if record.owner in ("", situation.replica_id):
        return situation.start_timeout - age  # our own create, or one of unknown owner, may still publish
    if situation.led_for >= situation.term:
        return None
    return situation.term - situation.led_for


def _judge(record: SandboxRecord, info: SandboxInfo | None, sessions: Mapping[str, str]) -> list[Action]:
    """One member (a `starting` one only once abandoned) against what the provider says of it."""
    sandbox_id, pool, state = record.sandbox_id, record.pool, record.state
    holds = bool(record.session) and sessions.get(record.session) == sandbox_id
    release: list[Action] = [ReleaseDead(record.session, sandbox_id)] if holds else []
    if info is None:  # Redis knows it, the provider does not run it
        if state == "promised":  # its waiter goes back to the queue at once, not at its claim
            return [MarkLost(sandbox_id, pool, "stale_record")]
        kind = {"starting": "stuck_starting", "doomed": None}.get(state, "stale_record")
        return [*release, Forget(sandbox_id, pool, kind)]
    if state == "starting":
        return [Destroy(sandbox_id, pool, "stuck_starting")]
    if state == "doomed":
        return [DoomAgain(sandbox_id)]
    if not state:  # its record expired or vanished: nobody can lease it any more
        return [Destroy(sandbox_id, pool, "orphan_sandbox")]
    if state == "leased" and not holds:
        # A lease writes the session with the record and a release drops it while dooming the sandbox,
        # both in one script: its session was lost some other way (its key's expiry, a restored or
        # edited Redis). Nothing would ever release it: it would hold a slot for good.
        return [DestroySessionless(sandbox_id, pool, record.session)]
    if state in ("ready", "promised", "leased") and not info.ready:  # its agent is gone for good
        return [MarkLost(sandbox_id, pool, "stale_record"), *release]
    return []


__all__ = ["Action", "Destroy", "DestroySessionless", "DoomAgain", "Forget", "MarkLost", "Plan", "ReleaseDead",
           "Situation", "judge", "members", "merge", "orphans", "plan", "prepare", "unsettled"]
