"""A stand-in kubelet (and scheduler) for one node, against the real API server.

The real API server stores pods; nothing runs them. This plays the two missing
parts for the pods of one namespace, through the API as they would:

- scheduler: binds every pod without a node to the Node it registered
  (`pods/binding`);
- kubelet: waits until every Secret the pod mounts exists (as the kubelet retries
  the mount), gives the pod its own loopback address 127.0.0.X as its IP, starts
  the container, reports `Running` with the IP (`pods/status`), runs the pod's
  readiness probe and reports `Ready`, reports `Failed`/`Succeeded` with the exit
  code when the process exits (restartPolicy Never), and, once a pod is being
  deleted, stops the container and finishes the deletion (a DELETE with grace 0
  and the pod's uid as precondition), as the real kubelet does.

The container is, in mode `agent`, the pod's own command line (`sandpool agent
...`) as a real process: mount paths rewritten to directories holding the
volumes' contents (the Secret's data written as files), `0.0.0.0` rewritten to
the pod's address, the way a network namespace scopes it. In mode `stub` it is
a minimal health endpoint that also checks the pod's secret. In mode `none`
nothing is bound or run: pods stay Pending.

It runs on its own thread and event loop, so sync and async tests use it alike,
and it survives an API-server restart (it lists and watches again).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from realapi import RealCluster

PROBE_PERIOD_SECONDS = 0.05  # until Ready; then ten times that (the pod's own period scaled down)


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Container:
    uid: str
    name: str = "agent"
    image: str = ""
    ip: str | None = None
    root: Path | None = None
    process: asyncio.subprocess.Process | None = None
    stub: asyncio.AbstractServer | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    log: str = ""
    stopping: bool = False
    terminating: bool = False


class StandInKubelet:
    def __init__(self, cluster: RealCluster, namespace: str, *, mode: str = "stub", node: str = "stand-in-node",
                 agent_env: dict[str, str] | None = None) -> None:
        assert mode in ("stub", "agent", "none")
        self.cluster = cluster
        self.namespace = namespace
        self.mode = mode
        self.node = node
        self.agent_env = agent_env or {}
        self.containers: dict[str, Container] = {}  # pod name -> its running container
        self.finished: dict[str, str] = {}  # pod name -> the stderr of its last container
        self._ips = [f"127.0.{n}.{h}" for n in (41, 42) for h in range(2, 255)]
        self._tmp = Path(tempfile.mkdtemp(prefix="stand-in-kubelet-"))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._http: httpx.AsyncClient | None = None

    # --- lifecycle (test thread) ----------------------------------------------------------

    def start(self) -> StandInKubelet:
        if self.mode == "none":
            return self
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._stop = asyncio.Event()
            self._loop.call_soon(ready.set)
            try:
                self._loop.run_until_complete(self._main())
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name=f"stand-in-kubelet-{self.namespace}", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def call(self, fn: Any, *args: Any) -> Any:
        assert self._loop is not None

        async def run() -> Any:
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    # --- test controls --------------------------------------------------------------------

    def kill_container(self, name: str, sig: int = signal.SIGKILL) -> None:
        """The container's process dies (an OOM kill, a crash): the pod turns Failed."""
        def kill() -> None:
            container = self.containers[name]
            if container.process is not None:
                os.killpg(container.process.pid, sig)
            elif container.stub is not None:
                container.stub.close()
                self._spawn(container, self._exited(name, container, 137))
        self.call(kill)

    def logs(self, name: str) -> str:
        container = self.containers.get(name)
        return container.log if container is not None else self.finished.get(name, "")

    # --- the loop -------------------------------------------------------------------------

    @property
    def _base(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    async def _main(self) -> None:
        assert self._stop is not None
        self._http = httpx.AsyncClient(base_url=self.cluster.url, verify=self.cluster.ssl_context(),
                                       timeout=httpx.Timeout(10, read=90), trust_env=False,
                                       headers={"Authorization": f"Bearer {self.cluster.admin_token}"})
        watcher = asyncio.create_task(self._watch_forever())
        try:
            await self._stop.wait()
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher
            await asyncio.gather(*(self._stop_container(c, grace=1.0) for c in list(self.containers.values())),
                                 return_exceptions=True)
            await self._http.aclose()

    async def _watch_forever(self) -> None:
        assert self._http is not None
        await self._register_node()
        while True:
            try:
                listed = (await self._http.get(self._base)).raise_for_status().json()
                for pod in listed["items"]:
                    await self._on_pod(pod, deleted=False)
                version = listed["metadata"]["resourceVersion"]
                params = {"watch": "1", "resourceVersion": version, "timeoutSeconds": "60",
                          "allowWatchBookmarks": "true"}
                async with self._http.stream("GET", self._base, params=params) as stream:
                    async for line in stream.aiter_lines():
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        if event["type"] == "ERROR":
                            break  # 410 and friends: list again
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            await self._on_pod(event["object"], deleted=event["type"] == "DELETED")
            except (httpx.HTTPError, ValueError, KeyError):
                await asyncio.sleep(0.2)  # an API-server restart: list and watch again

    async def _register_node(self) -> None:
        assert self._http is not None
        while True:
            try:
                node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node},
                        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}
                response = await self._http.post("/api/v1/nodes", json=node)
                if response.status_code in (201, 409):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)

    async def _on_pod(self, pod: dict[str, Any], *, deleted: bool) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        name, uid = meta["name"], meta["uid"]
        container = self.containers.get(name)
        if container is not None and container.uid != uid:  # a namesake: the old one is gone
            await self._stop_container(container, grace=0)
            container = None
        if deleted:
            if container is not None:
                await self._stop_container(container, grace=0)
            return
        if meta.get("deletionTimestamp"):
            if spec.get("nodeName") == self.node and (container is None or not container.terminating):
                if container is not None:
                    container.terminating = True
                grace = float(meta.get("deletionGracePeriodSeconds") or 0)
                self._spawn(container, self._terminate(name, uid, container, grace))
            return
        if not spec.get("nodeName"):
            await self._bind(name)
            return
        if spec["nodeName"] == self.node and container is None and pod["status"].get("phase") == "Pending":
            main = spec["containers"][0]
            container = self.containers[name] = Container(uid=uid, name=main["name"], image=main["image"])
            self._spawn(container, self._run(pod, container))

    def _spawn(self, container: Container | None, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        if container is not None:
            container.tasks.append(task)

    async def _bind(self, name: str) -> None:
        assert self._http is not None
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": self.node}}
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post(f"{self._base}/{name}/binding", json=binding)

    async def _status(self, name: str, uid: str, status: dict[str, Any]) -> bool:
        assert self._http is not None
        patch = {"metadata": {"uid": uid}, "status": status}
        try:
            response = await self._http.patch(f"{self._base}/{name}/status", json=patch,
                                              headers={"Content-Type": "application/merge-patch+json"})
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    @staticmethod
    def _conditions(ready: bool) -> list[dict[str, str]]:
        flag = "True" if ready else "False"
        now = now_rfc3339()
        return [{"type": t, "status": s, "lastTransitionTime": now} for t, s in
                (("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", flag), ("Ready", flag))]

    # --- one pod --------------------------------------------------------------------------

    async def _run(self, pod: dict[str, Any], container: Container) -> None:
        assert self._http is not None
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        spec = pod["spec"]
        main = spec["containers"][0]
        secrets: dict[str, dict[str, Any]] = {}
        wanted = [v["secret"]["secretName"] for v in spec.get("volumes") or [] if "secret" in v]
        while len(secrets) < len(wanted):  # the kubelet retries a mount until its Secret exists
            for secret_name in wanted:
                if secret_name not in secrets and not container.stopping:
                    with contextlib.suppress(httpx.HTTPError):
                        response = await self._http.get(f"/api/v1/namespaces/{self.namespace}/secrets/{secret_name}")
                        if response.status_code == 200:
                            secrets[secret_name] = response.json()
            if container.stopping:
                return
            if len(secrets) < len(wanted):
                await asyncio.sleep(0.02)
        try:
            await self._start(pod, container, secrets)
        except Exception as exc:  # noqa: BLE001 - reported on the pod like a failed container start
            container.log = f"start failed: {exc!r}"
            await self._exited(name, container, 128, reason="StartError")
            return
        started = now_rfc3339()
        await self._status(name, uid, {
            "phase": "Running", "hostIP": "127.0.0.1", "podIP": container.ip, "podIPs": [{"ip": container.ip}],
            "startTime": started, "conditions": self._conditions(False),
            "containerStatuses": [{"name": main["name"], "image": main["image"], "imageID": "",
                                   "ready": False, "restartCount": 0, "started": True,
                                   "state": {"running": {"startedAt": started}}}]})
        await self._probe(pod, container)

    async def _start(self, pod: dict[str, Any], container: Container, secrets: dict[str, dict[str, Any]]) -> None:
        spec = pod["spec"]
        main = spec["containers"][0]
        port = next(p["containerPort"] for p in main.get("ports") or [])
        container.ip = self._take_ip(port)
        container.root = Path(tempfile.mkdtemp(prefix=f"{pod['metadata']['name']}-", dir=self._tmp))
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        mounts: dict[str, Path] = {}
        secret_value = ""
        for mount in main.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            host = container.root / mount["name"]
            host.mkdir()
            if "secret" in volume:
                data = secrets[volume["secret"]["secretName"]].get("data") or {}
                for key, value in data.items():
                    (host / key).write_bytes(base64.b64decode(value))
                    (host / key).chmod(0o600)
                    secret_value = base64.b64decode(value).decode()
            mounts[mount["mountPath"]] = host
        if self.mode == "stub":
            container.stub = await asyncio.start_server(
                lambda r, w: self._stub_agent(r, w, secret_value), container.ip, port)
            return

        def rewrite(word: str) -> str:
            if word == "0.0.0.0":  # "every address" of the pod's own network namespace
                return str(container.ip)
            for path, host in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
                if word == path or word.startswith(path + "/"):
                    return str(host) + word[len(path):]
            return word

        argv = [rewrite(w) for w in [*(main.get("command") or []), *(main.get("args") or [])]]
        if argv[0] == "sandpool" and not shutil.which("sandpool"):
            argv[:1] = [sys.executable, "-m", "sandpool"]  # the image's `sandpool` is this environment's
        env = {"PATH": os.environ.get("PATH", ""), **self.agent_env}
        for item in main.get("env") or []:
            env[item["name"]] = rewrite(item.get("value", ""))
        container.process = await asyncio.create_subprocess_exec(
            *argv, env=env, cwd=str(mounts.get("/workspace", container.root)), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        self._spawn(container, self._reap(pod["metadata"]["name"], container))

    def _take_ip(self, port: int) -> str:
        # A pod owns its address; one another test still holds at this port is skipped.
        for ip in list(self._ips):
            with socket.socket() as probe:
                try:
                    probe.bind((ip, port))
                except OSError:
                    continue
            self._ips.remove(ip)
            return ip
        raise RuntimeError("no free pod address")

    async def _stub_agent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str) -> None:
        """/healthz answers 200; anything else needs the pod's secret as a bearer token."""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                target = lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else "/"
                fields = (line.partition(":") for line in lines[1:] if line)
                headers = {k.strip().lower(): v.strip() for k, _, v in fields}
                if urlsplit(target).path == "/healthz":
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

    async def _probe(self, pod: dict[str, Any], container: Container) -> None:
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        main = pod["spec"]["containers"][0]
        probe = main.get("readinessProbe")
        if probe is None:
            await self._status(name, uid, {"conditions": self._conditions(True)})
            return
        ports = {p.get("name"): p["containerPort"] for p in main.get("ports") or []}
        get = probe["httpGet"]
        port = get["port"] if isinstance(get["port"], int) else ports[get["port"]]
        url = f"http://{container.ip}:{port}{get.get('path', '/')}"
        ready, failures = False, 0
        async with httpx.AsyncClient(timeout=probe.get("timeoutSeconds", 1), trust_env=False) as client:
            while not container.stopping:
                try:
                    ok = (await client.get(url)).status_code < 400
                except httpx.HTTPError:
                    ok = False
                failures = 0 if ok else failures + 1
                if ok and not ready:
                    ready = await self._set_ready(pod, container, True)
                elif ready and failures >= probe.get("failureThreshold", 3):
                    ready = not await self._set_ready(pod, container, False)
                await asyncio.sleep(PROBE_PERIOD_SECONDS if not ready else PROBE_PERIOD_SECONDS * 10)

    async def _set_ready(self, pod: dict[str, Any], container: Container, ready: bool) -> bool:
        main = pod["spec"]["containers"][0]
        return await self._status(pod["metadata"]["name"], container.uid, {
            "conditions": self._conditions(ready),
            "containerStatuses": [{"name": main["name"], "image": main["image"], "imageID": "", "ready": ready,
                                   "restartCount": 0, "started": True,
                                   "state": {"running": {"startedAt": now_rfc3339()}}}]})

    async def _reap(self, name: str, container: Container) -> None:
        assert container.process is not None and container.process.stderr is not None
        stderr = await container.process.stderr.read()
        code = await container.process.wait()
        container.log = stderr.decode(errors="replace")[-4000:]
        if not container.stopping:
            await self._exited(name, container, code)

    async def _exited(self, name: str, container: Container, code: int, *, reason: str | None = None) -> None:
        """restartPolicy Never: the pod is finished, Succeeded or Failed by the exit code."""
        container.stopping = True
        reason = reason or ("Completed" if code == 0 else "Error")
        await self._status(name, container.uid, {
            "phase": "Succeeded" if code == 0 else "Failed", "conditions": self._conditions(False),
            "containerStatuses": [{"name": container.name, "image": container.image, "imageID": "", "ready": False,
                                   "restartCount": 0,
                                   "started": False,
                                   "state": {"terminated": {"exitCode": code, "reason": reason}}}]})
        await self._stop_container(container, grace=0, forget=False)

    async def _terminate(self, name: str, uid: str, container: Container | None, grace: float) -> None:
        """A pod being deleted: stop its container within the grace period, then finish the delete."""
        assert self._http is not None
        if container is not None:
            await self._stop_container(container, grace=grace)
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        with contextlib.suppress(httpx.HTTPError):
            await self._http.request("DELETE", f"{self._base}/{name}", json=body)

    async def _stop_container(self, container: Container, *, grace: float, forget: bool = True) -> None:
        container.stopping = True
        if container.process is not None and container.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(container.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(container.process.wait(), max(grace, 0.5))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(container.process.pid, signal.SIGKILL)
                await container.process.wait()
        if container.stub is not None:
            container.stub.close()
            container.stub = None
        if forget:
            for name, known in list(self.containers.items()):
                if known is container:
                    del self.containers[name]
                    self.finished[name] = container.log
            current = asyncio.current_task()
            for task in container.tasks:
                if task is not current and not task.done():
                    task.cancel()
            if container.ip is not None:
                self._ips.append(container.ip)
                container.ip = None
            if container.root is not None:
                shutil.rmtree(container.root, ignore_errors=True)
                container.root = None
