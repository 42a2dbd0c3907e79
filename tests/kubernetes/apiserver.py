"""A small, stateful stand-in for the Kubernetes API server and kubelet.

Kept for what a real API server cannot be made to do on demand: answer 429 with
`Retry-After`, fail a call with an injected 5xx, lose an answer after doing the
work; and for the turnover measurement. Everything else in `tests/kubernetes/`
runs against a real API server (`realapi.py`, `kubelet.py`).

It serves the core/v1 endpoints the provider uses, over real HTTP, to the real
`kubernetes` client (configured from a real kubeconfig file):

    GET    /api/v1/namespaces/{ns}/pods[?labelSelector&watch&resourceVersion&timeoutSeconds&allowWatchBookmarks]
    POST   /api/v1/namespaces/{ns}/pods
    DELETE /api/v1/namespaces/{ns}/pods?labelSelector=...            (deletecollection)
    GET    /api/v1/namespaces/{ns}/pods/{name}
    DELETE /api/v1/namespaces/{ns}/pods/{name}                        (DeleteOptions, uid preconditions)
    ... and the same for secrets.

What it models: bearer-token authentication (401); one global resourceVersion;
a bounded event history, so a watch from a version older than the history gets
the API server's `ERROR` event with a `410 Expired` Status (`compact()` forgets
the history on demand); watch streams as chunked JSON lines with ADDED, MODIFIED,
DELETED and BOOKMARK events and a server-side `timeoutSeconds`; label selectors
(`=`, `==`, `!=`, `in`, `notin`, exists, `!`); 409 AlreadyExists and uid
precondition conflicts; the Pod Security "restricted" admission check (403);
unknown RuntimeClasses (403); a pod-count ResourceQuota (403 "exceeded quota");
an optional server-side write rate limit answering 429 with `Retry-After`
(like API Priority and Fairness); injectable faults (any status, with
`Retry-After`, for the next N matching requests); the garbage collector
(dependents named by `ownerReferences` go when their owner goes, and a dependent
whose owner does not exist is collected).

And a kubelet: for each pod it waits until every Secret the pod mounts exists
(as the real kubelet does), gives the pod its own loopback address 127.0.0.X
as its podIP, then runs the container's `command` + `args` as a real process
(mode "agent": `sandpool agent` from this environment; mount paths rewritten to
temporary directories holding the volumes' contents, the secret file written
from the Secret's data, `0.0.0.0` rewritten to the pod's address, the way a
network namespace would scope it) or, in mode "stub", serves a minimal health
endpoint on that address. It runs the pod's readiness probe (`httpGet` path and
named port from the spec) and reports Ready, marks the pod Failed when the
process exits (restartPolicy Never), and on deletion sets `deletionTimestamp`,
stops the process, then removes the pod.

What it does not model is written down in docs/kubernetes.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

RESOURCES = {"pods": "Pod", "secrets": "Secret"}
PSS_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                    "projected", "secret"}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def status_body(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message, "reason": reason, "code": code}
    if details:
        body["details"] = details
    return body


class ApiFailure(Exception):
    def __init__(self, code: int, reason: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.headers = code, reason, message, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(status_body(self.code, self.reason, self.message), status_code=self.code,
                            headers=self.headers)


# --- label selectors ------------------------------------------------------------------------------


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        terms.append(current.strip())
    return terms


def selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Kubernetes label selector semantics for the operators the API server accepts."""
    if not selector:
        return True
    for term in _split_terms(selector):
        m = re.fullmatch(r"([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)", term)
        if m:
            key, op, values = m[1], m[2], {v.strip() for v in m[3].split(",") if v.strip()}
            if op == "in" and labels.get(key) not in values:
                return False
            if op == "notin" and key in labels and labels[key] in values:
                return False
            continue
        m = re.fullmatch(r"([^\s!=]+)\s*(==|=|!=)\s*(\S*)", term)
        if m:
            key, op, value = m[1], m[2], m[3]
            if op in ("=", "==") and labels.get(key) != value:
                return False
            if op == "!=" and labels.get(key) == value:
                return False
            continue
        if term.startswith("!"):
            if term[1:].strip() in labels:
                return False
            continue
        if re.fullmatch(r"[^\s!=()]+", term):
            if term not in labels:
                return False
            continue
        raise ApiFailure(400, "BadRequest", f"unable to parse requirement: {term!r}")
    return True


