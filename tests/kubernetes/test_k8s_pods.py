"""The sandbox pod and Secret builders, compared as whole objects for several templates.

A second check feeds each object through the official client's own models: a
misspelt field (which the API server would silently drop) makes the round trip
differ.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiClient, V1Pod, V1Secret

from sandpool.controller.provider import PoolSpec
from sandpool.controller.templates import load_pools
from sandpool.providers.kubernetes.pods import (
    InvalidPool,
    PodOptions,
    agent_address,
    build_pod,
    build_secret,
    installation_selector,
    read_pod,
    sandboxes_selector,
)

OPTS = PodOptions(namespace="sandboxes")

SECURITY_POD = {
    "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
SECURITY_CONTAINER = {
    "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
    "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
}
ENV = [
    {"name": "HOME", "value": "/workspace"}, {"name": "TMPDIR", "value": "/tmp"},
    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"},
]
PROBE = {
    "httpGet": {"path": "/healthz", "port": "agent", "scheme": "HTTP"},
    "periodSeconds": 1, "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 3,
}
MOUNTS = [
    {"name": "workspace", "mountPath": "/workspace"},
    {"name": "tmp", "mountPath": "/tmp"},
    {"name": "agent-secret", "mountPath": "/var/run/sandpool", "readOnly": True},
]
AGENT_ARGS = ["--host", "0.0.0.0", "--port", "8080", "--workspace", "/workspace",
              "--secret-file", "/var/run/sandpool/secret"]


def labels(pool: str, sandbox: str, *, installation: str = "sandpool") -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "sandpool", "app.kubernetes.io/component": "sandbox",
        "app.kubernetes.io/managed-by": "sandpool", "sandpool.dev/installation": installation,
        "sandpool.dev/pool": pool, "sandpool.dev/sandbox": sandbox,
    }


def roundtrip(obj: dict[str, Any], model: type) -> dict[str, Any]:
    return ApiClient().sanitize_for_serialization(model.from_dict(obj))


def test_minimal_pool_pod() -> None:
    """A pool from flags only (no template extras): defaults everywhere, nothing optional set."""
    pod = build_pod(PoolSpec(name="default", image="python"), "sb-0a1b", OPTS, attempt="t1")
    assert pod == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "sandpool-sb-0a1b", "namespace": "sandboxes", "labels": labels("default", "sb-0a1b"),
            "annotations": {"sandpool.dev/create-attempt": "t1"},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "securityContext": SECURITY_POD,
            "containers": [{
                "name": "agent", "image": "python", "imagePullPolicy": "IfNotPresent",
                "command": ["sandpool", "agent"], "args": AGENT_ARGS, "env": ENV,
                "ports": [{"name": "agent", "containerPort": 8080, "protocol": "TCP"}],
                "resources": {},
                "securityContext": SECURITY_CONTAINER,
                "readinessProbe": PROBE,
                "volumeMounts": MOUNTS,
            }],
            "volumes": [
                {"name": "workspace", "emptyDir": {"sizeLimit": "1Gi"}},
                {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                {"name": "agent-secret", "secret": {"secretName": "sandpool-sb-0a1b-t1", "defaultMode": 0o440,
                                                    "optional": False}},
            ],
        },
    }
    assert roundtrip(pod, V1Pod) == pod


def test_full_template_pod(tmp_path: Path) -> None:
    """Every template field lands where Kubernetes reads it; installation options too."""
    (tmp_path / "pools.yaml").write_text("""
pools:
  - name: gpu
    image: registry.example/gpu:3
    command: [/opt/bin/sandpool, agent]
    args: [--max-processes, "64"]
    resources:
      requests: {cpu: 500m, memory: 512Mi}
      limits: {cpu: 2, memory: 2Gi}
    runtime_class: kata
    node_selector: {pool: sandboxes}
    tolerations:
      - {key: dedicated, operator: Equal, value: sandbox, effect: NoSchedule}
    workspace_size: 5Gi
