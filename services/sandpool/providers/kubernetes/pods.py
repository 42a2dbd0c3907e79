"""Sandbox pods and their Secrets, built by pure functions from typed inputs.

Nothing here talks to a cluster or imports `kubernetes`: `build_pod` and
`build_secret` return the objects exactly as the API server receives them
(plain dicts, camelCase keys), so tests compare the whole object and a
reviewer reads one function to know what a sandbox pod is allowed to do.
`read_pod` turns what the API server sends back into the few facts the
provider acts on.

The agent's per-sandbox secret never appears in the pod spec: the pod mounts a
Secret volume by name, and the Secret (created right after the pod, owned by it)
goes when the pod goes. The kubelet does not start a container before every
volume it mounts exists, so the agent never starts without its secret. With
egress, the sandbox's egress credential travels the same way (a second key of
that Secret), and the agent is told the egress proxy's address.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any

from sandpool.controller.provider import PoolSpec
from sandpool.providers.kubernetes.pool_options import KubernetesPoolOptions

AGENT_CONTAINER = "agent"
AGENT_PORT_NAME = "agent"
WORKSPACE_DIR = "/workspace"
TMP_DIR = "/tmp"  # the pod's own size-limited emptyDir, not the host's /tmp
SECRET_DIR = "/var/run/sandpool"
SECRET_KEY = "secret"
SECRET_FILE = f"{SECRET_DIR}/{SECRET_KEY}"
EGRESS_KEY = "egress"
EGRESS_FILE = f"{SECRET_DIR}/{EGRESS_KEY}"
HEALTH_PATH = "/healthz"
DEFAULT_AGENT_COMMAND = ("sandpool", "agent")

LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_INSTALLATION = "sandpool.dev/installation"
LABEL_POOL = "sandpool.dev/pool"
LABEL_SANDBOX = "sandpool.dev/sandbox"
ANNOTATION_ATTEMPT = "sandpool.dev/create-attempt"

# Sandbox ids become label values and part of object names: a DNS label keeps both valid.
SANDBOX_ID = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class InvalidPool(ValueError):
    """A pool or sandbox id this provider cannot turn into a pod (never worth retrying)."""


@dataclass(frozen=True)
class PodOptions:
    """Installation-wide choices that shape every sandbox pod (from the provider's settings)."""

    namespace: str
    installation: str = "sandpool"
    agent_port: int = 8080
    uid: int = 1000
    tmp_size: str = "64Mi"
    image_pull_policy: str = "IfNotPresent"
    priority_class: str | None = None
    service_account: str | None = None
    termination_grace_seconds: int = 2

    @classmethod
    def from_settings(cls, settings: Any) -> PodOptions:
        return cls(
            namespace=settings.kube_namespace, installation=settings.kube_installation,
            agent_port=settings.kube_agent_port, uid=settings.kube_sandbox_uid, tmp_size=settings.kube_tmp_size,
            image_pull_policy=settings.kube_image_pull_policy, priority_class=settings.kube_priority_class,
            service_account=settings.kube_service_account,
            termination_grace_seconds=settings.kube_termination_grace_seconds,
        )


def pool_options(pool: PoolSpec) -> KubernetesPoolOptions:
    """The pool's Kubernetes options, as the pools file gave them (validated there), else the defaults."""
    options = pool.options.get("kubernetes")
    if options is None:
        return KubernetesPoolOptions()
    if not isinstance(options, KubernetesPoolOptions):  # a caller's bug: never guess what it meant
        raise InvalidPool(f"pool {pool.name!r} has invalid Kubernetes settings: {type(options).__name__}, "
                          "not KubernetesPoolOptions")
    return options


def object_name(installation: str, sandbox_id: str) -> str:
    """Name of a sandbox's pod."""
    return f"{installation}-{sandbox_id}"


def secret_name(installation: str, sandbox_id: str, attempt: str) -> str:
    """Name of the Secret of one pod: unique per create attempt.

    A Secret left by an earlier pod of the same name (the garbage collector lags)
    must never be the one a new pod mounts: the kubelet would mount the stale
    secret at once, and the agent would start with a secret the api and the
    controller do not hold. A per-attempt name makes that collision impossible.
    """
    return f"{installation}-{sandbox_id}-{attempt}"


def check_sandbox_id(sandbox_id: str) -> str:
    if not isinstance(sandbox_id, str) or not SANDBOX_ID.match(sandbox_id):
        raise InvalidPool(f"sandbox id {sandbox_id!r} is not a DNS label (lowercase letters, digits, '-')")
    return sandbox_id


def installation_selector(installation: str) -> str:
    """The label selector of every sandbox pod of one installation (list, watch, runbook)."""
    return f"{LABEL_INSTALLATION}={installation},{LABEL_COMPONENT}=sandbox"


def sandboxes_selector(installation: str, sandbox_ids: list[str]) -> str:
    """The label selector of a few named sandboxes (one batched delete)."""
    return f"{installation_selector(installation)},{LABEL_SANDBOX} in ({','.join(sorted(sandbox_ids))})"


def sandbox_labels(opts: PodOptions, pool: PoolSpec, sandbox_id: str) -> dict[str, str]:
    return {
        LABEL_NAME: "sandpool",
        LABEL_COMPONENT: "sandbox",
        LABEL_MANAGED_BY: "sandpool",
        LABEL_INSTALLATION: opts.installation,
        LABEL_POOL: pool.name,
        LABEL_SANDBOX: sandbox_id,
    }


def agent_command(pool: PoolSpec, opts: PodOptions, *, egress_proxy: str | None = None) -> tuple[list[str], list[str]]:
    """`command` and `args` of the agent container.

    The provider's own flags come first and always: the pod must listen where the
    provider looks and read the secret where the provider puts it, whatever the
    image's entrypoint. A pool's `command` replaces `sandpool agent` (an image that
    installs it elsewhere); a pool's `args` add agent flags after the provider's.
    With `egress_proxy` (IP:PORT), the agent hands sandboxed code that proxy with
    the credential from the pod's Secret.
    """
    command = list(pool.command) or list(DEFAULT_AGENT_COMMAND)
    args = ["--host", "0.0.0.0", "--port", str(opts.agent_port),  # the pod's own network namespace
            "--workspace", WORKSPACE_DIR, "--secret-file", SECRET_FILE]
    if egress_proxy is not None:
        args += ["--egress-proxy", egress_proxy, "--egress-credential-file", EGRESS_FILE]
    return command, [*args, *pool.args]


def _resources(pool: PoolSpec) -> dict[str, dict[str, str]]:
    requests = {k: v for k, v in (("cpu", pool.cpu_request), ("memory", pool.memory_request)) if v}
    limits = {k: v for k, v in (("cpu", pool.cpu), ("memory", pool.memory)) if v}
    out: dict[str, dict[str, str]] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def build_pod(pool: PoolSpec, sandbox_id: str, opts: PodOptions, *, attempt: str,
              egress_proxy: str | None = None) -> dict[str, Any]:
    """The sandbox pod, exactly as POSTed.

    `attempt` (a random token per create) names the pod's Secret and marks the pod, so
    a retried create tells its own pod from another's. `egress_proxy` (IP:PORT) gives
    the pod egress through that proxy (its credential is in the pod's Secret).
    """
    check_sandbox_id(sandbox_id)
    options = pool_options(pool)
    name = object_name(opts.installation, sandbox_id)
    command, args = agent_command(pool, opts, egress_proxy=egress_proxy)
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "restartPolicy": "Never",  # a dead agent means a dead sandbox: it is replaced, never restarted
        "terminationGracePeriodSeconds": opts.termination_grace_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": opts.uid,
            "runAsGroup": opts.uid,
            "fsGroup": opts.uid,  # lets the non-root agent read its 0440 secret file
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [{
            "name": AGENT_CONTAINER,
            "image": pool.image,
            "imagePullPolicy": opts.image_pull_policy,
            "command": command,
            "args": args,
            "env": [
                {"name": "HOME", "value": WORKSPACE_DIR},
                {"name": "TMPDIR", "value": TMP_DIR},
                {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                {"name": "PYTHONUNBUFFERED", "value": "1"},
            ],
            "ports": [{"name": AGENT_PORT_NAME, "containerPort": opts.agent_port, "protocol": "TCP"}],
            "resources": _resources(pool),
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "privileged": False,
                "readOnlyRootFilesystem": True,
                "runAsNonRoot": True,
                "capabilities": {"drop": ["ALL"]},
            },
            "readinessProbe": {
                "httpGet": {"path": HEALTH_PATH, "port": AGENT_PORT_NAME, "scheme": "HTTP"},
                "periodSeconds": 1,
                "timeoutSeconds": 1,
                "successThreshold": 1,
                "failureThreshold": 3,
            },
            "volumeMounts": [
                {"name": "workspace", "mountPath": WORKSPACE_DIR},
                {"name": "tmp", "mountPath": TMP_DIR},
                {"name": "agent-secret", "mountPath": SECRET_DIR, "readOnly": True},
            ],
        }],
        "volumes": [
            {"name": "workspace", "emptyDir": {"sizeLimit": options.workspace_size}},
            {"name": "tmp", "emptyDir": {"sizeLimit": opts.tmp_size}},
            {"name": "agent-secret", "secret": {"secretName": secret_name(opts.installation, sandbox_id, attempt),
                                                "defaultMode": 0o440, "optional": False}},
        ],
    }
    if pool.runtime_class:
        spec["runtimeClassName"] = pool.runtime_class
    if options.node_selector:
        spec["nodeSelector"] = dict(options.node_selector)
    if options.tolerations:
        spec["tolerations"] = [t.as_api() for t in options.tolerations]
    if opts.priority_class:
        spec["priorityClassName"] = opts.priority_class
    if opts.service_account:
        spec["serviceAccountName"] = opts.service_account
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": opts.namespace,
            "labels": sandbox_labels(opts, pool, sandbox_id),
            "annotations": {ANNOTATION_ATTEMPT: attempt},
        },
        "spec": spec,
    }