# --- pod security ("restricted") -------------------------------------------------------------------


def pss_restricted_violations(pod: dict[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    psc = spec.get("securityContext") or {}
    out = []
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            out.append(f"{host}=true")
    for vol in spec.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if not kinds <= PSS_VOLUME_TYPES:
            out.append(f"restricted volume types ({vol.get('name')})")
    for c in spec.get("containers") or []:
        sc = c.get("securityContext") or {}
        name = c.get("name")
        if sc.get("privileged"):
            out.append(f"privileged (container {name!r})")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"allowPrivilegeEscalation != false (container {name!r})")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"unrestricted capabilities (container {name!r} must drop ALL)")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"unrestricted capabilities (container {name!r} adds some)")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"runAsNonRoot != true (container {name!r})")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"runAsUser=0 (container {name!r})")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"seccompProfile (container {name!r} must be RuntimeDefault or Localhost)")
    return out


# --- the server ------------------------------------------------------------------------------------


@dataclass
class Fault:
    verb: str  # create | get | list | watch | delete | deletecollection | *
    resource: str  # pods | secrets | *
    status: int
    times: int
    retry_after: int | None = None
    message: str = "injected fault"
    commit: bool = False  # do the operation, then answer the fault (a response lost on the way back)


@dataclass
class RunningPod:
    ip: str | None = None
    process: asyncio.subprocess.Process | None = None
    stub: asyncio.AbstractServer | None = None
    root: Path | None = None
    task: asyncio.Task[None] | None = None
    log: list[str] = field(default_factory=list)


