"""Print the `podman run` arguments of a sandbox pod, as the kubernetes provider builds the pod.

Runs inside the control-plane image (it has sandpool and PyYAML):

    python pod.py VALUES_YAML IMAGE SECRET_DIR NAME

The pod comes from the provider's own `build_pod`, configured as the chart
configures the controller (values.yaml: `sandboxes.uid`, `sandboxes.agentPort`,
the first pool's resources and workspace size; the provider's defaults for the
rest), so the image is run exactly as a cluster runs it. Every field of the pod
is translated or refused: a field this script does not know stops the run
rather than being dropped in silence. Output: one JSON object with `argv` (the
words after `podman run`) and `secret` (the file name, mode and group the
kubelet gives the mounted Secret), for .ci/images to act on.

A pod has a network namespace of its own and the chart's NetworkPolicy denies
its egress: the container gets `--network none`, and the smoke client joins that
namespace (`--network container:NAME`) to reach the agent on its port.
"""

from __future__ import annotations

import json
import sys
from decimal import Decimal
from typing import Any

import yaml

from sandpool.controller.templates import parse_pools, parse_quantity
from sandpool.providers.kubernetes.pods import SECRET_KEY, PodOptions, build_pod
from sandpool.providers.kubernetes.settings import KubernetesProviderSettings


class Untranslatable(Exception):
    """A pod field with no podman equivalent here."""


def pool_from_values(values: dict[str, Any], image: str) -> dict[str, Any]:
    """The chart's first pool in the pools.yaml form (templates/_helpers.tpl, sandpool.poolsFile)."""
    pool = values["pools"][0]
    out: dict[str, Any] = {"name": pool["name"], "image": image, "warm": 1, "ceiling": 1,
                           "workspace_size": pool.get("workspaceSize") or "1Gi",
                           "egress": bool(pool.get("egress", False)), "args": list(pool.get("args") or [])}
    if pool.get("resources"):
        out["resources"] = pool["resources"]
    if pool.get("runtimeClassName"):
        raise Untranslatable("the chart's default pool names a RuntimeClass; podman has none")
    return out


def expect(obj: dict[str, Any], where: str, known: set[str]) -> None:
    unknown = set(obj) - known
    if unknown:
        raise Untranslatable(f"{where}: {sorted(unknown)} not translated to podman by .ci/images.d/pod.py")


def size(quantity: str) -> int:
    return int(parse_quantity(quantity))


