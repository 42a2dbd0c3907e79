"""The Kubernetes provider: one pod (plus one Secret) per sandbox.

`create` POSTs the pod, then its Secret owned by the pod's uid, waits for the
watch to report the pod Ready with an IP, then asks the agent itself
(`GET http://<podIP>:<port>/healthz`) before returning: a sandbox is published
only once the controller can reach its agent, NetworkPolicy and all. A create
that fails or is cancelled deletes its pod (the Secret follows through its
ownerReference).

`destroy` queues the sandbox for deletion; queued deletions leave in batches
(one `deletecollection` with a label selector naming up to `DELETE_BATCH`
sandboxes), paced by their own token bucket. Creations are paced by another.
`list` asks the API server for every pod with this installation's label, so a
restarted controller finds what its predecessor started.

With `--kube-egress-proxy`, every sandbox also gets an egress credential (a
second key of its Secret; its digest is published for the lease to bind) and
the egress proxy's address, resolved here to an IP (sandbox pods have no DNS).

`on_lost(listener)` registers who is told, from the watch and at once, that a
sandbox's pod was deleted, failed or stopped running behind our back (not for
pods this provider is creating or was asked to destroy).

Nothing here is on the CreateSession path: the api leases from Redis.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
from collections import OrderedDict
from typing import Any

import httpx

from sandpool.controller.provider import LostListener, PoolSpec, ProviderError, SandboxInfo
from sandpool.providers.kubernetes.client import ApiError, Conflict, KubeApi, NotFound
from sandpool.providers.kubernetes.metrics import KubernetesProviderCollector
from sandpool.providers.kubernetes.pods import (
    ANNOTATION_ATTEMPT,
    HEALTH_PATH,
    InvalidPool,
    PodOptions,
    PodState,
    agent_address,
    build_pod,
    build_secret,
    check_sandbox_id,
    installation_selector,
    object_name,
    read_pod,
    sandboxes_selector,
)
from sandpool.providers.kubernetes.ratelimit import TokenBucket
from sandpool.providers.kubernetes.settings import KubernetesProviderSettings
from sandpool.providers.kubernetes.watch import GONE_REMEMBERED, PodGone, PodWatcher
from sandpool.state.keys import egress_digest

log = logging.getLogger("sandpool.providers.kubernetes")

DELETE_BATCH = 50  # sandboxes named in one deletecollection selector (a short URL either way)
EGRESS_RESOLVE_SECONDS = 60.0  # how long a resolved egress proxy address is reused


class KubernetesProvider:
    name = "kubernetes"
    settings_class = KubernetesProviderSettings

    def __init__(self, settings: KubernetesProviderSettings | None = None) -> None:
        self.settings = settings or KubernetesProviderSettings()
        self.options = PodOptions.from_settings(self.settings)
        self.selector = installation_selector(self.settings.kube_installation)
        self.api = KubeApi(self.settings)
        self.watcher = PodWatcher(self.api, self.selector,
                                  watch_timeout_seconds=self.settings.kube_watch_timeout_seconds,
                                  backoff_max_seconds=self.settings.kube_backoff_max_seconds,
                                  relist_seconds=self.settings.kube_relist_seconds,
                                  on_lost=self._pod_lost)
        self._create_bucket = TokenBucket(self.settings.kube_create_rate, self.settings.kube_create_burst)
        self._delete_bucket = TokenBucket(self.settings.kube_delete_rate, self.settings.kube_delete_burst)
        self._http: httpx.AsyncClient | None = None
        self._pending_deletes: dict[str, list[asyncio.Future[None]]] = {}
        self._delete_wakeup: asyncio.Event | None = None
        self._deleter: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._started = False
        self._lost_listener: LostListener | None = None
        self._creating: set[str] = set()  # sandbox ids whose create() is in flight
        self._deleting: OrderedDict[str, None] = OrderedDict()  # uids of pods we delete ourselves
        self._egress_resolved: tuple[float, str] | None = None  # (until, IP:PORT)
        self.counts = {"created": 0, "create_failed": 0, "destroyed": 0, "delete_calls": 0, "lost": 0}

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self.api.start()
            # Pod IPs are never behind a proxy: ignore HTTP(S)_PROXY for the agent probe.
            self._http = httpx.AsyncClient(timeout=self.settings.kube_health_timeout_seconds, trust_env=False)
            await self.watcher.start()
        except ApiError as exc:
            await self.close()
            raise ProviderError(f"kubernetes provider cannot start: {exc}", transient=exc.transient) from None
        self._delete_wakeup = asyncio.Event()
        self._deleter = asyncio.create_task(self._delete_loop(), name="sandpool-kube-deleter")
        self._started = True
        log.info("kubernetes provider started", extra={"server": self.api.server,
                                                       "namespace": self.settings.kube_namespace,
                                                       "installation": self.settings.kube_installation,
                                                       "pods": len(self.watcher.pods)})

    async def close(self) -> None:
        self._started = False
        if self._deleter is not None:
            self._deleter.cancel()
            await asyncio.gather(self._deleter, return_exceptions=True)
            self._deleter = None
        for futures in self._pending_deletes.values():
            for future in futures:
                if not future.done():
                    future.set_exception(ProviderError("the provider closed before the delete was sent"))
        self._pending_deletes.clear()
        if self._background:
            await asyncio.wait(self._background, timeout=self.settings.kube_api_timeout_seconds)
        await self.watcher.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        await self.api.close()

    # --- create -------------------------------------------------------------------------------

    async def create(self, pool: PoolSpec, sandbox_id: str) -> SandboxInfo:
        self._require_started()
        attempt = secrets.token_hex(8)
        egress = await self._egress_proxy()
        try:
            pod = build_pod(pool, sandbox_id, self.options, attempt=attempt, egress_proxy=egress)
        except InvalidPool as exc:
            raise ProviderError(str(exc), transient=False) from None
        name = pod["metadata"]["name"]
        agent_secret = secrets.token_urlsafe(32)
        egress_credential = secrets.token_urlsafe(32) if egress is not None else None
        loop = asyncio.get_running_loop()
        await self._create_bucket.acquire()
        # The pod's own time to start; a wait for a create token above is not charged to it.
        deadline = loop.time() + self.settings.kube_ready_timeout_seconds
        uid: str | None = None
        created = False
        self._creating.add(sandbox_id)
        try:
            uid = await self._create_pod(pod, attempt)
            created = True
            await self._create_secret(pool, sandbox_id, agent_secret, uid, attempt, egress_credential)
            state = await self.watcher.wait_ready(name, uid, deadline - loop.time())
            address = agent_address(str(state.pod_ip), self.settings.kube_agent_port)
            await self._wait_for_agent(address, name, uid, deadline)
        except asyncio.CancelledError:
            # The caller gave up (its own start timeout): clean up without making it wait.
            self._deleting_now(uid)
            self._spawn(self._delete_quietly(name, uid))
            self.counts["create_failed"] += 1
            raise
        except (ApiError, PodGone, TimeoutError, ProviderError) as exc:
            self.counts["create_failed"] += 1
            # Delete what we made; after a lost answer (transient) the pod may exist too. A refused
            # POST (4xx) or a pod that is not ours (ProviderError before `created`) is left alone.
            if created or (isinstance(exc, ApiError) and exc.transient):
                self._deleting_now(uid)
                await self._delete_quietly(name, uid)
            if isinstance(exc, ProviderError):
                raise
            transient = getattr(exc, "transient", True)
            raise ProviderError(f"sandbox {sandbox_id}: {exc}", transient=transient) from None
        finally:
            self._creating.discard(sandbox_id)
        self.counts["created"] += 1
        return SandboxInfo(sandbox_id=sandbox_id, pool=pool.name, address=address, secret=agent_secret, ready=True,
                           egress_digest=egress_digest(egress_credential) if egress_credential else None)

    async def _egress_proxy(self) -> str | None:
        """The egress proxy as IP:PORT (its Service's name resolved here, reused for a minute); None
        without egress. A name that does not resolve fails the create (retried later)."""
        target = self.settings.kube_egress_proxy
        if target is None:
            return None
        host, _, port = target.rpartition(":")
        host = host.strip("[]")
        try:
            ipaddress.ip_address(host)
            return target
        except ValueError:
            pass
        loop = asyncio.get_running_loop()
        if self._egress_resolved is not None and loop.time() < self._egress_resolved[0]:
            return self._egress_resolved[1]
        try:
            found = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ProviderError(f"the egress proxy {target} does not resolve: {exc.strerror or exc}") from None
        address = str(found[0][4][0])
        resolved = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        self._egress_resolved = (loop.time() + EGRESS_RESOLVE_SECONDS, resolved)
        return resolved

    async def _create_pod(self, pod: dict[str, Any], attempt: str) -> str:
        """POST the pod; a 409 on a pod our own earlier (retried) POST made is that pod."""
        name = pod["metadata"]["name"]
        try:
            return str(read_pod(await self.api.create_pod(pod)).uid)
        except Conflict:
            try:
                existing = read_pod(await self.api.get_pod(name))
            except NotFound:
                return str(read_pod(await self.api.create_pod(pod)).uid)  # it went meanwhile: once more
            if existing.attempt == attempt and not existing.terminating:
                return existing.uid
            raise ProviderError(f"a pod named {name} already exists", transient=existing.terminating) from None

    async def _create_secret(self, pool: PoolSpec, sandbox_id: str, value: str, owner_uid: str, attempt: str,
                             egress_credential: str | None = None) -> None:
        """POST the Secret owned by the pod; a 409 can only be our own earlier (retried) POST."""
        body = build_secret(pool, sandbox_id, self.options, secret=value, owner_uid=owner_uid, attempt=attempt,
                            egress_credential=egress_credential)
        name = body["metadata"]["name"]
        try:
            await self.api.create_secret(body)
            return
        except Conflict:
            existing = await self.api.get_secret(name)
        meta = existing.get("metadata") or {}
        owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
        if (meta.get("annotations") or {}).get(ANNOTATION_ATTEMPT) != attempt or owner_uid not in owners:
            raise ProviderError(f"a Secret named {name} already exists and is not this pod's", transient=True)

    async def _wait_for_agent(self, address: str, name: str, uid: str, deadline: float) -> None:
        """Poll the agent's health check from here: Ready says the kubelet reaches it, not that we do."""
        assert self._http is not None
        loop = asyncio.get_running_loop()
        pause = 0.02
        last = "no answer"
        while True:
            self.watcher.check_alive(name, uid)
            try:
                response = await self._http.get(address + HEALTH_PATH)
                if response.status_code == 200:
                    return
                last = f"status {response.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if loop.time() + pause >= deadline:
                raise TimeoutError(f"agent of pod {name} did not answer at {address} ({last})")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)

    async def _delete_quietly(self, name: str, uid: str | None) -> None:
        try:
            await self._delete_bucket.acquire()
            await self.api.delete_pod(name, uid=uid)
            self.counts["delete_calls"] += 1
        except NotFound:
            pass
        except ApiError as exc:
            log.warning("could not delete a failed sandbox pod; reconciliation will",
                        extra={"pod": name, "error": str(exc)})

    # --- destroy ------------------------------------------------------------------------------

    async def destroy(self, sandbox_id: str) -> None:
        """Returns once the API server has accepted the pod's deletion (its Secret follows it)."""
        self._require_started()
        try:
            check_sandbox_id(sandbox_id)
        except InvalidPool:
            return  # no pod can carry such an id: nothing to destroy
        known = self.watcher.pods.get(object_name(self.settings.kube_installation, sandbox_id))
        if known is not None:
            self._deleting_now(known.uid)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending_deletes.setdefault(sandbox_id, []).append(future)
        assert self._delete_wakeup is not None
        self._delete_wakeup.set()
        await future

    async def _delete_loop(self) -> None:
        assert self._delete_wakeup is not None
        while True:
            await self._delete_wakeup.wait()
            self._delete_wakeup.clear()
            while self._pending_deletes:
                await self._delete_bucket.acquire()
                batch = list(self._pending_deletes)[:DELETE_BATCH]
                futures = {sid: self._pending_deletes.pop(sid) for sid in batch}
                self._spawn(self._delete_batch(futures))

    async def _delete_batch(self, futures: dict[str, list[asyncio.Future[None]]]) -> None:
        ids = sorted(futures)
        error: ProviderError | None = None
        try:
            self.counts["delete_calls"] += 1
            if len(ids) == 1:
                try:
                    await self.api.delete_pod(object_name(self.settings.kube_installation, ids[0]))
                except NotFound:
                    pass
            else:
                await self.api.delete_pods(sandboxes_selector(self.settings.kube_installation, ids))
            self.counts["destroyed"] += len(ids)
        except ApiError as exc:
            error = ProviderError(f"delete of {len(ids)} sandbox(es) failed: {exc}", transient=exc.transient)
        for waiting in futures.values():
            for future in waiting:
                if future.done():
                    continue
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

    # --- losses -------------------------------------------------------------------------------

    def on_lost(self, listener: LostListener) -> None:
        """Register the listener told at once (from the watch) that a sandbox's pod died on its own."""
        self._lost_listener = listener

    def _deleting_now(self, uid: str | None) -> None:
        """Our own deletion of this pod (by uid: a sandbox id may come back) is no loss to report."""
        if not uid:
            return
        self._deleting[uid] = None
        while len(self._deleting) > GONE_REMEMBERED:
            self._deleting.popitem(last=False)

    def _pod_lost(self, state: PodState, reason: str) -> None:
        """From the watcher, on the event loop: a pod of ours will not serve any more."""
        sandbox_id = state.sandbox_id
        if not sandbox_id or state.attempt is None:
            return  # not a sandbox pod this provider made
        if state.uid in self._deleting:
            if reason == "deleted":
                del self._deleting[state.uid]  # the watcher reports a pod once: forget it
            return
        if sandbox_id in self._creating:
            return  # its create() fails on its own, and deletes it
        self.counts["lost"] += 1
        log.warning("sandbox lost", extra={"sandbox": sandbox_id, "pod": state.name, "reason": reason,
                                           "phase": state.phase, "why": state.reason})
        listener = self._lost_listener
        if listener is None:
            return
        try:
            listener(sandbox_id, reason)
        except Exception:  # the listener's bug must not stop the watch
            log.exception("sandbox loss listener failed", extra={"sandbox": sandbox_id})

    # --- list and describe --------------------------------------------------------------------

    async def list(self) -> list[SandboxInfo]:
        """Every pod of this installation that is not already being deleted.

        `ready` is "its agent is running": the pod runs and has its IP. (The Ready
        condition itself can flap while sandboxed code keeps the agent busy; a
        leased sandbox must not be declared dead for that.)
        """
        self._require_started()
        try:
            data = await self.api.list_pods(self.selector)
        except ApiError as exc:
            raise ProviderError(f"list of sandbox pods failed: {exc}", transient=exc.transient) from None
        out = []
        for item in data.get("items") or []:
            state = read_pod(item)
            if state.terminating or not state.sandbox_id:
                continue
            running = state.phase == "Running" and bool(state.pod_ip)
            out.append(SandboxInfo(
                sandbox_id=state.sandbox_id, pool=state.pool or "",
                address=agent_address(state.pod_ip, self.settings.kube_agent_port) if state.pod_ip else None,
                ready=running,
            ))
        return out

    def register_metrics(self, registry: Any) -> None:
        """Export the counters below on the owner's Prometheus registry (its `/metrics`)."""
        registry.register(KubernetesProviderCollector(self.api.stats, self.watcher, self.counts))

    def describe(self) -> dict[str, object]:
        return {
            "provider": self.name,
            "server": self.api.server,
            "namespace": self.settings.kube_namespace,
            "installation": self.settings.kube_installation,
            "isolation": {
                "pod_security": "non-root, read-only root filesystem, all capabilities dropped, "
                                "no privilege escalation, seccomp RuntimeDefault, no service-account token",
                "runtime_class": "per pool (runtimeClassName)",
                "network": "NetworkPolicy from the chart (sandbox ingress from the api and the controller only)",
            },
            "rates": {"create_per_second": self.settings.kube_create_rate,
                      "delete_per_second": self.settings.kube_delete_rate},
            "api": self.api.stats.as_dict(),
            "watch": {"pods": len(self.watcher.pods), "relists": self.watcher.relists,
                      "requests": self.watcher.watch_requests, "events": self.watcher.events,
                      "expired": self.watcher.expired},
            "sandboxes": dict(self.counts),
        }

    # --- helpers ------------------------------------------------------------------------------

    def _require_started(self) -> None:
        if not self._started:
            raise ProviderError("the kubernetes provider is not started", transient=False)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