class StandInApiServer:
    """Start with `start()`; `kubeconfig(path)` writes a kubeconfig that points the real client here."""

    def __init__(self, *, kubelet: str = "stub", token: str | None = None, history_limit: int = 10_000,
                 runtime_classes: tuple[str, ...] = ("gvisor", "kata"), pod_quota: int | None = None,
                 probe_period: float = 0.05, bookmark_period: float = 1.0, enforce_restricted: bool = True,
                 agent_env: dict[str, str] | None = None, latency: float = 0.0) -> None:
        assert kubelet in ("stub", "agent", "none")
        self.kubelet = kubelet
        self.token = token or uuid.uuid4().hex
        self.history_limit = history_limit
        self.runtime_classes = set(runtime_classes)
        self.pod_quota = pod_quota
        self.probe_period = probe_period
        self.bookmark_period = bookmark_period
        self.enforce_restricted = enforce_restricted
        self.agent_env = agent_env or {}
        self.latency = latency  # added to every request, like a real API server's own work
        self.port = 0
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {"pods": {}, "secrets": {}}
        self.rv = 100
        self.history: deque[tuple[int, str, str, dict[str, Any]]] = deque()
        self.oldest_rv = self.rv  # a watch may resume from any version >= this
        self.requests: Counter[tuple[str, str, int]] = Counter()
        self.faults: list[Fault] = []
        self.write_limit: tuple[float, float] | None = None  # (rate, burst)
        self._write_tokens = 0.0
        self._write_stamp = 0.0
        self.max_concurrent_writes = 0
        self._writes_in_flight = 0
        self.running: dict[tuple[str, str], RunningPod] = {}
        self._watchers: set[tuple[str, str, str | None, asyncio.Queue[Any]]] = set()
        self._free_ips = [f"127.0.0.{i}" for i in range(2, 255)]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._tmp = Path(tempfile.mkdtemp(prefix="standin-kubelet-"))
        self.agent_port_conflicts = 0

    # --- lifecycle (test thread) ----------------------------------------------------------------

    def start(self) -> StandInApiServer:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        app = Starlette(routes=[
            Route("/api/v1/namespaces/{ns}/{resource}", self._collection, methods=["GET", "POST", "DELETE"]),
            Route("/api/v1/namespaces/{ns}/{resource}/{name}", self._item, methods=["GET", "DELETE"]),
        ])
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1,
                                access_log=False)
        self._server = uvicorn.Server(config)
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.call_soon(ready.set)
            try:
                self._loop.run_until_complete(self._server.serve(sockets=[sock]))
                self._loop.run_until_complete(self._shutdown_pods())
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="standin-apiserver", daemon=True)
        self._thread.start()
        ready.wait(10)
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._closing = True
        if self._loop is not None and self._loop.is_running():
            self.call(self._end_watches)
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(20)
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path, *, namespace: str = "default") -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": self.token}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "tester",
                                                          "namespace": namespace}}],
        }))
        return path

    def call(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` (or a coroutine function) on the server's loop and return its result."""
        assert self._loop is not None

        async def run() -> Any:
            result = fn(*args)
            if asyncio.iscoroutine(result):
                result = await result
            return result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    # --- test controls (any thread) -------------------------------------------------------------

    def inject(self, verb: str, resource: str, status: int, *, times: int = 1, retry_after: int | None = None,
               message: str = "injected fault", commit: bool = False) -> None:
        self.call(self.faults.append, Fault(verb, resource, status, times, retry_after, message, commit))

    def throttle_writes(self, rate: float, burst: float) -> None:
        def apply() -> None:
            self.write_limit = (rate, burst)
            self._write_tokens, self._write_stamp = burst, time.monotonic()
        self.call(apply)

    def compact(self, *, writes_elsewhere: int = 1000) -> None:
        """Many writes elsewhere, then etcd compaction, then the watches drop (a long disconnection).

        Every version a client holds is now older than the history: resuming gets 410 Expired.
        """
        def apply() -> None:
            self.rv += writes_elsewhere
            self.history.clear()
            self.oldest_rv = self.rv + 1
            self._end_watches()
        self.call(apply)

    def open_watches(self) -> int:
        return self.call(lambda: len(self._watchers))

    def end_watches(self) -> None:
        """Close every open watch stream (an API server restart, a load balancer timeout)."""
        self.call(self._end_watches)

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.call(lambda: [copy.deepcopy(o) for (ns, _), o in self.objects["pods"].items()
                                  if namespace in (None, ns)])

    def secrets(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.call(lambda: [copy.deepcopy(o) for (ns, _), o in self.objects["secrets"].items()
                                  if namespace in (None, ns)])

    def status_count(self, status: int) -> int:
        return sum(n for (_, _, code), n in self.requests.items() if code == status)

    def count(self, verb: str, resource: str) -> int:
        return sum(n for (v, r, _), n in self.requests.items() if v == verb and r == resource)

    def kill_container(self, namespace: str, name: str) -> None:
        """The container's process dies (OOM, a crash): the pod becomes Failed."""
        async def kill() -> None:
            run = self.running.get((namespace, name))
            if run is not None and run.process is not None and run.process.returncode is None:
                run.process.kill()
            elif run is not None and run.stub is not None:
                run.stub.close()
                self._container_exited(namespace, name, 137, "OOMKilled")
        self.call(kill)

    def create_object(self, namespace: str, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create an object as another client would (kubectl apply, a previous installation)."""
        return self.call(self._create, namespace, resource, copy.deepcopy(obj))

    def delete_object(self, namespace: str, resource: str, name: str) -> None:
        self.call(self._delete, namespace, resource, name, {})

    # --- HTTP handlers --------------------------------------------------------------------------

    def _check(self, request: Request, verb: str, resource: str) -> None:
        if request.headers.get("authorization") != f"Bearer {self.token}":
            raise ApiFailure(401, "Unauthorized", "Unauthorized")
        if resource not in RESOURCES:
            raise ApiFailure(404, "NotFound", "the server could not find the requested resource")
        self._fault(verb, resource, commit=False)
        if verb in ("create", "delete", "deletecollection") and self.write_limit is not None:
            rate, burst = self.write_limit
            now = time.monotonic()
            self._write_tokens = min(burst, self._write_tokens + (now - self._write_stamp) * rate)
            self._write_stamp = now
            if self._write_tokens < 1:
                raise ApiFailure(429, "TooManyRequests", "Too many requests, please try again later.",
                                 {"Retry-After": "1"})
            self._write_tokens -= 1

    def _fault(self, verb: str, resource: str, *, commit: bool) -> None:
        for fault in self.faults:
            if (fault.times > 0 and fault.commit == commit and fault.verb in (verb, "*")
                    and fault.resource in (resource, "*")):
                fault.times -= 1
                headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
                reason = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError",
                          503: "ServiceUnavailable", 504: "Timeout", 403: "Forbidden"}.get(fault.status, "Unknown")
                raise ApiFailure(fault.status, reason, fault.message, headers)

    async def _collection(self, request: Request) -> Response:
        ns, resource = request.path_params["ns"], request.path_params["resource"]
        q = request.query_params
        if request.method == "POST":
            verb = "create"
        elif request.method == "DELETE":
            verb = "deletecollection"
        else:
            verb = "watch" if q.get("watch") in ("true", "1") else "list"
        try:
            if self.latency:
                await asyncio.sleep(self.latency)
            self._check(request, verb, resource)
            if verb == "create":
                body = await self._json(request)
                self._writes_in_flight += 1
                self.max_concurrent_writes = max(self.max_concurrent_writes, self._writes_in_flight)
                try:
                    await asyncio.sleep(0)  # let concurrent writes overlap, as they would on a real server
                    obj = self._create(ns, resource, body)
                finally:
                    self._writes_in_flight -= 1
                self._fault(verb, resource, commit=True)
                self.requests[(verb, resource, 201)] += 1
                return JSONResponse(obj, status_code=201)
            if verb == "deletecollection":
                selector = q.get("labelSelector")
                items = []
                for (ons, name), obj in list(self.objects[resource].items()):
                    if ons == ns and selector_matches(selector, (obj["metadata"].get("labels") or {})):
                        items.append(self._delete(ns, resource, name, {}))
                self.requests[(verb, resource, 200)] += 1
                return JSONResponse({"kind": f"{RESOURCES[resource]}List", "apiVersion": "v1",
                                     "metadata": {"resourceVersion": str(self.rv)}, "items": items})
            if verb == "list":
                selector = q.get("labelSelector")
                items = [copy.deepcopy(o) for (ons, _), o in sorted(self.objects[resource].items())
                         if ons == ns and selector_matches(selector, o["metadata"].get("labels") or {})]
                self.requests[(verb, resource, 200)] += 1
                return JSONResponse({"kind": f"{RESOURCES[resource]}List", "apiVersion": "v1",
                                     "metadata": {"resourceVersion": str(self.rv)}, "items": items})
            selector_matches(q.get("labelSelector"), {})  # a malformed selector is a 400 before streaming
            self.requests[(verb, resource, 200)] += 1
            return StreamingResponse(self._watch(ns, resource, q.get("labelSelector"), q.get("resourceVersion", ""),
                                                 float(q.get("timeoutSeconds") or 1800),
                                                 q.get("allowWatchBookmarks") == "true"),
                                     media_type="application/json")
        except ApiFailure as failure:
            self.requests[(verb, resource, failure.code)] += 1
            return failure.response()

    async def _item(self, request: Request) -> Response:
        ns, resource, name = request.path_params["ns"], request.path_params["resource"], request.path_params["name"]
        verb = "get" if request.method == "GET" else "delete"
        try:
            if self.latency:
                await asyncio.sleep(self.latency)
            self._check(request, verb, resource)
            if verb == "get":
                obj = self.objects[resource].get((ns, name))
                if obj is None:
                    raise ApiFailure(404, "NotFound", f'{resource} "{name}" not found')
                self.requests[(verb, resource, 200)] += 1
                return JSONResponse(copy.deepcopy(obj))
            options = await self._json(request) if (await request.body()) else {}
            obj = self._delete(ns, resource, name, options)
            self.requests[(verb, resource, 200)] += 1
            return JSONResponse(obj)
        except ApiFailure as failure:
            self.requests[(verb, resource, failure.code)] += 1
            return failure.response()

    @staticmethod
    async def _json(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise ApiFailure(400, "BadRequest", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiFailure(400, "BadRequest", "the body is not an object")
        return body

    # --- storage --------------------------------------------------------------------------------

    def _bump(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        snapshot = copy.deepcopy(obj)
        self.history.append((self.rv, resource, kind, snapshot))
        while len(self.history) > self.history_limit:
            dropped = self.history.popleft()
            self.oldest_rv = dropped[0] + 1
        ns = obj["metadata"]["namespace"]
        labels = obj["metadata"].get("labels") or {}
        for wns, wres, selector, queue in list(self._watchers):
            if wns == ns and wres == resource and selector_matches(selector, labels):
                queue.put_nowait({"type": kind, "object": snapshot})

    def _create(self, ns: str, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.get("metadata") or {}
        name = meta.get("name")
        if not name:
            raise ApiFailure(422, "Invalid", f"{resource} is invalid: metadata.name: Required value")
        if not DNS_SUBDOMAIN.match(name):
            raise ApiFailure(422, "Invalid", f'{resource} "{name}" is invalid: metadata.name: Invalid value')
        if meta.get("namespace", ns) != ns:
            raise ApiFailure(400, "BadRequest", "the namespace of the object does not match the request")
        if body.get("kind") not in (None, RESOURCES[resource]):
            raise ApiFailure(400, "BadRequest", f"kind {body.get('kind')} does not belong at {resource}")
        for key, value in (meta.get("labels") or {}).items():
            if not isinstance(value, str) or not LABEL_VALUE.match(value):
                raise ApiFailure(422, "Invalid", f'{resource} "{name}" is invalid: metadata.labels: {key}')
        if (ns, name) in self.objects[resource]:
            raise ApiFailure(409, "AlreadyExists", f'{resource} "{name}" already exists')
        if resource == "pods":
            self._admit_pod(ns, name, body)
        obj = copy.deepcopy(body)
        obj["apiVersion"], obj["kind"] = "v1", RESOURCES[resource]
        obj["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339())
        if resource == "pods":
            obj["status"] = {"phase": "Pending", "qosClass": "Burstable",
                             "conditions": [{"type": "PodScheduled", "status": "True"}], "hostIP": "127.0.0.1"}
        self.objects[resource][(ns, name)] = obj
        self._bump(resource, "ADDED", obj)
        if resource == "secrets":
            self._collect_orphan_later(ns, name, obj)
        if resource == "pods" and self.kubelet != "none":
            run = RunningPod()
            self.running[(ns, name)] = run
            run.task = asyncio.get_running_loop().create_task(self._kubelet(ns, name, obj["metadata"]["uid"]))
        return copy.deepcopy(obj)

    def _admit_pod(self, ns: str, name: str, body: dict[str, Any]) -> None:
        spec = body.get("spec") or {}
        containers = spec.get("containers") or []
        if not containers or any(not c.get("name") or not c.get("image") for c in containers):
            raise ApiFailure(422, "Invalid", f'Pod "{name}" is invalid: spec.containers: a name and image are required')
        runtime_class = spec.get("runtimeClassName")
        if runtime_class is not None and runtime_class not in self.runtime_classes:
            raise ApiFailure(403, "Forbidden",
                             f'pods "{name}" is forbidden: pod rejected: RuntimeClass "{runtime_class}" not found')
        if self.enforce_restricted:
            violations = pss_restricted_violations(body)
            if violations:
                raise ApiFailure(403, "Forbidden", f'pods "{name}" is forbidden: violates PodSecurity '
                                 f'"restricted:latest": {", ".join(violations)}')
        if self.pod_quota is not None:
            used = sum(1 for (ons, _) in self.objects["pods"] if ons == ns)
            if used >= self.pod_quota:
                raise ApiFailure(403, "Forbidden", f'pods "{name}" is forbidden: exceeded quota: pods, '
                                 f"requested: pods=1, used: pods={used}, limited: pods={self.pod_quota}")

    def _delete(self, ns: str, resource: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
        obj = self.objects[resource].get((ns, name))
        if obj is None:
            raise ApiFailure(404, "NotFound", f'{resource} "{name}" not found')
        want_uid = ((options.get("preconditions") or {}).get("uid"))
        if want_uid and want_uid != obj["metadata"]["uid"]:
            raise ApiFailure(409, "Conflict", f"Precondition failed: UID in precondition: {want_uid}, "
                             f"UID in object meta: {obj['metadata']['uid']}")
        if resource == "pods" and (ns, name) in self.running:
            if not obj["metadata"].get("deletionTimestamp"):
                grace = options.get("gracePeriodSeconds")
                if grace is None:
                    grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                obj["metadata"]["deletionTimestamp"] = now_rfc3339()
                obj["metadata"]["deletionGracePeriodSeconds"] = grace
                self._bump(resource, "MODIFIED", obj)
                asyncio.get_running_loop().create_task(self._terminate(ns, name, float(grace)))
            return copy.deepcopy(obj)
        self._remove(ns, resource, name)
        return copy.deepcopy(obj)

    def _remove(self, ns: str, resource: str, name: str) -> None:
        obj = self.objects[resource].pop((ns, name), None)
        if obj is None:
            return
        self._bump(resource, "DELETED", obj)
        # The garbage collector: dependents whose owner just went go too.
        uid = obj["metadata"]["uid"]
        for other in ("pods", "secrets"):
            for (ons, oname), dep in list(self.objects[other].items()):
                refs = dep["metadata"].get("ownerReferences") or []
                if ons == ns and refs and all(r.get("uid") == uid for r in refs):
                    self._remove(ns, other, oname)

    def _collect_orphan_later(self, ns: str, name: str, obj: dict[str, Any]) -> None:
        refs = obj["metadata"].get("ownerReferences") or []
        if not refs:
            return
        pod_uids = {o["metadata"]["uid"] for (ons, _), o in self.objects["pods"].items() if ons == ns}
        if not any(r.get("uid") in pod_uids for r in refs):
            uid = obj["metadata"]["uid"]

            async def collect() -> None:
                await asyncio.sleep(0.05)
                current = self.objects["secrets"].get((ns, name))
                if current is not None and current["metadata"]["uid"] == uid:
                    self._remove(ns, "secrets", name)
            asyncio.get_running_loop().create_task(collect())

    # --- watch ----------------------------------------------------------------------------------

    async def _watch(self, ns: str, resource: str, selector: str | None, since: str, timeout: float,
                     bookmarks: bool) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        entry = (ns, resource, selector, queue)
        initial: list[dict[str, Any]] = []
        if since in ("", "0"):
            initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for (ons, _), o in
                       sorted(self.objects[resource].items())
                       if ons == ns and selector_matches(selector, o["metadata"].get("labels") or {})]
        else:
            try:
                start = int(since)
            except ValueError:
                start = -1
            if start < self.oldest_rv - 1 or start < 0:
                yield (json.dumps({"type": "ERROR", "object": status_body(
                    410, "Expired", f"too old resource version: {since} ({self.oldest_rv - 1})")}) + "\n").encode()
                return
            initial = [{"type": kind, "object": copy.deepcopy(obj)} for rv, res, kind, obj in self.history
                       if rv > start and res == resource and obj["metadata"]["namespace"] == ns
                       and selector_matches(selector, obj["metadata"].get("labels") or {})]
        self._watchers.add(entry)
        try:
            for event in initial:
                yield (json.dumps(event) + "\n").encode()
            deadline = time.monotonic() + timeout
            while not self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                try:
                    event = await asyncio.wait_for(queue.get(), min(remaining, self.bookmark_period))
                except TimeoutError:
                    if bookmarks:
                        yield (json.dumps({"type": "BOOKMARK", "object": {
                            "kind": RESOURCES[resource], "apiVersion": "v1",
                            "metadata": {"resourceVersion": str(self.rv)}}}) + "\n").encode()
                    continue
                if event is None:
                    return
                yield (json.dumps(event) + "\n").encode()
        finally:
            self._watchers.discard(entry)

    def _end_watches(self) -> None:
        for *_, queue in list(self._watchers):
            queue.put_nowait(None)

    # --- kubelet --------------------------------------------------------------------------------

    def _update_pod(self, ns: str, name: str, uid: str, **status: Any) -> dict[str, Any] | None:
        obj = self.objects["pods"].get((ns, name))
        if obj is None or obj["metadata"]["uid"] != uid:
            return None
        obj["status"].update(status)
        self._bump("pods", "MODIFIED", obj)
        return obj

    def _conditions(self, ready: bool) -> list[dict[str, str]]:
        flag = "True" if ready else "False"
        return [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": flag}, {"type": "Ready", "status": flag}]

    async def _kubelet(self, ns: str, name: str, uid: str) -> None:
        run = self.running[(ns, name)]
        pod = self.objects["pods"][(ns, name)]
        spec = pod["spec"]
        container = spec["containers"][0]
        # Wait for every Secret the pod mounts (the kubelet retries the mount until it exists).
        wanted = [v["secret"]["secretName"] for v in spec.get("volumes") or [] if "secret" in v
                  and not v["secret"].get("optional")]
        self._update_pod(ns, name, uid, containerStatuses=[{
            "name": container["name"], "ready": False, "restartCount": 0, "image": container["image"],
            "state": {"waiting": {"reason": "ContainerCreating"}}}])
        while any((ns, s) not in self.objects["secrets"] for s in wanted):
            if self.objects["pods"].get((ns, name), {}).get("metadata", {}).get("deletionTimestamp"):
                return
            await asyncio.sleep(0.01)
        try:
            await self._start_container(ns, name, pod, run)
        except Exception as exc:  # noqa: BLE001 - reported on the pod like a failed container start
            run.log.append(f"start failed: {exc!r}")
            self._container_exited(ns, name, 128, "StartError")
            return
        self._update_pod(ns, name, uid, phase="Running", podIP=run.ip, podIPs=[{"ip": run.ip}],
                         startTime=now_rfc3339(), conditions=self._conditions(False),
                         containerStatuses=[{"name": container["name"], "ready": False, "restartCount": 0,
                                             "image": container["image"], "started": True,
                                             "state": {"running": {"startedAt": now_rfc3339()}}}])
        await self._probe(ns, name, uid, pod, run)

    async def _start_container(self, ns: str, name: str, pod: dict[str, Any], run: RunningPod) -> None:
        spec = pod["spec"]
        container = spec["containers"][0]
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        port = next(iter(ports.values()))
        run.ip = self._take_ip(port)
        run.root = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._tmp))
        mounts: dict[str, Path] = {}
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for mount in container.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            host = run.root / mount["name"]
            host.mkdir()
            if "secret" in volume:
                secret = self.objects["secrets"][(ns, volume["secret"]["secretName"])]
                for key, value in (secret.get("data") or {}).items():
                    path = host / key
                    path.write_bytes(base64.b64decode(value))
                    path.chmod(volume["secret"].get("defaultMode", 0o644))
            mounts[mount["mountPath"]] = host

        def rewrite(word: str) -> str:
            if word == "0.0.0.0":  # "all addresses" of the pod's own network namespace
                return str(run.ip)
            for path, host in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
                if word == path or word.startswith(path + "/"):
                    return str(host) + word[len(path):]
            return word

        if self.kubelet == "stub":
            secret_files = [p for p in mounts.values() if any(p.iterdir())]
            secret = next((f.read_text() for d in secret_files for f in d.iterdir()), "")
            run.stub = await asyncio.start_server(lambda r, w: self._stub_agent(r, w, secret), run.ip, port)
            return
        argv = [rewrite(w) for w in [*(container.get("command") or []), *(container.get("args") or [])]]
        argv[0] = shutil.which(argv[0]) or argv[0]
        env = {"PATH": os.environ.get("PATH", ""), **self.agent_env}
        for item in container.get("env") or []:
            env[item["name"]] = rewrite(item.get("value", ""))
        run.process = await asyncio.create_subprocess_exec(
            *argv, env=env, cwd=str(mounts.get("/workspace", run.root)), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        asyncio.get_running_loop().create_task(self._reap(ns, name, pod["metadata"]["uid"], run))

    def _take_ip(self, port: int) -> str:
        # A pod owns its address; a process from outside (another test) holding ip:port is skipped.
        for ip in list(self._free_ips):
            with socket.socket() as probe:
                try:
                    probe.bind((ip, port))
                except OSError:
                    self.agent_port_conflicts += 1
                    continue
            self._free_ips.remove(ip)
            return ip
        raise RuntimeError("no free pod address")

    async def _stub_agent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str) -> None:
        """Minimal agent: /healthz answers 200; anything else needs the pod's secret as a bearer token."""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else "/"
                fields = (line.partition(":") for line in lines[1:] if line)
                headers = {k.strip().lower(): v.strip() for k, _, v in fields}
                if urlsplit(path).path == "/healthz":
                    status, body = "200 OK", b'{"status":"ok"}'
                elif secret and headers.get("authorization") == f"Bearer {secret}":
                    status, body = "200 OK", b'{"stub":true}'
                else:
                    status, body = "401 Unauthorized", b'{"detail":"unauthorized"}'
                writer.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
                             f"\r\n\r\n".encode() + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _probe(self, ns: str, name: str, uid: str, pod: dict[str, Any], run: RunningPod) -> None:
        container = pod["spec"]["containers"][0]
        probe = container.get("readinessProbe")
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        ready = False
        if probe is None:
            self._update_pod(ns, name, uid, conditions=self._conditions(True))
            return
        get = probe["httpGet"]
        port = get["port"] if isinstance(get["port"], int) else ports[get["port"]]
        url = f"http://{run.ip}:{port}{get.get('path', '/')}"
        failures = 0
        async with httpx.AsyncClient(timeout=probe.get("timeoutSeconds", 1), trust_env=False) as client:
            while True:
                current = self.objects["pods"].get((ns, name))
                if current is None or current["metadata"]["uid"] != uid or current["metadata"].get(
                        "deletionTimestamp") or current["status"].get("phase") in ("Failed", "Succeeded"):
                    return
                try:
                    ok = (await client.get(url)).status_code < 400
                except httpx.HTTPError:
                    ok = False
                failures = 0 if ok else failures + 1
                if ok and not ready:
                    ready = True
                    self._set_ready(ns, name, uid, True)
                elif ready and failures >= probe.get("failureThreshold", 3):
                    ready = False
                    self._set_ready(ns, name, uid, False)
                # Probe quickly until Ready, then at a gentler pace (the period is scaled down for tests).
                await asyncio.sleep(self.probe_period if not ready else self.probe_period * 10)

    def _set_ready(self, ns: str, name: str, uid: str, ready: bool) -> None:
        obj = self.objects["pods"].get((ns, name))
        if obj is None:
            return
        statuses = copy.deepcopy(obj["status"].get("containerStatuses") or [])
        for cs in statuses:
            cs["ready"] = ready
        self._update_pod(ns, name, uid, conditions=self._conditions(ready), containerStatuses=statuses)

    async def _reap(self, ns: str, name: str, uid: str, run: RunningPod) -> None:
        assert run.process is not None
        stderr = await run.process.stderr.read() if run.process.stderr else b""
        code = await run.process.wait()
        run.log.append(stderr.decode(errors="replace")[-4000:])
        obj = self.objects["pods"].get((ns, name))
        if obj is not None and obj["metadata"]["uid"] == uid and not obj["metadata"].get("deletionTimestamp"):
            self._container_exited(ns, name, code, "Completed" if code == 0 else "Error")

    def _container_exited(self, ns: str, name: str, code: int, reason: str) -> None:
        obj = self.objects["pods"].get((ns, name))
        if obj is None:
            return
        container = obj["spec"]["containers"][0]
        self._update_pod(ns, name, obj["metadata"]["uid"], phase="Succeeded" if code == 0 else "Failed",
                         conditions=self._conditions(False),
                         containerStatuses=[{"name": container["name"], "ready": False, "restartCount": 0,
                                             "image": container["image"],
                                             "state": {"terminated": {"exitCode": code, "reason": reason}}}])

    async def _terminate(self, ns: str, name: str, grace: float) -> None:
        run = self.running.pop((ns, name), None)
        if run is not None:
            await self._stop_container(run, grace)
        self._remove(ns, "pods", name)

    async def _stop_container(self, run: RunningPod, grace: float) -> None:
        if run.task is not None and not run.task.done():
            run.task.cancel()
            with contextlib.suppress(BaseException):
                await run.task
        if run.process is not None and run.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(run.process.wait(), max(grace, 0.1))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.process.pid, signal.SIGKILL)
                await run.process.wait()
        if run.stub is not None:
            run.stub.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run.stub.wait_closed(), 1)
        if run.ip is not None:
            self._free_ips.append(run.ip)
        if run.root is not None:
            shutil.rmtree(run.root, ignore_errors=True)

    async def _shutdown_pods(self) -> None:
        runs = list(self.running.values())
        self.running.clear()
        await asyncio.gather(*(self._stop_container(run, 1.0) for run in runs), return_exceptions=True)

    def logs(self, namespace: str, name: str) -> list[str]:
        run = self.running.get((namespace, name))
        return list(run.log) if run else []
