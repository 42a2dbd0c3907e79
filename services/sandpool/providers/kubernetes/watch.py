"""The provider's view of its pods: one list, then a watch that resumes where it left off.

`create()` learns that its pod is Ready, and its IP, from here instead of polling
the API server: fifty starting pods cost one open watch, not fifty GET loops.

The watch runs on its own thread (the client blocks while it reads the stream)
and hands each event to the event loop. It resumes from the last
resourceVersion it saw (bookmarks included) when the server ends a request,
and lists afresh when the server answers `410 Gone` (the version is older than
the server keeps; a restarted API server says so) or after repeated refusals;
an unreachable server is retried with backoff, never re-listed for that alone. Every change wakes whoever waits
for that pod.

Every change is also checked for a loss: a pod that is being deleted or was
deleted (a `DELETED` event, or missing from a fresh list), that failed
(`Failed`/`Succeeded`: restartPolicy Never), or that left the `Running` phase or
lost its IP is reported once, at once, to `on_lost(state, reason)`. The Ready
condition alone is not a loss: it flaps while sandboxed code keeps the agent busy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from sandpool.providers.kubernetes.client import ApiError, Gone, KubeApi
from sandpool.providers.kubernetes.pods import PodState, read_pod

log = logging.getLogger("sandpool.providers.kubernetes")

GONE_REMEMBERED = 4096  # deleted pods remembered, so a waiter learns its pod vanished

PodLost = Callable[[PodState, str], None]
"""Told of a pod that will not serve any more, with the reason (`deleted`, `failed`, `not_running`)."""


def loss_of(old: PodState | None, new: PodState | None) -> str | None:
    """Why a pod that was `old` and is now `new` (None: gone) can no longer serve, if it cannot.

    Pure, for the watcher and its tests. A pod never seen running (`old` None or
    Pending) is lost only by being deleted or failing: its create is still waiting.
    """
    if new is None or new.terminating:
        return "deleted"
    if new.phase in ("Failed", "Succeeded"):
        return "failed"
    if new.phase == "Unknown":
        return "not_running"
    if old is not None and old.uid == new.uid and old.phase == "Running" and old.pod_ip and (
            new.phase != "Running" or not new.pod_ip):
        return "not_running"
    return None


class PodGone(Exception):
    """The pod a caller waits for failed, is being deleted, or was deleted."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"pod {name} {why}")
        self.name = name
        self.why = why


