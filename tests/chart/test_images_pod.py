""".ci/images runs the sandbox image as the kubernetes provider's pod: the translation to podman, checked here.

`.ci/images.d/pod.py` turns the provider's own `build_pod` (with the chart's default
pool and uid) into `podman run` arguments. These checks need no container engine,
so a pod field added to the provider fails here at once, not only in the image step.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from chart_support import CHART, ROOT

from sandpool.controller.templates import parse_pools
from sandpool.providers.kubernetes.pods import PodOptions, build_pod
from sandpool.providers.kubernetes.settings import KubernetesProviderSettings


def _pod_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_images_pod", ROOT / ".ci" / "images.d" / "pod.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


POD = _pod_module()


def _chart_pod() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    (pool,) = parse_pools({"pools": [POD.pool_from_values(values, "localhost/sandpool/sandbox:0.1.0")]})
    settings = KubernetesProviderSettings(kube_sandbox_uid=values["sandboxes"]["uid"],
                                          kube_agent_port=values["sandboxes"]["agentPort"])
    return build_pod(pool, "ci-smoke", PodOptions.from_settings(settings), attempt="ci")


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    return list(itertools.pairwise(argv))


def test_the_pod_becomes_a_hardened_podman_run() -> None:
    pod = _chart_pod()
    out = POD.translate(copy.deepcopy(pod), "sbx", "/secret-dir")
    argv, pairs = out["argv"], _pairs(out["argv"])
    assert ("--user", "10001:10001") in pairs and ("--group-add", "10001") in pairs
    assert ("--cap-drop", "ALL") in pairs and ("--security-opt", "no-new-privileges") in pairs
    assert "--read-only" in argv and "--read-only-tmpfs=false" in argv
    assert ("--network", "none") in pairs
    assert ("--memory", str(1024**3)) in pairs and ("--cpus", "1.000") in pairs
    tmpfs = dict(value.split(":", 1) for flag, value in pairs if flag == "--tmpfs")
    assert set(tmpfs) == {"/workspace", "/tmp"}
    assert f"size={1024**3}" in tmpfs["/workspace"] and f"size={64 * 1024**2}" in tmpfs["/tmp"]
    assert ("--volume", "/secret-dir:/var/run/sandpool:ro") in pairs
    assert out["secret"] == {"file": "secret", "mode": 0o440, "group": 10001}
    container = pod["spec"]["containers"][0]
    entry = argv.index("--entrypoint")
    assert json.loads(argv[entry + 1]) == container["command"] == ["sandpool", "agent"]
    assert argv[entry + 2] == "localhost/sandpool/sandbox:0.1.0"
    assert argv[entry + 3:] == container["args"] == out["args"]
    env = [value for flag, value in pairs if flag == "--env"]
    assert env == [f"{e['name']}={e['value']}" for e in container["env"]]
    assert (out["port"], out["health"], out["uid"]) == (8080, "/healthz", 10001)


@pytest.mark.parametrize(("where", "change"), [
    ("spec", lambda pod: pod["spec"].update(hostNetwork=True)),
    ("container", lambda pod: pod["spec"]["containers"][0].update(stdin=True)),
    ("container.securityContext",
     lambda pod: pod["spec"]["containers"][0]["securityContext"].update(procMount="Unmasked")),
    ("volume", lambda pod: pod["spec"]["volumes"].__setitem__(0, {"name": "workspace", "hostPath": {"path": "/"}})),
])
def test_a_pod_field_it_cannot_reproduce_stops_the_run(where: str, change: Any) -> None:
    pod = _chart_pod()
    change(pod)
    with pytest.raises(POD.Untranslatable):
        POD.translate(pod, "sbx", "/secret-dir")


def test_a_pod_that_may_run_as_root_is_refused() -> None:
    pod = _chart_pod()
    pod["spec"]["securityContext"]["runAsNonRoot"] = False
    with pytest.raises(POD.Untranslatable, match="root"):
        POD.translate(pod, "sbx", "/secret-dir")


def test_pod_py_is_standalone_python() -> None:
    """It runs inside the control-plane image as a script: no import from tests or the checkout."""
    source = Path(ROOT / ".ci" / "images.d" / "pod.py").read_text()
    assert "chart_support" not in source and "tests" not in source.split('"""', 2)[2]
