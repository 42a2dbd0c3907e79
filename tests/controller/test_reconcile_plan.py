"""`reconcile.plan` as a table: every record state against a sandbox the provider runs healthy, runs with
its agent gone, or does not run; stale and foreign `starting` records; orphans. No Redis, no provider."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from sandpool.controller.provider import SandboxInfo
from sandpool.controller.reconcile import (
    Destroy,
    DestroySessionless,
    DoomAgain,
    Forget,
    MarkLost,
    Plan,
    ReleaseDead,
    Situation,
    judge,
    merge,
    orphans,
    plan,
    prepare,
)
from sandpool.state.sandboxes import STATES, SandboxRecord, Settled

NOW = 1_000_000.0
ME, OTHER = "me", "other"
SID, POOL, SESSION = "sb-1", "p", "sess-1"
SITUATION = Situation(now=NOW, replica_id=ME, start_timeout=60.0, term=5.0, led_for=10.0)
RUNNING = {"absent": None, "healthy": True, "unhealthy": False}


def record(state: str, *, session: str = "", owner: str = ME, age: float = 1.0) -> SandboxRecord:
    return SandboxRecord(SID, state, POOL, session, owner, NOW - age)


def decide(rec: SandboxRecord, running: str, sessions: dict[str, str] | None = None, **situation: float) -> Plan:
    ready = RUNNING[running]
    provider = {} if ready is None else {SID: SandboxInfo(SID, POOL, ready=ready)}
    return plan({SID: rec}, provider, sessions or {}, dataclasses.replace(SITUATION, **situation))


HOLDS = {SESSION: SID}  # the session still names the sandbox
MOVED = {SESSION: "sb-other"}  # it names another (cannot happen by the scripts; a restored Redis)
LOST, STALE, STUCK, ORPHAN = (MarkLost(SID, POOL, "stale_record"), Forget(SID, POOL, "stale_record"),
                              "stuck_starting", "orphan_sandbox")

# (case, record, provider, sessions, situation overrides, actions, recheck_in)
TABLE = [
    ("ready, not running: forgotten", record("ready"), "absent", {}, {}, [STALE], None),
    ("ready, healthy: kept", record("ready"), "healthy", {}, {}, [], None),
    ("ready, agent gone: out of the ready list at once", record("ready"), "unhealthy", {}, {}, [LOST], None),
    ("promised, not running: its waiter queued again", record("promised"), "absent", {}, {}, [LOST], None),
    ("promised, healthy: left to its waiter", record("promised"), "healthy", {}, {}, [], None),
    ("promised, agent gone: its waiter queued again", record("promised"), "unhealthy", {}, {}, [LOST], None),
    ("leased, not running: session released, then forgotten", record("leased", session=SESSION), "absent", HOLDS,
     {}, [ReleaseDead(SESSION, SID), STALE], None),
    ("leased, healthy: kept", record("leased", session=SESSION), "healthy", HOLDS, {}, [], None),
    ("leased, agent gone: marked lost, session released", record("leased", session=SESSION), "unhealthy", HOLDS,
     {}, [LOST, ReleaseDead(SESSION, SID)], None),
    ("leased to a gone session, not running: forgotten", record("leased", session=SESSION), "absent", {}, {},
     [STALE], None),
    ("leased to a gone session, healthy: destroyed", record("leased", session=SESSION), "healthy", {}, {},
     [DestroySessionless(SID, POOL, SESSION)], None),
    ("leased to a gone session, agent gone: destroyed", record("leased", session=SESSION), "unhealthy", {}, {},
     [DestroySessionless(SID, POOL, SESSION)], None),
    ("leased, its session names another sandbox: destroyed", record("leased", session=SESSION), "healthy", MOVED,
     {}, [DestroySessionless(SID, POOL, SESSION)], None),
    ("leased, its session names another, not running: forgotten, nothing released",
     record("leased", session=SESSION), "absent", MOVED, {}, [STALE], None),
    ("doomed, not running: forgotten, not counted", record("doomed"), "absent", {}, {}, [Forget(SID, POOL, None)],
     None),
    ("doomed, healthy: destroyed again", record("doomed"), "healthy", {}, {}, [DoomAgain(SID)], None),
    ("doomed, agent gone: destroyed again", record("doomed"), "unhealthy", {}, {}, [DoomAgain(SID)], None),
    ("doomed with a session naming it, not running: released, forgotten", record("doomed", session=SESSION),
     "absent", HOLDS, {}, [ReleaseDead(SESSION, SID), Forget(SID, POOL, None)], None),
    ("record gone, not running: forgotten", record(""), "absent", {}, {}, [STALE], None),
    ("record gone, healthy: destroyed", record(""), "healthy", {}, {}, [Destroy(SID, POOL, ORPHAN)], None),
    ("record gone, agent gone: destroyed", record(""), "unhealthy", {}, {}, [Destroy(SID, POOL, ORPHAN)], None),
    ("unknown state, not running: forgotten", record("strange"), "absent", {}, {}, [STALE], None),
    ("unknown state, running: not ours to judge", record("strange"), "healthy", {}, {}, [], None),
    ("unknown state, agent gone: not ours to judge", record("strange"), "unhealthy", {}, {}, [], None),
    # `starting`: mine (or no owner) until the start timeout; another replica's until this one led a term.
    ("starting, mine, fresh, not running", record("starting"), "absent", {}, {}, [], 59.0),
    ("starting, mine, fresh, running", record("starting"), "healthy", {}, {}, [], 59.0),
    ("starting, mine, fresh, agent not up yet", record("starting"), "unhealthy", {}, {}, [], 59.0),
    ("starting, no owner, fresh", record("starting", owner=""), "absent", {}, {}, [], 59.0),
    ("starting, mine, past the start timeout, not running", record("starting", age=61), "absent", {}, {},
     [Forget(SID, POOL, STUCK)], None),
    ("starting, mine, past the start timeout, running", record("starting", age=61), "healthy", {}, {},
     [Destroy(SID, POOL, STUCK)], None),
    ("starting, mine, past the start timeout, agent not up", record("starting", age=61), "unhealthy", {}, {},
     [Destroy(SID, POOL, STUCK)], None),
    ("starting, another's, led a term, not running", record("starting", owner=OTHER), "absent", {}, {},
     [Forget(SID, POOL, STUCK)], None),
    ("starting, another's, led a term, running", record("starting", owner=OTHER), "healthy", {}, {},
     [Destroy(SID, POOL, STUCK)], None),
    ("starting, another's, led a term, agent not up", record("starting", owner=OTHER), "unhealthy", {}, {},
     [Destroy(SID, POOL, STUCK)], None),
    ("starting, another's, led less than a term: looked at again then", record("starting", owner=OTHER), "healthy",
     {}, {"led_for": 2.0}, [], 3.0),
    ("starting, another's, led less than a term, not running", record("starting", owner=OTHER), "absent", {},
     {"led_for": 2.0}, [], 3.0),
    ("starting, another's, past the start timeout, led less than a term", record("starting", owner=OTHER, age=61),
     "absent", {}, {"led_for": 2.0}, [Forget(SID, POOL, STUCK)], None),
    ("starting, mine, made before this pass, not in flight: over, not running", record("starting"), "absent",
     {}, {"busy_since": NOW}, [Forget(SID, POOL, STUCK)], None),
    ("starting, mine, made before this pass, not in flight: over, running", record("starting"), "healthy",
     {}, {"busy_since": NOW}, [Destroy(SID, POOL, STUCK)], None),
    ("starting, mine, made after this pass began: may still publish", record("starting", age=-0.5), "healthy",
     {}, {"busy_since": NOW - 1.0}, [], 60.5),
    ("starting, no owner, made before this pass: the start timeout", record("starting", owner=""), "absent",
     {}, {"busy_since": NOW}, [], 59.0),
    ("starting, not leading (a cleaner with no start timeout)", record("starting", owner=OTHER, age=0.5), "absent",
     {}, {"led_for": float("-inf"), "start_timeout": 0.0}, [Forget(SID, POOL, STUCK)], None),
]


@pytest.mark.parametrize(("rec", "running", "sessions", "situation", "actions", "recheck"),
                         [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_plan(rec, running, sessions, situation, actions, recheck):
    decided = decide(rec, running, sessions, **situation)
    assert list(decided.actions) == actions
    assert decided.recheck_in == (pytest.approx(recheck) if recheck is not None else None)


SETTLED_ROWS = [row for row in TABLE if row[1].state == "ready" or (row[1].state == "leased" and row[3] == HOLDS)]


@pytest.mark.parametrize(("rec", "running", "sessions", "situation", "actions", "recheck"),
                         [row[1:] for row in SETTLED_ROWS], ids=[row[0] for row in SETTLED_ROWS])
def test_a_member_read_as_settled_is_judged_as_its_record_is(rec, running, sessions, situation, actions, recheck):
    """Reconciliation reads ready members and leases their session names as ids alone (`Settled`): given
    that way, each row of the table decides what its record decides."""
    ready = RUNNING[running]
    provider = {} if ready is None else {SID: SandboxInfo(SID, POOL, ready=ready)}
    held = rec.state == "leased"
    settled = Settled(POOL, ready=[] if held else [SID], held=[SID] if held else [],
                      sessions=[SESSION] if held else [])
    decided = plan({}, provider, {}, dataclasses.replace(SITUATION, **situation), settled=[settled])
    assert list(decided.actions) == actions == list(decide(rec, running, sessions, **situation).actions)
    assert decided.recheck_in is None


def test_settled_members_are_not_orphans_nor_judged_while_busy_and_a_member_read_twice_is_judged_once():
    settled = Settled(POOL, ready=["sb-r", "sb-busy", "sb-twice"], held=["sb-h"], sessions=["s-h"])
    running = {"sb-r": SandboxInfo("sb-r", POOL, ready=True), "sb-h": SandboxInfo("sb-h", POOL, ready=True),
               "sb-busy": SandboxInfo("sb-busy", POOL, ready=False)}
    records = {"sb-twice": SandboxRecord("sb-twice", "doomed", POOL)}  # read again after it changed
    decided = plan(records, running, {}, dataclasses.replace(SITUATION, busy=frozenset({"sb-busy"})),
                   settled=[settled])
    assert list(decided.actions) == [Forget("sb-twice", POOL, None)]  # judged by its record, once


def test_the_table_covers_every_state_against_every_provider_answer():
    covered = {(row[1].state, row[2]) for row in TABLE}
    assert set(itertools.product([*STATES, "", "strange"], RUNNING)) <= covered


def test_a_sandbox_the_provider_runs_that_redis_does_not_know_is_destroyed():
    running = {"sb-9": SandboxInfo("sb-9", "q", ready=True), "sb-8": SandboxInfo("sb-8", "", ready=False)}
    decided = plan({}, running, {}, SITUATION)
    assert list(decided.actions) == [Destroy("sb-9", "q", ORPHAN), Destroy("sb-8", "", ORPHAN)]


def test_this_leaders_own_starts_and_destroys_in_flight_are_never_judged():
    records = {SID: record("ready"), "sb-2": SandboxRecord("sb-2", "starting", POOL, "", ME, NOW - 99)}
    running = {"sb-3": SandboxInfo("sb-3", POOL, ready=True)}  # created, not yet in the members read
    decided = plan(records, running, {}, dataclasses.replace(SITUATION, busy=frozenset({SID, "sb-2", "sb-3"})))
    assert decided == Plan((), None)


def test_orphans_go_first_and_the_earliest_recheck_wins():
    records = {
        "sb-a": SandboxRecord("sb-a", "starting", POOL, "", OTHER, NOW - 1),
        "sb-b": SandboxRecord("sb-b", "starting", POOL, "", ME, NOW - 59.5),
        "sb-c": SandboxRecord("sb-c", "ready", POOL),
    }
    running = {"sb-c": SandboxInfo("sb-c", POOL, ready=False), "sb-z": SandboxInfo("sb-z", POOL, ready=True)}
    decided = plan(records, running, {}, dataclasses.replace(SITUATION, led_for=1.0))
    assert list(decided.actions) == [Destroy("sb-z", POOL, ORPHAN), MarkLost("sb-c", POOL, "stale_record")]
    assert decided.recheck_in == pytest.approx(0.5)


def test_judged_in_slices_the_plan_is_the_same():
    """The controller judges the records in slices, pausing between them: the merged plan is the whole one."""
    records, running, sessions = {}, {}, {}
    for n, (_, rec, provider, rows_sessions, overrides, _, _) in enumerate(TABLE):
        if overrides:
            continue  # one situation for all the rows here
        sid = f"sb-{n:03d}"
        records[sid] = dataclasses.replace(rec, sandbox_id=sid, session=rec.session and f"{rec.session}-{n}")
        if RUNNING[provider] is not None:
            running[sid] = SandboxInfo(sid, POOL, ready=RUNNING[provider])
        sessions.update({f"{name}-{n}": (sid if named == SID else named) for name, named in rows_sessions.items()})
    running["sb-orphan"] = SandboxInfo("sb-orphan", POOL, ready=True)
    whole = plan(records, running, sessions, SITUATION)
    assert len(whole.actions) > 10  # the rows say what each gives: enough of them act
    first, values, named = prepare(records, running, sessions, SITUATION)  # as the controller does
    assert first == orphans(records, running, SITUATION) and values == list(records.values())
    for size in (1, 3, 7, len(values)):
        slices = [values[i:i + size] for i in range(0, len(values), size)]
        sliced = merge([first, *(judge(part, running, named, SITUATION) for part in slices)])
        assert sliced == whole, size