def translate(pod: dict[str, Any], name: str, secret_dir: str) -> dict[str, Any]:
    spec = pod["spec"]
    expect(spec, "spec", {"automountServiceAccountToken", "enableServiceLinks", "restartPolicy",
                          "terminationGracePeriodSeconds", "securityContext", "containers", "volumes"})
    if spec["automountServiceAccountToken"] is not False or spec["enableServiceLinks"] is not False:
        raise Untranslatable("the pod would get a service account token or service links")
    if spec["restartPolicy"] != "Never":
        raise Untranslatable(f"restartPolicy {spec['restartPolicy']}")
    pod_sc = spec["securityContext"]
    expect(pod_sc, "spec.securityContext", {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "seccompProfile"})
    if pod_sc["seccompProfile"] != {"type": "RuntimeDefault"}:
        raise Untranslatable(f"seccompProfile {pod_sc['seccompProfile']}")
    uid, gid, fs_group = pod_sc["runAsUser"], pod_sc["runAsGroup"], pod_sc["fsGroup"]
    if pod_sc["runAsNonRoot"] is not True or uid == 0:
        raise Untranslatable("the pod may run as root")
    (container,) = spec["containers"]
    expect(container, "container", {"name", "image", "imagePullPolicy", "command", "args", "env", "ports",
                                    "resources", "securityContext", "readinessProbe", "volumeMounts"})
    sc = container["securityContext"]
    expect(sc, "container.securityContext", {"allowPrivilegeEscalation", "privileged", "readOnlyRootFilesystem",
                                             "runAsNonRoot", "capabilities"})
    if sc["privileged"] is not False or sc["runAsNonRoot"] is not True:
        raise Untranslatable("the container may be privileged or root")
    argv = ["--name", name, "--network", "none", "--pull", "never",
            # The pod's ids; the kubelet adds fsGroup to the process's groups.
            "--user", f"{uid}:{gid}", "--group-add", str(fs_group),
            # seccomp RuntimeDefault: podman's default profile, left as it is.
            "--stop-timeout", str(spec["terminationGracePeriodSeconds"])]
    if sc["allowPrivilegeEscalation"] is False:
        argv += ["--security-opt", "no-new-privileges"]
    if sc["readOnlyRootFilesystem"] is True:
        # Writable only where the pod mounts a volume: no tmpfs of podman's own on /tmp, /run.
        argv += ["--read-only", "--read-only-tmpfs=false"]
    caps = sc["capabilities"]
    expect(caps, "capabilities", {"drop", "add"})
    for cap in caps.get("drop", []):
        argv += ["--cap-drop", cap]
    for cap in caps.get("add", []):
        argv += ["--cap-add", cap]
    resources = container["resources"]
    expect(resources, "resources", {"requests", "limits"})
    limits = resources.get("limits", {})
    expect(limits, "resources.limits", {"cpu", "memory"})
    if "cpu" in limits:
        argv += ["--cpus", str(parse_quantity(limits["cpu"]).quantize(Decimal("0.001")))]
    if "memory" in limits:
        argv += ["--memory", str(size(limits["memory"]))]
    for item in container["env"]:
        expect(item, "env[]", {"name", "value"})
        argv += ["--env", f"{item['name']}={item['value']}"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    secret: dict[str, Any] = {}
    for mount in container["volumeMounts"]:
        expect(mount, "volumeMounts[]", {"name", "mountPath", "readOnly"})
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            expect(volume["emptyDir"], "emptyDir", {"sizeLimit"})
            # An emptyDir: empty (notmpcopyup), writable by the pod (U: owned by its uid:gid, which is
            # also the fsGroup), exec allowed as on a node's disk, capped at its sizeLimit.
            limit = size(volume["emptyDir"]["sizeLimit"])
            argv += ["--tmpfs", f"{mount['mountPath']}:rw,exec,nosuid,nodev,notmpcopyup,size={limit},U"]
        elif "secret" in volume:
            expect(volume["secret"], "secret", {"secretName", "defaultMode", "optional"})
            secret = {"file": SECRET_KEY, "mode": volume["secret"]["defaultMode"], "group": fs_group}
            argv += ["--volume", f"{secret_dir}:{mount['mountPath']}:ro"]
            if not mount.get("readOnly"):
                raise Untranslatable("the secret is mounted writable")
        else:
            raise Untranslatable(f"volume {mount['name']}: {sorted(volume)}")
    probe = container["readinessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    command, args = container["command"], container["args"]
    argv += ["--entrypoint", json.dumps(command), container["image"], *args]
    return {"argv": argv, "secret": secret, "port": ports[probe["port"]], "health": probe["path"],
            "uid": uid, "args": args}


def main() -> int:
    values_path, image, secret_dir, name = sys.argv[1:5]
    with open(values_path) as fh:
        values = yaml.safe_load(fh)
    (pool,) = parse_pools({"pools": [pool_from_values(values, image)]}, source=values_path)
    settings = KubernetesProviderSettings(kube_sandbox_uid=values["sandboxes"]["uid"],
                                          kube_agent_port=values["sandboxes"]["agentPort"])
    pod = build_pod(pool, "ci-smoke", PodOptions.from_settings(settings), attempt="ci")
    try:
        out = translate(pod, name, secret_dir)
    except Untranslatable as exc:
        print(f"pod.py: {exc}", file=sys.stderr)
        return 2
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
