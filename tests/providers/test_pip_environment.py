"""An environment marked `pip: true`: a real pip for per-session installs into a layer, the shared environment
untouched; and what pip says when it cannot install, naming why (no egress, or an environment not marked).

Built offline from wheels made here; a session's layer is a directory given in
SANDBOX_PIP_LAYER, as the agent gives it to sandboxed code with egress. Installing
from the index through the egress proxy is tests/e2e/test_egress_pip.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from sandbox_env import make_lock, make_wheel

from sandpool.providers.local import environments
from sandpool.providers.local.environments import EnvironmentSpec


@pytest.fixture(scope="module")
def base() -> environments.PythonInfo:
    return environments.base_python(os.geteuid() == 0)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, base: environments.PythonInfo) -> environments.Environment:
    root = tmp_path_factory.mktemp("pipenv")
    return environments.build(EnvironmentSpec("tiny-pip", make_lock(root), pip=True), root / "cache", base)


def pip(environment: environments.Environment, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k.lower() not in ("https_proxy", "http_proxy") and not k.startswith(("PIP_", "SANDBOX_"))}
    return subprocess.run([environment.python, "-m", "pip", *args], capture_output=True, text=True, timeout=120,
                          env={**clean, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env})


def tree(path: str) -> set[tuple[str, int]]:
    return {(str(p), p.stat().st_mtime_ns) for p in Path(path).rglob("*") if not p.is_symlink()}


def test_a_pip_environment_is_its_own_build_with_a_real_pip_and_the_layer_hook(
        built: environments.Environment, base: environments.PythonInfo) -> None:
    lock = Path(str(built.details["lock"])).read_bytes()
    assert environments.environment_key(lock, base, pip=True) == Path(built.path or "").name
    assert environments.environment_key(lock, base) != environments.environment_key(lock, base, pip=True)
    assert built.pip and built.details["pip"] is True
    root = Path(built.path or "")
    assert (root / environments.REAL_PIP / "pip" / "__pip-runner__.py").is_file()
    assert len(list(root.glob("lib/python3*/site-packages/_sandpool_pip_layer.pth"))) == 1


def test_without_egress_pip_says_so_and_names_the_policy(built: environments.Environment) -> None:
    done = pip(built, "install", "anything")
    assert done.returncode == 1
    assert "no network access (no egress proxy serves it)" in done.stderr and "egress_allow" in done.stderr


def test_with_egress_pip_installs_into_the_layer_and_only_there(built: environments.Environment,
                                                                tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "wheels", name="layered_pkg", version="2.0", source="WHERE = 'layer'\n")
    layer = tmp_path / "workspace" / ".local"
    before = tree(built.path or "")
    egress = {"https_proxy": "http://sandbox:unused@127.0.0.1:9", "SANDBOX_PIP_LAYER": str(layer)}
    done = pip(built, "install", "--no-index", str(wheel), **egress)
    assert done.returncode == 0, done.stderr
    assert list(layer.glob("lib/python3*/site-packages/layered_pkg.py"))
    assert tree(built.path or "") == before  # the shared environment did not change
    seen = subprocess.run([built.python, "-I", "-c", "import layered_pkg; print(layered_pkg.WHERE)"],
                          capture_output=True, text=True, env={"SANDBOX_PIP_LAYER": str(layer)})
    assert seen.stdout == "layer\n", seen.stderr
    other = subprocess.run([built.python, "-I", "-c", "import layered_pkg"], capture_output=True, text=True,
                           env={"SANDBOX_PIP_LAYER": str(tmp_path / "another" / ".local")})
    assert other.returncode != 0  # another session's layer is its own
    listed = pip(built, "list", "--format", "freeze", **egress)
    assert {"layered_pkg==2.0", "sandpool_probe_pkg==1.0"} <= set(listed.stdout.split()), listed.stderr


def test_an_environment_not_marked_pip_says_so_when_the_sandbox_has_egress(tmp_path: Path,
                                                                           base: environments.PythonInfo) -> None:
    plain = environments.build(EnvironmentSpec("tiny", make_lock(tmp_path)), tmp_path / "cache", base)
    assert not plain.pip and not (Path(plain.path or "") / environments.REAL_PIP).exists()
    refused = pip(plain, "install", "x", https_proxy="http://sandbox:unused@127.0.0.1:9",
                  SANDBOX_PIP_LAYER=str(tmp_path / "layer"))
    assert refused.returncode == 1 and "not marked `pip: true`" in refused.stderr
    offline = pip(plain, "install", "x")
    assert offline.returncode == 1 and "this sandbox has no network access" in offline.stderr
