"""The pool controller: keeps every pool warm, destroys what was released, repairs drift.

One controller is active per installation: the replica holding leadership (a Redis
key with an expiry, `state.leader.Leadership`); the others wait and take over within
one leadership term when it dies. (Leadership has a term, never a "lease": a lease is
a session's hold on a sandbox.) The leader follows the sandbox lifecycle of `docs/architecture.md`:

- register `starting` (ceiling checked atomically) -> `provider.create` (returns once
  the agent answers its health check) -> publish `ready` (one script);
- drain `doomed` -> `provider.destroy` -> forget the record;
- reconcile on takeover and periodically: `reconcile.plan` decides, from the records and
  what the provider runs, what to destroy, forget, release or mark lost; this executes it.

The leader sleeps until something happens, so an idle installation costs almost nothing:
a message on the nudge channel (a lease, claim, release, lost sandbox or new waiter), one
of its own starts or destroys ending, or the next deadline it keeps (a pool's backoff, a
failed step's retry, demand to follow while a pool is above its floor or has waiters, a
reconciliation due). A long safety-net wake bounds what a lost message can cost.

Nothing here is authoritative in memory: the in-flight set only stops this leader
from counting its own creates twice. Provider failures back off per pool and are
bounded; a failed step is retried after a backoff or left to reconciliation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sandpool.controller.demand import WarmTarget
from sandpool.controller.metrics import ControllerMetrics
from sandpool.controller.provider import PoolSpec, Provider, ProviderError, SandboxInfo, new_sandbox_id
from sandpool.controller.reconcile import (
    Action,
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
    prepare,
)
from sandpool.state import channels
from sandpool.state.client import Client
from sandpool.state.errors import StateError
from sandpool.state.keys import Keys
from sandpool.state.leader import Leadership
from sandpool.state.sandboxes import Look, SandboxStore, Survey
from sandpool.state.sessions import SessionStore

log = logging.getLogger("sandpool.controller.controller")


PLAN_SLICE = 5000
"""Records a reconciliation pass judges per turn of its worker thread (about 10 ms of CPU)."""


@dataclass(frozen=True)
class ControllerTiming:
    """How often and how patiently the controller acts. Defaults suit production and tests."""

    leadership_ms: int = 5000  # the leadership term: a dead leader is replaced within about this long
    safety_wake_seconds: float = 5.0  # the longest the leader sleeps with no message and no deadline due:
    # all a lost nudge (a lease, claim, release, lost sandbox or new waiter) can cost. Its idle cost.
    nudge_settle_seconds: float = 0.03  # a lease's nudge wakes the loop this much later (any other at
    # once): a new session's first call is not made to share the CPU with the refill its lease set off
    reconcile_seconds: float = 30.0
    reconcile_rest: float = 2.0  # a pass waits this many times as long as each read took before the next:
    # the safety net runs at a third of the speed it could, and leaves Redis and the CPU to the request path
    start_timeout_seconds: float = 60.0  # a create slower than this is abandoned and destroyed
    destroy_timeout_seconds: float = 30.0
    max_concurrent_starts: int = 8
    demand_seconds: float = 1.0  # the warm targets follow the lease rate (and stale waiters go) this long
    # after a lease or a wait, and this often while a target is above its floor or a pool has waiters
    demand_window_buckets: int = 6  # the lease rate is taken over this many 10-second buckets (a minute)
    demand_headroom: float = 2.0  # the warm target is lease rate x start time x this (within floor and cap)
    demand_shrink_seconds: float = 10.0  # a target above demand comes down one sandbox per this long
    max_concurrent_destroys: int = 8
    retry_base_seconds: float = 0.5  # per-pool backoff after a failed create: base * 2^n ...
    retry_max_seconds: float = 15.0  # ... capped here
    destroy_attempts: int = 5  # then the sandbox is left to reconciliation
    record_ttl_seconds: int = 7 * 86400  # safety-net expiry of sandbox hashes


async def _cancel_all(tasks: list[asyncio.Task[Any]], *, patience: float = 30.0) -> None:
    """Cancel tasks and wait until they are done, cancelling again if one swallowed it.

    `asyncio.wait_for` on Python 3.11 (and some client libraries) can lose a cancellation
    that races with a completion; a controller that kept creating sandboxes after being
    told to stop would outlive its own shutdown. Bounded: after `patience` seconds the
    stragglers are left (and logged) rather than hanging the caller.
    """
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.debug("task ended with an error while cancelled", exc_info=task.exception())
    if pending:
        log.error("pool controller tasks did not stop", extra={"tasks": [t.get_name() for t in pending]})


class PoolController:
    def __init__(self, redis: Client, keys: Keys, provider: Provider, pools: Iterable[PoolSpec], *,
                 replica_id: str, timing: ControllerTiming | None = None,
                 metrics: ControllerMetrics | None = None, **timing_overrides: Any) -> None:
        if "tick_seconds" in timing_overrides:  # the safety net's former name, as tools and older tests pass it
            timing_overrides["safety_wake_seconds"] = timing_overrides.pop("tick_seconds")
        self.redis = redis
        self.keys = keys
        self.provider = provider
        self.pools = {p.name: p for p in pools}
        self.replica_id = replica_id
        self.timing = dataclasses.replace(timing or ControllerTiming(), **timing_overrides)
        self.metrics = metrics or ControllerMetrics.create()
        self.sandboxes = SandboxStore(redis, keys, record_ttl_seconds=self.timing.record_ttl_seconds)
        self.sessions = SessionStore(redis, keys)
        self.leadership = Leadership(redis, keys.controller_leader, replica_id, leadership_ms=self.timing.leadership_ms)
        self._running = False
        self._leader = False
        self._leading_since = math.inf  # monotonic time this replica's leadership began
        self._recheck_at = math.inf  # an early reconciliation, for a former leader's starts
        self._retry_at = math.inf  # a failed step's retry
        self._step_failed = False  # in this pass
        self._step_failures = 0  # consecutive passes with a failed step: their retry backs off
        self._wake = asyncio.Event()
        self._starting: dict[str, str] = {}  # sandbox id -> pool, this leader's creates in flight
        self._start_tasks: set[asyncio.Task[None]] = set()
        self._destroying: set[str] = set()
        self._destroy_tasks: set[asyncio.Task[None]] = set()
        self._destroy_failures: dict[str, int] = {}
        self._create_failures: dict[str, int] = {}
        self._backoff_until: dict[str, float] = {}
        self._last_reconcile = 0.0
        self._reconciling: asyncio.Task[bool] | None = None  # a periodic pass, beside the loop
        self._passing: set[str] | None = None  # while a pass runs: sandboxes the loop started or popped since
        self._last_demand = -math.inf
        self._sweep_cursor: dict[str, str] = {}  # pool -> where its sweep of promised sandboxes goes on
        self._waiters: dict[str, int] = {}  # pool -> its waiters when last read: demand is followed while any
        self._demand_moved = False  # a nudge came since demand was last followed (a lease or wait counts in it)
        self.targets = {p.name: WarmTarget(floor=p.warm, cap=p.warm_cap, headroom=self.timing.demand_headroom,
                                           shrink_every=self.timing.demand_shrink_seconds)
                        for p in self.pools.values()}
        self._lost_tasks: set[asyncio.Task[None]] = set()
        self.ticks = 0  # leader loop passes, for status and tests that wait for "a few more"
        register = getattr(provider, "on_lost", None)
        if register is not None:
            register(self._on_lost)

    # --- what /readyz asks ---------------------------------------------------------------
    @property
    def running(self) -> bool:
        """The controller loop is alive (leader or standing by)."""
        return self._running

    @property
    def is_leader(self) -> bool:
        return self._leader and self.leadership.still_valid()

    def nudge(self) -> None:
        """Re-evaluate now (a sandbox was released, a create finished)."""
        self._wake.set()

    # --- election ------------------------------------------------------------------------
    async def run(self) -> None:
        """Stand by or lead until cancelled. Never returns on its own."""
        self._running = True
        follow = max(0.1, self.timing.leadership_ms / 1000 / 5)
        try:
            while True:
                try:
                    acquired = await self.leadership.try_acquire()
                except StateError as exc:
                    log.warning("controller cannot reach redis", extra={"error": str(exc)})
                    acquired = False
                if acquired:
                    try:
                        await self._lead()
                    except asyncio.CancelledError:
                        task = asyncio.current_task()
                        if task is not None and task.cancelling():
                            raise  # our own shutdown
                        # A step ended by a cancellation nobody asked for: without this the task
                        # would end here, silently, and no replica would ever lead (or reconcile) again.
                        log.error("pool controller leadership ended by a stray cancellation; standing by")
                    except Exception:
                        log.exception("pool controller leadership failed; standing by")
                await asyncio.sleep(follow)
        finally:
            self._running = False

    async def _lead(self) -> None:
        log.info("pool controller is leader", extra={"replica": self.replica_id})
        self._leader = True
        work = asyncio.create_task(self._leader_work(), name="pool-controller-leader")
        listener = asyncio.create_task(self._listen_for_nudges(), name="pool-controller-nudges")
        try:
            await self._hold_leadership(work)
        finally:
            self._leader = False  # also ends the listener's loop, should it swallow its cancellation
            await _cancel_all([work, listener, *([self._reconciling] if self._reconciling else [])])
            self._reconciling, self._passing = None, None
            await self._abandon()
            with contextlib.suppress(StateError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await self.leadership.release()
            log.info("pool controller stepped down", extra={"replica": self.replica_id})

    async def _hold_leadership(self, work: asyncio.Task[None]) -> None:
        """Renew leadership until it is lost (or cannot be renewed in time) or the work dies."""
        interval = self.timing.leadership_ms / 1000 / 3
        while not work.done():
            done, _ = await asyncio.wait({work}, timeout=interval)
            if done:
                if work.cancelled():
                    log.error("pool controller leader loop was cancelled")
                    return
                exc = work.exception()
                if exc is not None:
                    log.error("pool controller leader loop failed", exc_info=exc)
                return
            try:
                async with asyncio.timeout(interval):
                    renewed = await self.leadership.renew()
                if not renewed:
                    log.warning("pool controller lost its leadership", extra={"replica": self.replica_id})
                    return
            except (StateError, TimeoutError) as exc:
                if not self.leadership.still_valid():
                    log.warning("pool controller could not renew its leadership in time",
                                extra={"error": str(exc)})
                    return

    async def _abandon(self) -> None:
        """On stepping down: stop our creates and destroy their half-made sandboxes.

        A create cancelled mid-way leaves a `starting` record; destroying it here is the
        fast path, reconciliation by the next leader the safety net.
        """
        await _cancel_all(list(self._start_tasks) + list(self._destroy_tasks))
        # A destroy cancelled before it ran never reached its `finally`: its id would stay here and
        # every later reconciliation of ours would skip that sandbox for good.
        self._destroying.clear()
        leftovers = list(self._starting.items())
        self._starting.clear()
        if leftovers:
            await asyncio.gather(*(self._destroy_and_forget(sid, pool) for sid, pool in leftovers),
                                 return_exceptions=True)

    # --- the leader's loop ---------------------------------------------------------------
    async def _leader_work(self) -> None:
        self._leading_since = time.monotonic()
        self._step_failures = 0
        self._step_failed = False
        await self._step("reconcile", self.reconcile())
        while self._leader:
            self._wake.clear()
            self.ticks += 1
            # Our starts are counted before Redis is read: one that publishes meanwhile is then counted
            # twice (one pass of under-filling), never missed (one sandbox over the target).
            starting = collections.Counter(self._starting.values())
            look = await self._look()
            if look is not None:
                await self._step("drain", self.drain_doomed(look))
            now = time.monotonic()
            if now - self._last_demand >= self.timing.demand_seconds:
                self._last_demand, self._demand_moved = now, False
                await self._step("demand", self.follow_demand())
            if look is not None:
                await self._step("top-up", self.top_up(look, starting))
            now = time.monotonic()
            if self._reconciling is None and (
                    now - self._last_reconcile >= self.timing.reconcile_seconds or now >= self._recheck_at):
                self._recheck_at = math.inf
                self._reconcile_beside()
            self._book_retry(now)
            await self._sleep_until(self._next_wake(time.monotonic()))

    def _reconcile_beside(self) -> None:
        """A periodic pass runs beside the loop, not in it: at 100,000 sandboxes it reads for seconds,
        and pools must go on being topped up and drained meanwhile (what the loop starts or pops while
        the pass runs is left out of its decisions: `_passing`)."""
        def done(task: asyncio.Task[bool]) -> None:
            if self._reconciling is task:
                self._reconciling = None
            if self._leader and (task.cancelled() or task.exception() is not None or not task.result()):
                # Failed, or ended by a cancellation nobody asked for (we cancel it only when stepping
                # down): another pass soon, not at the next period, for what it was booked to look at.
                if task.cancelled():
                    log.error("a reconciliation pass was cancelled while leading; it runs again")
                self._recheck_at = min(self._recheck_at, time.monotonic() + self.timing.retry_base_seconds)
            self._wake.set()  # its deadlines were set aside while it ran

        self._reconciling = asyncio.create_task(self._step("reconcile", self.reconcile()),
                                                name="pool-controller-reconcile")
        self._reconciling.add_done_callback(done)

    def _book_retry(self, now: float) -> None:
        """A pass with a failed step goes again after a backoff (doubling, at most the safety net)."""
        if not self._step_failed:
            self._step_failures, self._retry_at = 0, math.inf
            return
        self._step_failed = False
        self._step_failures += 1
        self._retry_at = now + min(self.timing.retry_base_seconds * 2 ** (self._step_failures - 1),
                                   self.timing.safety_wake_seconds)

    def _next_wake(self, now: float) -> float:
        """When the leader must look again though nothing wakes it: the earliest deadline it keeps."""
        t = self.timing
        deadlines = [now + t.safety_wake_seconds, self._retry_at,
                     *(until for until in self._backoff_until.values() if until > now)]
        if self._reconciling is None:  # one pass at a time: a running one wakes the loop when it ends
            deadlines += [self._last_reconcile + t.reconcile_seconds, self._recheck_at]
        # Demand is followed within `demand_seconds` of a lease or a wait (both nudge), and while a target
        # is above its floor (it comes down one sandbox per shrink period) or someone waits (stale waiters
        # are swept); at the floor with nobody waiting, only a lease can move it, and a lease wakes us.
        if self._demand_moved or any(w.target > w.floor for w in self.targets.values()) or any(
                self._waiters.values()):
            deadlines.append(self._last_demand + t.demand_seconds)
        return min(deadlines)

    async def _sleep_until(self, deadline: float) -> None:
        """Until `deadline` (monotonic), or sooner if woken (a nudge, a start or destroy ending)."""
        delay = deadline - time.monotonic()
        if delay <= 0:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._wake.wait()

    async def _step(self, what: str, coro: Any) -> bool:
        """One step of the loop; a failure is logged and the pass retried after a backoff (False)."""
        try:
            await coro
            return True
        except (StateError, OSError, TimeoutError) as exc:
            log.warning("pool controller step failed", extra={"step": what, "error": str(exc)})
        except ProviderError as exc:
            log.warning("pool controller step failed", extra={"step": what, "error": str(exc)})
        except Exception:  # a bug must not stop pools from being kept warm
            log.exception("pool controller step crashed", extra={"step": what})
        self._step_failed = True
        return False

    async def _listen_for_nudges(self) -> None:
        """Wake the loop on everything published on the nudge channel, while leading: every lease,
        claim and release (the session layer's scripts), a lost sandbox, a caller queued as a waiter."""
        loop = asyncio.get_running_loop()
        settle = self.timing.nudge_settle_seconds

        def on_nudge(message: str) -> None:
            self._demand_moved = True
            if settle > 0 and message.startswith(channels.LEASE_NUDGE_PREFIX):
                loop.call_later(settle, self._wake.set)
            else:  # a release frees a slot, a queued caller waits for a start: at once
                self._wake.set()

        # The poll only bounds how long a swallowed cancellation goes unnoticed: no need to wake often.
        await channels.listen(self.redis, self.keys.pool_events, on_nudge, while_=lambda: self._leader,
                              poll_seconds=self.timing.safety_wake_seconds)

    async def _look(self) -> Look | None:
        """What the pass reads first (every pool's fill, the doomed sandboxes it may start destroying),
        or None when Redis could not say (the step is retried after a backoff)."""
        looked: list[Look] = []

        async def read() -> None:
            room = self.timing.max_concurrent_destroys - len(self._destroying)
            looked.append(await self.sandboxes.look(self.pools, room))

        await self._step("look", read())
        return looked[0] if looked else None

    # --- keeping pools warm --------------------------------------------------------------
    async def top_up(self, look: Look, starting: collections.Counter[str]) -> None:
        """Start what each pool lacks, from the pass's `look` and the starts counted before it."""
        for pool in self.pools.values():
            if time.monotonic() < self._backoff_until.get(pool.name, 0.0):
                continue
            fill = look.fills[pool.name]
            self._waiters[pool.name] = fill.waiters
            target = self.targets[pool.name].target
            if starting[pool.name] == 0 and fill.queued == 0 and fill.ready > target:
                # Demand may have moved since the last look (a waiter gave up and left its sandbox
                # ready): follow it before throwing warm sandboxes away.
                target = await self._follow(pool, time.time())
                # Read again: leases since the pass's look would make the surplus too large (the
                # script dooms as many ready sandboxes as it is told). Rare: only above the target.
                ready = (await self.sandboxes.look([pool.name], 0)).fills[pool.name].ready
                if ready > target:
                    await self._retire_surplus(pool, ready - target)
                continue
            # Every queued waiter wants a sandbox started for it at once, beyond the warm target.
            slots = self.timing.max_concurrent_starts - len(self._starting)
            wanted = min(target + fill.queued - fill.ready - starting[pool.name], pool.ceiling - fill.members, slots)
            for _ in range(max(0, wanted)):
                sandbox_id = new_sandbox_id()
                # Known as starting before its record exists: stepping down while the script runs
                # (its reply not yet read) must still find it, destroy it and forget the record.
                self._starting[sandbox_id] = pool.name
                if self._passing is not None:
                    self._passing.add(sandbox_id)
                try:
                    registered = await self.sandboxes.register_starting(
                        sandbox_id, pool=pool.name, image=pool.image, ceiling=pool.ceiling, now=time.time(),
                        owner=self.replica_id)
                except asyncio.CancelledError:
                    raise
                except BaseException:
                    self._starting.pop(sandbox_id, None)  # no record, or one reconciliation will find
                    raise
                if not registered:
                    self._starting.pop(sandbox_id, None)
                    break
                task = asyncio.create_task(self._start(pool, sandbox_id), name=f"start-{sandbox_id}")
                self._start_tasks.add(task)
                task.add_done_callback(self._start_tasks.discard)

    async def follow_demand(self) -> None:
        """Move each pool's warm target with its lease rate; forget waiters whose api replica vanished."""
        now = time.time()
        for pool in self.pools.values():
            await self._follow(pool, now)
            fixed, self._sweep_cursor[pool.name] = await self.sandboxes.sweep_waiters(
                pool.name, self._sweep_cursor.get(pool.name, "0"))
            if fixed:
                self.metrics.reconciled.labels(kind="stale_waiter").inc(fixed)
                log.info("forgot waiters whose api replica vanished", extra={"pool": pool.name, "count": fixed})

    async def _follow(self, pool: PoolSpec, now: float) -> int:
        """The pool's warm target after reading its lease rate (and the gauges saying why)."""
        target = self.targets[pool.name]
        rate = await self.sandboxes.lease_rate(pool.name, now, buckets=self.timing.demand_window_buckets)
        target.update(rate, time.monotonic())
        self.metrics.pool_target.labels(pool=pool.name).set(target.target)
        self.metrics.pool_lease_rate.labels(pool=pool.name).set(target.lease_rate)
        self.metrics.pool_start_estimate.labels(pool=pool.name).set(target.start_seconds)
        return target.target

    async def _retire_surplus(self, pool: PoolSpec, surplus: int) -> None:
        """Doom warm sandboxes above the target: it was lowered, or a replaced leader's starts
        landed on top of the new leader's. Never while this controller is starting any."""
        retired = await self.sandboxes.retire_surplus(pool.name, surplus)
        if retired:
            self.metrics.reconciled.labels(kind="surplus_ready").inc(retired)
            log.info("retired warm sandboxes above the target", extra={"pool": pool.name, "count": retired})
            self._wake.set()

    async def _start(self, pool: PoolSpec, sandbox_id: str) -> None:
        began = time.monotonic()
        cancelled = False
        try:
            try:
                async with asyncio.timeout(self.timing.start_timeout_seconds):
                    info = await self.provider.create(pool, sandbox_id)
                if not info.address or not info.secret:
                    raise ProviderError("provider returned a sandbox without address or secret")
            except (ProviderError, OSError, TimeoutError) as exc:
                self._count_provider_error("create")
                failures = self._create_failures.get(pool.name, 0) + 1
                self._create_failures[pool.name] = failures
                delay = min(self.timing.retry_base_seconds * 2 ** (failures - 1), self.timing.retry_max_seconds)
                self._backoff_until[pool.name] = time.monotonic() + delay
                error = str(exc) or type(exc).__name__
                log.warning("sandbox create failed", extra={"pool": pool.name, "sandbox": sandbox_id,
                                                            "error": error, "retry_in_seconds": delay})
                with contextlib.suppress(StateError):
                    await self.sandboxes.record_error(pool.name, error)
                await self._destroy_and_forget(sandbox_id, pool.name)
                return
            published = await self.sandboxes.publish_ready(sandbox_id, pool=pool.name, address=info.address,
                                                           secret=info.secret, now=time.time(),
                                                           egress_digest=info.egress_digest)
            if not published:
                log.info("sandbox was forgotten while starting; destroying it",
                         extra={"pool": pool.name, "sandbox": sandbox_id})
                await self._destroy_and_forget(sandbox_id, pool.name)
                return
            self._create_failures.pop(pool.name, None)
            took = time.monotonic() - began
            self.metrics.sandbox_start.labels(pool=pool.name).observe(took)
            self.targets[pool.name].observe_start(took)
        except (StateError, OSError) as exc:
            log.warning("sandbox publish failed", extra={"sandbox": sandbox_id, "error": str(exc)})
            await self._destroy_and_forget(sandbox_id, pool.name)
        except asyncio.CancelledError:
            # Stepping down: the sandbox stays in `_starting`, so `_abandon` destroys it and
            # forgets its record once every task has stopped (no cleanup races a re-cancel).
            cancelled = True
            raise
        finally:
            if not cancelled:
                self._starting.pop(sandbox_id, None)
            self._wake.set()

    # --- destroying ----------------------------------------------------------------------
    async def drain_doomed(self, look: Look) -> None:
        """Start destroying every doomed sandbox (bounded concurrency, one task each): those the pass's
        look popped, then more while the set gives a full batch."""
        popped, batch = look.doomed, look.asked
        while batch > 0:
            if self._passing is not None:
                self._passing.update(popped)
            for sandbox_id in popped:
                if sandbox_id in self._destroying:
                    continue
                self._destroying.add(sandbox_id)
                task = asyncio.create_task(self._destroy_doomed(sandbox_id), name=f"destroy-{sandbox_id}")
                self._destroy_tasks.add(task)
                task.add_done_callback(self._destroy_tasks.discard)
            if len(popped) < batch:
                return  # the set was empty: no second round trip to find that out (a doom wakes us)
            batch = self.timing.max_concurrent_destroys - len(self._destroying)
            popped = await self.sandboxes.pop_doomed(batch) if batch > 0 else []

    async def _destroy_doomed(self, sandbox_id: str) -> None:
        try:
            pool = await self.sandboxes.pool_of(sandbox_id)
            if not await self._destroy_and_forget(sandbox_id, pool):
                attempts = self._destroy_failures.get(sandbox_id, 0) + 1
                self._destroy_failures[sandbox_id] = attempts
                if attempts < self.timing.destroy_attempts:
                    await asyncio.sleep(min(self.timing.retry_base_seconds * 2 ** attempts,
                                            self.timing.retry_max_seconds))
                    await self.sandboxes.doom_again(sandbox_id)
                else:
                    log.error("giving up destroying sandbox; reconciliation will retry",
                              extra={"sandbox": sandbox_id})
                    self._destroy_failures.pop(sandbox_id, None)
            else:
                self._destroy_failures.pop(sandbox_id, None)
        except (StateError, OSError) as exc:
            log.warning("doomed sandbox handling failed", extra={"sandbox": sandbox_id, "error": str(exc)})
            await self._requeue_doomed(sandbox_id)
        finally:
            self._destroying.discard(sandbox_id)
            self._wake.set()

    async def _requeue_doomed(self, sandbox_id: str) -> None:
        """Put a popped sandbox back on `doomed` once Redis answers, so a Redis outage delays its
        destruction by the outage, not by a whole reconciliation interval."""
        for attempt in range(self.timing.destroy_attempts):
            await asyncio.sleep(min(self.timing.retry_base_seconds * 2 ** attempt, self.timing.retry_max_seconds))
            try:
                await self.sandboxes.doom_again(sandbox_id)
                return
            except StateError:
                continue

    async def _destroy_and_forget(self, sandbox_id: str, pool: str) -> bool:
        """Destroy through the provider, then drop the record. False if the provider failed."""
        if not await self._destroy_quietly(sandbox_id):
            return False
        await self._forget(sandbox_id, pool)
        return True

    async def _destroy_quietly(self, sandbox_id: str) -> bool:
        try:
            async with asyncio.timeout(self.timing.destroy_timeout_seconds):
                await self.provider.destroy(sandbox_id)
            return True
        except (ProviderError, OSError, TimeoutError) as exc:
            self._count_provider_error("destroy")
            log.warning("sandbox destroy failed", extra={"sandbox": sandbox_id, "error": str(exc)})
            return False

    async def _forget(self, sandbox_id: str, pool: str) -> None:
        await self.sandboxes.forget(sandbox_id, pool)

    # --- sandboxes the provider lost ------------------------------------------------------
    def _on_lost(self, sandbox_id: str, reason: str) -> None:
        """The provider's listener (on the event loop, must not block): act at once, in a task."""
        task = asyncio.ensure_future(self.handle_lost(sandbox_id, reason))
        self._lost_tasks.add(task)
        task.add_done_callback(self._lost_tasks.discard)

    async def handle_lost(self, sandbox_id: str, reason: str) -> None:
        """A sandbox died on its own: never lease it again, end the session on it, replace it.

        Any replica may act (the scripts are atomic and idempotent); the reconciliation
        that follows later finds nothing left to do."""
        try:
            pool = await self.sandboxes.pool_of(sandbox_id)
            lost = await self.sandboxes.lost(sandbox_id, pool)
            if lost.session:
                await self.sessions.release(session_id=lost.session, workspace=None, now=time.time(), mode="dead")
        except StateError as exc:
            log.warning("could not act on a lost sandbox; reconciliation will", extra={
                "sandbox": sandbox_id, "error": str(exc)})
            return
        if lost.state:
            self.metrics.reconciled.labels(kind="lost").inc()
            log.warning("sandbox lost", extra={"sandbox": sandbox_id, "pool": pool, "reason": reason,
                                               "state": lost.state, "session": lost.session or None})
        self._wake.set()

    # --- reconciliation ------------------------------------------------------------------
    async def reconcile(self) -> None:
        """Make Redis and the provider agree (`reconcile.plan` decides). Safe to run at any time on the leader."""
        self._last_reconcile = started = time.monotonic()
        passing: set[str] = set()
        self._passing = passing
        try:
            if await self._reconcile(passing):
                self.metrics.reconcile_pass.observe(time.monotonic() - started)
        finally:
            if self._passing is passing:
                self._passing = None

    async def _reconcile(self, passing: set[str]) -> bool:
        """One pass; False when it could not look (the provider's list failed)."""
        # Creates in flight when the list was taken may finish (and publish) before their record is
        # read; the provider's list may not show them yet: never judge those, nor our destroys.
        busy = frozenset(self._starting) | frozenset(self._destroying)
        busy_since = time.time()
        try:
            running = {info.sandbox_id: info for info in await self.provider.list()}
        except (ProviderError, OSError) as exc:
            self._count_provider_error("list")
            log.warning("provider list failed; reconciliation skipped", extra={"error": str(exc)})
            return False
        # Members are read after the provider's list: a sandbox the provider runs was
        # registered before it was created, so it is in its pool's members by now. Each member is read
        # as settled (its id) or with its record (its pool the one that owns it) and the sandbox its
        # session names.
        pool_names = set(self.pools) | {info.pool for info in running.values() if info.pool}
        survey = await self.sandboxes.survey(pool_names, rest=self.timing.reconcile_rest)
        led_for = time.monotonic() - self._leading_since
        # (`busy` is left to the plan, which neither judges a busy record nor counts a busy sandbox an orphan.)
        decided = await self._plan(survey, running, Situation(
            now=time.time(), replica_id=self.replica_id, start_timeout=self.timing.start_timeout_seconds,
            term=self.timing.leadership_ms / 1000, led_for=led_for, busy=busy | frozenset(passing),
            busy_since=busy_since))
        if decided.recheck_in is not None:
            self._recheck_at = min(self._recheck_at, time.monotonic() + decided.recheck_in)
        failed: set[str] = set()
        for action in decided.actions:
            sandbox_id = action.sandbox_id
            if sandbox_id in failed or sandbox_id in self._starting or sandbox_id in self._destroying \
                    or sandbox_id in passing:
                continue
            try:
                if not await self._execute(action):
                    failed.add(sandbox_id)
            except (StateError, OSError, TimeoutError, ProviderError) as exc:
                failed.add(sandbox_id)
                log.warning("reconciling a sandbox failed", extra={"sandbox": sandbox_id, "error": str(exc)})
            except Exception:  # one sandbox's bug must not keep every later one from being reconciled
                failed.add(sandbox_id)
                log.exception("reconciling a sandbox crashed", extra={"sandbox": sandbox_id})
        if decided.actions:
            self._wake.set()  # slots were freed and sandboxes doomed: top up and drain now, not at a deadline
        return True

    async def _plan(self, survey: Survey, running: dict[str, SandboxInfo], situation: Situation) -> Plan:
        """`reconcile.plan`, in a worker thread, the records judged `PLAN_SLICE` at a time and paced as the
        reads are: judged all at once, records of 100,000 sandboxes were ~0.2 s of pure Python that took a
        core from the request path for as long (on the event loop it would also hold this process's
        reaper and refills). The settled members cost a look-up each."""
        first, values, sessions = await asyncio.to_thread(prepare, survey.records, running, survey.sessions,
                                                          situation, survey.settled)
        parts = [first]
        for start in range(0, len(values), PLAN_SLICE):
            began = time.perf_counter()
            parts.append(await asyncio.to_thread(judge, values[start:start + PLAN_SLICE], running, sessions,
                                                 situation))
            if start + PLAN_SLICE < len(values) and self.timing.reconcile_rest:
                await asyncio.sleep(self.timing.reconcile_rest * (time.perf_counter() - began))
        return merge(parts)

    async def _execute(self, action: Action) -> bool:
        """One action of a reconciliation plan; False when the sandbox's later actions must not run."""
        sandbox_id = action.sandbox_id
        if isinstance(action, Destroy):
            log.warning("destroying sandbox", extra={"sandbox": sandbox_id, "pool": action.pool,
                                                     "why": action.kind})
            self.metrics.reconciled.labels(kind=action.kind).inc()
            return await self._destroy_and_forget(sandbox_id, action.pool)
        if isinstance(action, ReleaseDead):
            # The release is the session layer's own script (mode `dead`: session-seconds metered once,
            # session and deadline dropped, sandbox doomed), so a session lost this way is accounted
            # exactly like one whose agent died under a call. Checked again: a plan's facts may be stale.
            if await self.sandboxes.session_on(action.session_id) == sandbox_id and await self.sessions.release(
                    session_id=action.session_id, workspace=None, now=time.time(), mode="dead") is not None:
                log.info("released the session of a lost sandbox",
                         extra={"sandbox": sandbox_id, "session": action.session_id})
            return True
        if isinstance(action, Forget):
            if action.kind is not None:
                self.metrics.reconciled.labels(kind=action.kind).inc()
            log.info("forgetting sandbox the provider does not run", extra={"sandbox": sandbox_id,
                                                                            "pool": action.pool})
            await self._forget(sandbox_id, action.pool)
            return True
        if isinstance(action, MarkLost):
            lost = await self.sandboxes.lost(sandbox_id, action.pool)
            self.metrics.reconciled.labels(kind=action.kind).inc()
            log.warning("sandbox agent is gone; marked lost", extra={
                "sandbox": sandbox_id, "pool": action.pool, "state": lost.state or "missing"})
            return True
        if isinstance(action, DoomAgain):
            await self.sandboxes.doom_again(sandbox_id)
            return True
        if isinstance(action, DestroySessionless):
            current = (await self.sandboxes.records([sandbox_id]))[sandbox_id]
            if current.state == "leased" and current.session == action.session_id:
                log.warning("destroying sandbox leased to a session that is gone",
                            extra={"sandbox": sandbox_id, "session": action.session_id})
                self.metrics.reconciled.labels(kind="sessionless_lease").inc()
                return await self._destroy_and_forget(sandbox_id, action.pool)
            return True
        raise TypeError(f"unknown reconciliation action {action!r}")

    # --- observability -------------------------------------------------------------------
    def _count_provider_error(self, operation: str) -> None:
        self.metrics.provider_errors.labels(provider=getattr(self.provider, "name", "unknown"),
                                             operation=operation).inc()

    def status(self) -> dict[str, object]:
        """For /readyz and logs: who leads here and what is in flight."""
        return {"running": self.running, "leader": self.is_leader, "replica": self.replica_id,
                "starting": len(self._starting), "destroying": len(self._destroying),
                "pools": {p.name: {"warm": p.warm, "max_warm": p.warm_cap, "ceiling": p.ceiling,
                                   "target": self.targets[p.name].target} for p in self.pools.values()}}


__all__ = ["ControllerTiming", "PoolController", "SandboxInfo", "new_sandbox_id"]