def build_secret(pool: PoolSpec, sandbox_id: str, opts: PodOptions, *, secret: str, owner_uid: str,
                 attempt: str, egress_credential: str | None = None) -> dict[str, Any]:
    """The agent's secret (and the sandbox's egress credential, when it has one) as a Secret owned by
    its pod, so the garbage collector removes it with the pod."""
    check_sandbox_id(sandbox_id)
    owner = object_name(opts.installation, sandbox_id)
    data = {SECRET_KEY: base64.b64encode(secret.encode()).decode("ascii")}
    if egress_credential is not None:
        data[EGRESS_KEY] = base64.b64encode(egress_credential.encode()).decode("ascii")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(opts.installation, sandbox_id, attempt),
            "namespace": opts.namespace,
            "labels": sandbox_labels(opts, pool, sandbox_id),
            "annotations": {ANNOTATION_ATTEMPT: attempt},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": owner, "uid": owner_uid}],
        },
        "type": "Opaque",
        "immutable": True,
        "data": data,
    }


@dataclass(frozen=True)
class PodState:
    """What the provider needs to know of a pod the API server reported."""

    name: str
    uid: str
    sandbox_id: str | None
    pool: str | None
    phase: str
    ready: bool
    pod_ip: str | None
    terminating: bool
    resource_version: str
    attempt: str | None = None
    reason: str | None = None

    @property
    def finished(self) -> bool:
        """The pod will never serve: its container exited (restartPolicy Never) or it is being deleted."""
        return self.phase in ("Succeeded", "Failed") or self.terminating


def read_pod(obj: dict[str, Any]) -> PodState:
    """The facts of a pod object (as JSON from a list, get or watch event)."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    labels = meta.get("labels") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    reason = status.get("reason")
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        terminated = (cs.get("state") or {}).get("terminated") or {}
        reason = reason or waiting.get("reason") or terminated.get("reason")
    return PodState(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        sandbox_id=labels.get(LABEL_SANDBOX),
        pool=labels.get(LABEL_POOL),
        phase=status.get("phase") or "Pending",
        ready=ready,
        pod_ip=status.get("podIP") or None,
        terminating=bool(meta.get("deletionTimestamp")),
        resource_version=str(meta.get("resourceVersion") or ""),
        attempt=(meta.get("annotations") or {}).get(ANNOTATION_ATTEMPT),
        reason=reason,
    )


def agent_address(pod_ip: str, port: int) -> str:
    """`http://<podIP>:<port>`, with an IPv6 pod IP in brackets."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}"