""")
    (pool,) = load_pools(tmp_path / "pools.yaml")
    opts = PodOptions(namespace="ns", installation="prod", agent_port=9000, uid=4242, tmp_size="16Mi",
                      image_pull_policy="Always", priority_class="sandbox-low", service_account="sandbox",
                      termination_grace_seconds=0)
    pod = build_pod(pool, "sb-ff", opts, attempt="t2")
    assert pod == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "prod-sb-ff", "namespace": "ns",
            "labels": labels("gpu", "sb-ff", installation="prod"),
            "annotations": {"sandpool.dev/create-attempt": "t2"},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "securityContext": {**SECURITY_POD, "runAsUser": 4242, "runAsGroup": 4242, "fsGroup": 4242},
            "containers": [{
                "name": "agent", "image": "registry.example/gpu:3", "imagePullPolicy": "Always",
                "command": ["/opt/bin/sandpool", "agent"],
                "args": ["--host", "0.0.0.0", "--port", "9000", "--workspace", "/workspace",
                         "--secret-file", "/var/run/sandpool/secret", "--max-processes", "64"],
                "env": ENV,
                "ports": [{"name": "agent", "containerPort": 9000, "protocol": "TCP"}],
                "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
                "securityContext": SECURITY_CONTAINER,
                "readinessProbe": PROBE,
                "volumeMounts": MOUNTS,
            }],
            "volumes": [
                {"name": "workspace", "emptyDir": {"sizeLimit": "5Gi"}},
                {"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}},
                {"name": "agent-secret", "secret": {"secretName": "prod-sb-ff-t2", "defaultMode": 0o440,
                                                    "optional": False}},
            ],
            "runtimeClassName": "kata",
            "nodeSelector": {"pool": "sandboxes"},
            "tolerations": [{"operator": "Equal", "key": "dedicated", "value": "sandbox", "effect": "NoSchedule"}],
            "priorityClassName": "sandbox-low",
            "serviceAccountName": "sandbox",
        },
    }
    assert roundtrip(pod, V1Pod) == pod


def test_limits_only_pool_and_gvisor_example() -> None:
    """The shipped gVisor example: limits and requests, runtime class, selector, toleration."""
    pools = load_pools(Path(__file__).resolve().parents[2] / "deploy" / "pools" / "gvisor.yaml")
    for pool in pools:
        pod = build_pod(pool, "sb-1", OPTS, attempt="x")
        assert roundtrip(pod, V1Pod) == pod
        assert pod["spec"]["runtimeClassName"] == "gvisor"
        assert pod["spec"]["tolerations"][0]["effect"] == "NoSchedule"
    limited = build_pod(PoolSpec(name="p", image="i", cpu="1", memory="1Gi"), "sb-1", OPTS, attempt="x")
    assert limited["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "1", "memory": "1Gi"}}


def test_secret_is_owned_by_its_pod_and_never_in_the_pod() -> None:
    pool = PoolSpec(name="default", image="python")
    secret_value = "s3cr3t-value-that-must-stay-out-of-the-pod"
    pod = build_pod(pool, "sb-9", OPTS, attempt="t3")
    secret = build_secret(pool, "sb-9", OPTS, secret=secret_value, owner_uid="uid-1", attempt="t3")
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "sandpool-sb-9-t3", "namespace": "sandboxes", "labels": labels("default", "sb-9"),
            "annotations": {"sandpool.dev/create-attempt": "t3"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "sandpool-sb-9", "uid": "uid-1"}],
        },
        "type": "Opaque",
        "immutable": True,
        "data": {"secret": base64.b64encode(secret_value.encode()).decode()},
    }
    assert roundtrip(secret, V1Secret) == secret
    assert pod["spec"]["volumes"][2]["secret"]["secretName"] == secret["metadata"]["name"]
    assert secret_value not in repr(pod)
    assert base64.b64encode(secret_value.encode()).decode() not in repr(pod)


def test_with_egress_the_credential_is_in_the_secret_and_the_proxy_in_the_agent_flags() -> None:
    pool = PoolSpec(name="default", image="python", args=("--extra", "1"))
    credential = "egress-credential-that-must-stay-out-of-the-pod"
    pod = build_pod(pool, "sb-8", OPTS, attempt="t5", egress_proxy="10.96.0.20:3128")
    assert pod["spec"]["containers"][0]["args"] == [
        *AGENT_ARGS, "--egress-proxy", "10.96.0.20:3128", "--egress-credential-file", "/var/run/sandpool/egress",
        "--extra", "1"]
    assert pod["spec"]["containers"][0]["volumeMounts"] == MOUNTS  # the one Secret volume holds both keys
    assert pod["metadata"]["labels"] == labels("default", "sb-8")
    secret = build_secret(pool, "sb-8", OPTS, secret="agent", owner_uid="uid-8", attempt="t5",
                          egress_credential=credential)
    assert secret["data"] == {"secret": base64.b64encode(b"agent").decode(),
                              "egress": base64.b64encode(credential.encode()).decode()}
    assert roundtrip(secret, V1Secret) == secret and roundtrip(pod, V1Pod) == pod
    assert credential not in repr(pod) and base64.b64encode(credential.encode()).decode() not in repr(pod)
    without = build_pod(pool, "sb-8", OPTS, attempt="t5")
    assert "--egress-proxy" not in without["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("bad", ["", "SB-1", "sb_1", "-sb", "sb-", "a" * 64, "sb.1", "sb 1"])
def test_bad_sandbox_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidPool, match="is not a DNS label"):
        build_pod(PoolSpec(name="p", image="i"), bad, OPTS, attempt="x")


def test_untyped_options_are_refused() -> None:
    # Options come typed from the pools file (validated there, once); a raw dict is a caller's bug.
    pool = PoolSpec(name="p", image="i", options={"kubernetes": {"node_selector": ["not", "a", "map"]}})
    with pytest.raises(InvalidPool, match="pool 'p' has invalid Kubernetes settings"):
        build_pod(pool, "sb-1", OPTS, attempt="x")


def test_selectors_and_addresses() -> None:
    assert installation_selector("prod") == "sandpool.dev/installation=prod,app.kubernetes.io/component=sandbox"
    assert sandboxes_selector("prod", ["sb-2", "sb-1"]) == (
        "sandpool.dev/installation=prod,app.kubernetes.io/component=sandbox,sandpool.dev/sandbox in (sb-1,sb-2)")
    assert agent_address("10.0.0.7", 8080) == "http://10.0.0.7:8080"
    assert agent_address("fd00::7", 8080) == "http://[fd00::7]:8080"


def test_read_pod() -> None:
    pod = build_pod(PoolSpec(name="default", image="python"), "sb-3", OPTS, attempt="t4")
    pod["metadata"].update(uid="u-3", resourceVersion="17")
    pending = read_pod(pod)
    assert (pending.name, pending.uid, pending.sandbox_id, pending.pool, pending.phase, pending.ready,
            pending.pod_ip, pending.terminating, pending.resource_version, pending.attempt) == (
        "sandpool-sb-3", "u-3", "sb-3", "default", "Pending", False, None, False, "17", "t4")
    pod["status"] = {"phase": "Running", "podIP": "10.1.2.3",
                     "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]}
    running = read_pod(pod)
    assert running.ready and running.pod_ip == "10.1.2.3" and not running.finished
    pod["status"] = {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"reason": "OOMKilled"}}}]}
    failed = read_pod(pod)
    assert failed.finished and failed.reason == "OOMKilled" and not failed.ready
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert read_pod(pod).terminating
