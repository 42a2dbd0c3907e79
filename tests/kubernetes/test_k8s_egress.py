"""Kubernetes sandboxes with egress: the credential in the pod's own Secret, the proxy's address resolved by the
provider (sandbox pods have no DNS), the credential's digest published for the lease to bind."""

from __future__ import annotations

import base64
from typing import Any

from realapi import RealCluster

from sandpool.controller.provider import PoolSpec
from sandpool.state.keys import egress_digest

POOL = PoolSpec(name="default", image="python", cpu="1", memory="512Mi")


async def test_a_sandbox_gets_its_credential_by_secret_and_the_proxy_by_address(
        make_provider: Any, cluster: RealCluster, namespace: str) -> None:
    provider = await make_provider(kube_egress_proxy="localhost:3128")
    info = await provider.create(POOL, "sb-egress")
    (pod,) = cluster.pods(namespace)
    args = pod["spec"]["containers"][0]["args"]
    proxy = args[args.index("--egress-proxy") + 1]
    assert proxy in ("127.0.0.1:3128", "[::1]:3128")  # the name resolved by the provider
    assert args[args.index("--egress-credential-file") + 1] == "/var/run/sandpool/egress"
    (secret,) = cluster.secrets(namespace, "sandpool.dev/sandbox=sb-egress")
    credential = base64.b64decode(secret["data"]["egress"]).decode()
    assert len(credential) >= 32 and credential != info.secret
    assert info.egress_digest == egress_digest(credential)
    assert credential not in str(pod)
    await provider.destroy("sb-egress")


async def test_without_egress_there_is_no_credential(provider: Any, cluster: RealCluster, namespace: str) -> None:
    info = await provider.create(POOL, "sb-plain")
    (pod,) = cluster.pods(namespace)
    assert "--egress-proxy" not in pod["spec"]["containers"][0]["args"]
    (secret,) = cluster.secrets(namespace, "sandpool.dev/sandbox=sb-plain")
    assert set(secret["data"]) == {"secret"} and info.egress_digest is None
    await provider.destroy("sb-plain")