class PodWatcher:
    def __init__(self, api: KubeApi, selector: str, *, watch_timeout_seconds: int,
                 backoff_max_seconds: float, relist_seconds: float = 600.0,
                 on_lost: PodLost | None = None) -> None:
        self.api = api
        self.selector = selector
        self.watch_timeout_seconds = watch_timeout_seconds
        self.backoff_max_seconds = backoff_max_seconds
        self.relist_seconds = relist_seconds
        self._listed_at = 0.0
        self.pods: dict[str, PodState] = {}
        self.relists = 0
        self.watch_requests = 0
        self.events = 0
        self.expired = 0  # 410 Gone answers to a resumed watch (each followed by a list)
        self.on_lost = on_lost
        self._lost: OrderedDict[str, None] = OrderedDict()  # uids already reported lost
        self._gone: OrderedDict[str, str] = OrderedDict()  # name -> uid of pods seen deleted
        self._waiters: dict[str, asyncio.Event] = {}
        self._resource_version = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """List once (so callers see every existing pod), then watch from that version."""
        self._loop = asyncio.get_running_loop()
        await self.relist()
        self._thread = threading.Thread(target=self._run, name="sandpool-kube-watch", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        self.api.stop_watch()
        thread, self._thread = self._thread, None
        if thread is not None:
            # The stream's socket is shut down; the read timeout bounds the wait if that failed.
            await asyncio.to_thread(thread.join, self.watch_timeout_seconds)
        for event in self._waiters.values():
            event.set()

    async def relist(self) -> None:
        data = await self.api.list_pods(self.selector)
        states = [read_pod(item) for item in data.get("items") or []]
        self._replace(states)
        self._resource_version = str((data.get("metadata") or {}).get("resourceVersion") or "")
        self._listed_at = time.monotonic()
        self.relists += 1

    # --- the watch thread ---------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self.watch_requests += 1
                for event in self.api.watch_pods_blocking(self.selector, self._resource_version,
                                                          self.watch_timeout_seconds):
                    if self._stop.is_set():
                        return
                    self._on_event(event)
                    failures = 0
                # The server ended the request. Resume from our version, or list afresh now and then:
                # a watch is a cache of the truth, and a list bounds how long a missed event can last.
                if time.monotonic() - self._listed_at >= self.relist_seconds:
                    self._relist_from_thread()
            except Gone:
                self.expired += 1
                log.info("pod watch expired (410 Gone); listing again")
                if not self._relist_from_thread():
                    failures += 1
                    self._stop.wait(self._backoff(failures))
            except ApiError as exc:
                if self._stop.is_set():
                    return
                failures += 1
                log.warning("pod watch failed; resuming", extra={"error": str(exc), "failures": failures})
                self._stop.wait(self._backoff(failures))
                # A server that answers but keeps refusing: start from a fresh list. One that does not
                # answer at all (a restart, a partition) is resumed, not re-listed: when it is back it
                # serves our version or says 410, and a list of every pod per outage is what turns an
                # API-server restart into a storm of LISTs.
                if exc.status and failures >= 3:
                    self._relist_from_thread()
            except Exception:  # the watch must outlive any one bad event
                failures += 1
                log.exception("pod watch crashed; resuming")
                self._stop.wait(self._backoff(failures))

    def _backoff(self, failures: int) -> float:
        return min(self.backoff_max_seconds, 0.1 * 2 ** failures)

    def _relist_from_thread(self) -> bool:
        assert self._loop is not None
        if self._stop.is_set():
            return True
        future = asyncio.run_coroutine_threadsafe(self.relist(), self._loop)
        try:
            future.result(timeout=self.api.settings.kube_api_timeout_seconds * (self.api.settings.kube_max_retries + 2)
                          + 60)
            return True
        except Exception as exc:  # noqa: BLE001 - logged; the loop retries with backoff
            log.warning("pod list failed", extra={"error": str(exc)})
            return False

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if version:
            self._resource_version = version
        if kind == "BOOKMARK" or kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        state = read_pod(obj)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._apply, kind, state)

    # --- state, on the event loop -------------------------------------------------------------

    def _apply(self, kind: str, state: PodState) -> None:
        self.events += 1
        old = self.pods.get(state.name)
        if old is not None and old.uid != state.uid:
            self._changed(old, None)  # replaced by a namesake: the old one went unseen
            old = None
        if kind == "DELETED":
            self.pods.pop(state.name, None)
            self._remember_gone(state)
            self._changed(old or state, None)
        else:
            self.pods[state.name] = state
            self._changed(old, state)
        self._wake(state.name)

    def _replace(self, states: list[PodState]) -> None:
        fresh = {s.name: s for s in states}
        previous, self.pods = self.pods, fresh
        for name, old in previous.items():
            new = fresh.get(name)
            if new is None or new.uid != old.uid:
                self._remember_gone(old)
                self._changed(old, None)  # deleted while the watch was not looking
        for name, new in fresh.items():
            before = previous.get(name)
            self._changed(before if before is not None and before.uid == new.uid else None, new)
        for name in list(self._waiters):
            self._wake(name)

    def _changed(self, old: PodState | None, new: PodState | None) -> None:
        """Report a pod the first time a change shows it lost; forget it once it is gone."""
        state = new or old
        if state is None:
            return
        reason = loss_of(old, new)
        if reason is not None and state.uid not in self._lost:
            self._lost[state.uid] = None
            while len(self._lost) > GONE_REMEMBERED:
                self._lost.popitem(last=False)
            if self.on_lost is not None:
                try:
                    self.on_lost(state, reason)
                except Exception:  # a listener's bug must not stop the watch
                    log.exception("pod loss listener failed", extra={"pod": state.name})
        if new is None:
            self._lost.pop(state.uid, None)

    def _remember_gone(self, state: PodState) -> None:
        self._gone[state.name] = state.uid
        self._gone.move_to_end(state.name)
        while len(self._gone) > GONE_REMEMBERED:
            self._gone.popitem(last=False)

    def _wake(self, name: str) -> None:
        event = self._waiters.pop(name, None)
        if event is not None:
            event.set()

    async def wait_ready(self, name: str, uid: str, timeout: float) -> PodState:
        """The pod once it is Ready with an IP; `PodGone` if it never will be; `TimeoutError`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self.check_alive(name, uid)
            state = self.pods.get(name)
            if state is not None and state.uid == uid and state.ready and state.pod_ip:
                return state
            remaining = deadline - loop.time()
            if remaining <= 0 or self._stop.is_set():
                raise TimeoutError(f"pod {name} not ready in time")
            event = self._waiters.setdefault(name, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                raise TimeoutError(f"pod {name} not ready in time") from None

    def check_alive(self, name: str, uid: str) -> None:
        """Raise `PodGone` if the watch saw this pod (this uid) fail or go."""
        state = self.pods.get(name)
        if state is not None and state.uid == uid:
            if state.terminating:
                raise PodGone(name, "is being deleted")
            if state.finished:
                raise PodGone(name, f"stopped ({state.phase}{', ' + state.reason if state.reason else ''})")
        elif self._gone.get(name) == uid:
            raise PodGone(name, "was deleted")
