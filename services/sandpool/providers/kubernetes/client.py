"""The one module that imports `kubernetes`: every API call the provider makes.

The official client is synchronous. Each call runs on a small thread pool of
our own (never the event loop, never the loop's default executor), with an
explicit `_request_timeout`, inside a bounded retry loop that sleeps on the
event loop, not in a thread:

- 429 (API Priority and Fairness, or a proxy's throttling): wait what
  `Retry-After` says (capped), else back off; retry.
- 500/502/503/504 and connection errors or timeouts: exponential backoff with
  jitter; retry.
- 404, 409, 410 are answers, not failures: `NotFound`, `Conflict`, `Gone`.
- anything else (400, 401, 403, 422): `ApiError`, not retried.

Bodies go out as plain dicts and come back as parsed JSON (`_preload_content=False`):
the provider reads a handful of fields and needs no model classes, and no
client-version-specific model behaviour leaks past this module.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from sandpool.providers.kubernetes.settings import KubernetesProviderSettings

log = logging.getLogger("sandpool.providers.kubernetes")

RETRY_AFTER_CAP_SECONDS = 30.0
CONNECT_TIMEOUT_SECONDS = 5.0
TRANSIENT_STATUSES = frozenset({0, 429, 500, 502, 503, 504})


class ApiError(Exception):
    """A Kubernetes API call failed. `transient` ones may succeed if tried again later."""

    def __init__(self, operation: str, status: int, message: str, *, transient: bool) -> None:
        super().__init__(f"{operation}: {status or 'no answer'} {message}".strip())
        self.operation = operation
        self.status = status
        self.transient = transient


class NotFound(ApiError):
    pass


class Conflict(ApiError):
    pass


class Gone(ApiError):
    """The resourceVersion a watch asked for is older than the server keeps: re-list."""


@dataclass
class ApiStats:
    """Counters for `describe()` and the turnover measurement; closed set of keys."""

    calls: int = 0
    retries: int = 0
    throttled: int = 0  # 429 answers seen
    server_errors: int = 0  # 5xx answers seen
    connection_errors: int = 0
    conflicts: int = 0
    by_operation: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"calls": self.calls, "retries": self.retries, "throttled": self.throttled,
                "server_errors": self.server_errors, "connection_errors": self.connection_errors,
                "conflicts": self.conflicts, "by_operation": dict(self.by_operation)}


def _retry_after(headers: Any) -> float | None:
    if not headers:
        return None
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return max(0.0, min(float(value), RETRY_AFTER_CAP_SECONDS)) if value is not None else None
    except (TypeError, ValueError):
        return None  # an HTTP-date: fall back to our own backoff


def _message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "")
        return str(body.get("message") or exc.reason or "")
    except (ValueError, AttributeError):
        return str(exc.reason or "")


class KubeApi:
    """Core/v1 pods and secrets in one namespace, through the official client."""

    def __init__(self, settings: KubernetesProviderSettings) -> None:
        self.settings = settings
        self.namespace = settings.kube_namespace
        self.stats = ApiStats()
        self.server = ""
        self._timeout = (min(CONNECT_TIMEOUT_SECONDS, settings.kube_api_timeout_seconds),
                         settings.kube_api_timeout_seconds)
        self._executor: ThreadPoolExecutor | None = None
        self._api_client: Any = None
        self._core: Any = None
        self._watch_lock = threading.Lock()
        self._watch_resp: Any = None
        self._watch_stopped = False

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=self.settings.kube_max_inflight,
                                            thread_name_prefix="sandpool-kube")
        loop = asyncio.get_running_loop()
        configuration = await loop.run_in_executor(self._executor, self._load_configuration)
        self.server = str(configuration.host)
        self._api_client = kubernetes.client.ApiClient(configuration)
        self._api_client.user_agent = "sandpool-kubernetes-provider"
        self._core = kubernetes.client.CoreV1Api(self._api_client)

    def _load_configuration(self) -> Any:
        """kubeconfig when one is named; else the pod's service account; else $KUBECONFIG or ~/.kube/config."""
        configuration = kubernetes.client.Configuration()
        s = self.settings
        try:
            if s.kubeconfig is not None:
                kubernetes.config.load_kube_config(config_file=str(s.kubeconfig), context=s.kube_context,
                                                   client_configuration=configuration, persist_config=False)
            else:
                try:
                    kubernetes.config.load_incluster_config(client_configuration=configuration)
                except kubernetes.config.ConfigException:
                    kubernetes.config.load_kube_config(context=s.kube_context, client_configuration=configuration,
                                                       persist_config=False)
        except (kubernetes.config.ConfigException, OSError, ValueError) as exc:
            where = f"--kubeconfig {s.kubeconfig}" if s.kubeconfig else "in-cluster, $KUBECONFIG or ~/.kube/config"
            raise ApiError("load configuration", 0, f"no usable cluster configuration ({where}): {exc}",
                           transient=False) from None
        # Our retry loop is the only one: bounded, with backoff, and aware of Retry-After.
        configuration.retries = False
        configuration.connection_pool_maxsize = s.kube_max_inflight + 2
        return configuration

    async def close(self) -> None:
        self.stop_watch()
        if self._api_client is not None:
            api_client, self._api_client = self._api_client, None
            await asyncio.get_running_loop().run_in_executor(self._executor, api_client.close)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # --- one call, retried --------------------------------------------------------------------

    def _blocking(self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        resp = method(*args, _preload_content=False, _request_timeout=self._timeout, **kwargs)
        try:
            data = resp.data
        finally:
            resp.release_conn()
        return json.loads(data) if data else {}

    async def _call(self, operation: str, method_name: str, *args: Any, **kwargs: Any) -> Any:
        if self._core is None or self._executor is None:
            raise ApiError(operation, 0, "the provider is not started", transient=False)
        method = getattr(self._core, method_name)
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            self.stats.calls += 1
            self.stats.by_operation[operation] = self.stats.by_operation.get(operation, 0) + 1
            delay: float | None = None
            try:
                return await loop.run_in_executor(self._executor,
                                                  functools.partial(self._blocking, method, args, kwargs))
            except ApiException as exc:
                status = int(exc.status or 0)
                message = _message(exc)
                if status == 404:
                    raise NotFound(operation, status, message, transient=False) from None
                if status == 409:
                    self.stats.conflicts += 1
                    raise Conflict(operation, status, message, transient=False) from None
                if status == 410:
                    raise Gone(operation, status, message, transient=True) from None
                if status not in TRANSIENT_STATUSES:
                    # An exhausted ResourceQuota is a 403 that will pass once sandboxes go.
                    quota = status == 403 and "exceeded quota" in message
                    raise ApiError(operation, status, message, transient=quota) from None
                if status == 429:
                    self.stats.throttled += 1
                elif status:
                    self.stats.server_errors += 1
                delay = _retry_after(exc.headers)
                failure = ApiError(operation, status, message, transient=True)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                self.stats.connection_errors += 1
                failure = ApiError(operation, 0, type(exc).__name__, transient=True)
            if attempt >= self.settings.kube_max_retries:
                raise failure
            attempt += 1
            self.stats.retries += 1
            backoff = min(self.settings.kube_backoff_max_seconds, 0.05 * 2 ** attempt) * random.uniform(0.5, 1.0)
            wait = max(delay, backoff) if delay is not None else backoff
            log.info("kubernetes call retried", extra={"operation": operation, "status": failure.status,
                                                       "attempt": attempt, "wait_seconds": round(wait, 3)})
            await asyncio.sleep(wait)

    # --- the calls the provider makes ---------------------------------------------------------

    async def create_pod(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("create_pod", "create_namespaced_pod", self.namespace, body)

    async def get_pod(self, name: str) -> dict[str, Any]:
        return await self._call("get_pod", "read_namespaced_pod", name, self.namespace)

    async def delete_pod(self, name: str, *, uid: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        return await self._call("delete_pod", "delete_namespaced_pod", name, self.namespace, body=body)

    async def delete_pods(self, selector: str) -> dict[str, Any]:
        """Delete every pod the selector matches, in one call (a batch of destroys)."""
        return await self._call("delete_pods", "delete_collection_namespaced_pod", self.namespace,
                                label_selector=selector, propagation_policy="Background")

    async def list_pods(self, selector: str) -> dict[str, Any]:
        return await self._call("list_pods", "list_namespaced_pod", self.namespace, label_selector=selector)

    async def create_secret(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("create_secret", "create_namespaced_secret", self.namespace, body)

    async def get_secret(self, name: str) -> dict[str, Any]:
        return await self._call("get_secret", "read_namespaced_secret", name, self.namespace)

    # --- the watch (blocking: runs on the watcher's own thread) -------------------------------

    def watch_pods_blocking(self, selector: str, resource_version: str,
                            timeout_seconds: int) -> Iterator[dict[str, Any]]:
        """Yield raw watch events from `resource_version` until the server ends the request.

        An ERROR event carrying 410 (or an HTTP 410) raises `Gone`; other failures raise
        `ApiError`. `stop_watch()` from another thread ends the stream promptly.
        """
        if self._core is None:
            raise ApiError("watch_pods", 0, "the provider is not started", transient=False)
        self.stats.calls += 1
        self.stats.by_operation["watch_pods"] = self.stats.by_operation.get("watch_pods", 0) + 1
        try:
            resp = self._core.list_namespaced_pod(
                self.namespace, label_selector=selector, watch=True, resource_version=resource_version,
                timeout_seconds=timeout_seconds, allow_watch_bookmarks=True, _preload_content=False,
                _request_timeout=(self._timeout[0], timeout_seconds + self.settings.kube_api_timeout_seconds))
        except ApiException as exc:
            status = int(exc.status or 0)
            if status == 410:
                raise Gone("watch_pods", status, _message(exc), transient=True) from None
            if status == 429:
                self.stats.throttled += 1
            raise ApiError("watch_pods", status, _message(exc), transient=status in TRANSIENT_STATUSES) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            self.stats.connection_errors += 1
            raise ApiError("watch_pods", 0, type(exc).__name__, transient=True) from None
        with self._watch_lock:
            if self._watch_stopped:  # stop_watch() came while the request was being made
                resp.close()
                return
            self._watch_resp = resp
        try:
            for line in iter_resp_lines(resp):
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    failure = event.get("object") or {}
                    code = int(failure.get("code") or 0)
                    if code == 410:
                        raise Gone("watch_pods", code, str(failure.get("message", "")), transient=True)
                    raise ApiError("watch_pods", code, str(failure.get("message", "")), transient=True)
                yield event
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            self.stats.connection_errors += 1
            raise ApiError("watch_pods", 0, type(exc).__name__, transient=True) from None
        finally:
            with self._watch_lock:
                self._watch_resp = None
            resp.close()  # a watch connection is not worth returning to the pool

    def stop_watch(self) -> None:
        """End the watch for good from another thread: a stream being read (its socket is shut
        down), and one whose request is still being made (it ends as soon as it is answered)."""
        with self._watch_lock:
            self._watch_stopped = True
            resp = self._watch_resp
        if resp is None:
            return
        try:
            resp.shutdown()
        except Exception:  # best effort: the read timeout ends the stream anyway
            log.debug("could not shut down the watch stream", exc_info=True)
